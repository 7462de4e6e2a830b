"""A running server's Prometheus endpoint, read as sums by sample name (both engines export one)."""

from __future__ import annotations

from collections.abc import Mapping

METRICS_PATH = "/metrics"


def parse_samples(text: str, prefix: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every Prometheus sample whose name starts with ``prefix``, keyed by (name, labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(prefix):
                out[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return out


def summed(text: str, prefix: str, names: Mapping[str, str]) -> dict[str, float]:
    """The samples named in ``names`` (sample name → short name), each summed over its labels; a name the text
    lacks is absent from the result."""
    totals: dict[str, float] = {}
    for (name, _labels), value in parse_samples(text, prefix).items():
        if name in names:
            totals[names[name]] = totals.get(names[name], 0.0) + value
    return totals


def fetch_metrics(base_url: str, timeout_s: float = 30.0) -> str:
    """The server's metrics text; raises on an HTTP error (a server started without its metrics answers 404)."""
    import httpx

    response = httpx.get(base_url + METRICS_PATH, timeout=timeout_s)
    response.raise_for_status()
    return response.text
