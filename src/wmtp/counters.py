"""Spec-decode counters from Prometheus text: parse, snapshot, delta."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from wmtp.engines import vllm as vllm_adapter


class CounterReset(RuntimeError):
    """A counter went backwards between two snapshots: the window is invalid, not partial."""


def parse_samples(text: str, prefix: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample whose name starts with ``prefix``, keyed by (name, labels)."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix):
                out[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return out


def vllm_spec_counters(text: str) -> dict[str, float]:
    """Short-named vLLM spec-decode counters, summed across ``engine`` labels (data-parallel ranks).

    Keys: drafts, draft_tokens, accepted, accepted_pos_<i>. Missing counters (a server without a
    draft) read as 0, so the ``none`` arm's deltas are 0 rather than absent.
    """
    totals: dict[str, float] = defaultdict(float)
    for short in vllm_adapter.SPEC_COUNTERS.values():
        totals[short] = 0.0
    for (name, labels), value in parse_samples(text, vllm_adapter.COUNTER_PREFIX).items():
        if name in vllm_adapter.SPEC_COUNTERS:
            totals[vllm_adapter.SPEC_COUNTERS[name]] += value
        elif name == vllm_adapter.PER_POSITION_COUNTER:
            position = dict(labels).get("position")
            if position is not None:
                totals[f"accepted_pos_{int(position)}"] += value
    return dict(totals)


@dataclass(frozen=True)
class Snapshot:
    at: float
    values: dict[str, float]


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    keys = sorted(set(before) | set(after))
    out = {}
    for key in keys:
        d = after.get(key, 0.0) - before.get(key, 0.0)
        if d < 0:
            raise CounterReset(f"counter {key} went backwards ({before.get(key)} → {after.get(key)})")
        out[key] = d
    return out


def fetch_metrics(base_url: str, timeout_s: float = 30.0) -> str:
    response = httpx.get(base_url + vllm_adapter.METRICS_PATH, timeout=timeout_s)
    response.raise_for_status()
    return response.text
