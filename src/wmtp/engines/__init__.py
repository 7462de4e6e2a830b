"""Engine adapters (one module per engine kind) and the engine environment build.

An adapter module provides: ``serve_argv(...)``, ``server_env(engine_env, work_dir)``, ``HEALTH_PATH``,
``read_counters(base_url) -> dict[str, float]`` (cumulative spec-decode counters, short names) and
``VERSION_PROBE`` (Python source that prints ``WMTP-PROBE <json>`` inside the engine env).
"""

from __future__ import annotations

from types import ModuleType


def adapter(kind: str) -> ModuleType:
    if kind == "vllm":
        from wmtp.engines import vllm

        return vllm
    raise ValueError(f"no adapter for engine kind {kind!r}")
