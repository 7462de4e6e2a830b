"""Engine adapters (one module per engine kind) and the engine environment build.

An adapter module provides: ``serve_argv(...)``, ``server_env(engine_env, work_dir, tmp_dir)``, ``HEALTH_PATH``,
``read_counters(base_url) -> dict[str, float]`` (cumulative spec-decode counters, short names) and
``VERSION_PROBE`` (Python source that prints ``WMTP-PROBE <json>`` inside the engine env).

Optional hooks, for engines whose server counters cannot be differenced (SGLang): ``REQUEST_EXTRA`` (fields
added to every request body), ``request_fields(extensions)`` (columns of requests.parquet from a response's
non-OpenAI fields), ``counters_from_requests(rows, arm, k)`` (a rung's counters from its measured rows) and
``check_cell(spec, engine_manifest, cell, extra_args)`` (refuse a cell before its server starts).
"""

from __future__ import annotations

from types import ModuleType


def adapter(kind: str) -> ModuleType:
    if kind == "vllm":
        from wmtp.engines import vllm

        return vllm
    if kind == "sglang":
        from wmtp.engines import sglang

        return sglang
    raise ValueError(f"no adapter for engine kind {kind!r}")
