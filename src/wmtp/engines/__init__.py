"""Engine adapters (one module per engine kind, each an :class:`EngineAdapter`) and the environment build.

``adapter(kind)`` is the one registry: the cell runner, the build and the container code ask it, never a
module by name.
"""

from __future__ import annotations

from wmtp.engines.base import EngineAdapter, ServeRequest
from wmtp.engines.sglang import SGLangAdapter
from wmtp.engines.vllm import VLLMAdapter

ADAPTERS: dict[str, EngineAdapter] = {a.kind: a for a in (VLLMAdapter(), SGLangAdapter())}

__all__ = ["ADAPTERS", "EngineAdapter", "ServeRequest", "adapter"]


def adapter(kind: str) -> EngineAdapter:
    try:
        return ADAPTERS[kind]
    except KeyError:
        raise ValueError(f"no adapter for engine kind {kind!r} (known: {', '.join(sorted(ADAPTERS))})") from None
