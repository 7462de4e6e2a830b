"""Shared fixtures: the repo root, the embedded study as a dict, a tiny tokenizer."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def embedded_raw() -> dict:
    """A fresh, mutable copy of config/config.yaml."""
    return copy.deepcopy(yaml.safe_load((REPO / "config" / "config.yaml").read_text()))


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory) -> Path:
    """The tiny model's tokenizer, trained as rules/models.smk trains it (no torch needed)."""
    from wmtp.tiny import train_tokenizer

    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(4096, out, max_chars=1_000_000)
    return out / "tokenizer.json"
