"""The interface every engine adapter implements, and what a server start is asked for."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from wmtp.layout import Draft


class CellRefused(ValueError):
    """An engine cannot run a cell as configured; raised before its server starts, the message says why."""


@dataclass(frozen=True)
class ServeRequest:
    """One server start: which interpreter serves which model, on which port, with which draft."""

    python: str
    model_dir: Path | str
    served_name: str
    port: int
    max_model_len: int
    # The cell's own draft (a config.Cell is one), so the server drafts what the cell id names.
    draft: Draft
    engine_args: Sequence[str] = field(default_factory=tuple)
    model_args: Sequence[str] = field(default_factory=tuple)
    # The cell's arm entry's own serve args, after the engine's and the model's (the last value of a flag wins).
    arm_args: Sequence[str] = field(default_factory=tuple)
    host: str = "127.0.0.1"
    # Where the engine's profiler writes its traces, and how many engine iterations a start traces (0: off).
    profile_dir: Path | None = None
    profile_iterations: int = 0
    # The longest prompt a profiled server prefills: the engine lets its prefill steps pass before it traces.
    profile_prompt_tokens: int = 0


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` in an argv (``--flag v`` or ``--flag=v``); the last one wins, as in argparse."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


class EngineAdapter(ABC):
    """What the pipeline needs of an engine: a server command, its environment, and its counters.

    The defaults suit an engine whose server counters can be differenced over a rung (vLLM); an engine
    that counts per response instead (SGLang) overrides ``request_fields`` and ``counters_from_requests``.
    """

    kind: ClassVar[str]
    health_path: ClassVar[str] = "/health"
    # Python source that prints ``WMTP-PROBE <json>`` inside the engine's environment (the build's self-check).
    version_probe: ClassVar[str]
    # Fields added to every request body.
    request_extra: ClassVar[Mapping[str, Any] | None] = None
    # Fields added where a study records each generated token's id (the client asks for log-probabilities itself).
    token_request_fields: ClassVar[Mapping[str, Any]] = {}
    # Environment variables that must point into the cell's own directories, never a shared default.
    cache_env: ClassVar[tuple[str, ...]] = ()
    # The counter of ``read_counters`` that counts finished requests on the engine's own clock, where the engine
    # keeps one: a snapshot after a request waits until it has moved, since the engine may record a request's
    # figures after its stream has ended. None: the engine keeps no per-request clock on its server.
    finished_requests_counter: ClassVar[str | None] = None

    @abstractmethod
    def serve_argv(self, request: ServeRequest) -> list[str]:
        """The server command as a list (never a shell string)."""

    @abstractmethod
    def server_env(
        self, engine_env: Mapping[str, str], work_dir: Path, tmp_dir: Path, request: ServeRequest | None = None
    ) -> dict[str, str]:
        """The server's environment: the engine's own settings, caches under ``work_dir``, temp in ``tmp_dir``;
        ``request`` is the start it is for, where the environment carries something of its cell."""

    @abstractmethod
    def read_counters(self, base_url: str) -> dict[str, float]:
        """Cumulative spec-decode counters of a running server, by short name (drafts, accepted, …)."""

    def check_cell(self, spec: Any, engine_manifest: Mapping[str, Any], cell: Any, extra_args: Sequence[str]) -> None:
        """Refuse a cell before its server starts (raise :class:`CellRefused`); accept by default."""
        return None

    def verify_cell(self, run_dir: Path, server_env: Mapping[str, str], cell: Any, protocol: Any) -> dict[str, Any]:
        """After the sweep, with the server stopped: prove the cell ran what it is labelled (raise with the
        reason if not); what it returns is merged into the manifest. Nothing to prove by default."""
        return {}

    def sampling_fields(self, protocol: Any) -> dict[str, Any]:
        """Request-body fields for the protocol's sampling settings beyond the OpenAI schema's: the repetition
        penalty, where the protocol sets one (vLLM's and SGLang's OpenAI servers both take ``repetition_penalty``
        beside the OpenAI fields). vLLM's rejection sampler applies it at each verified position, so a penalised
        answer is the same with a draft as without; SGLang 0.5.17's speculative path applies it "relaxed" (every
        position of a verify cycle gets the penalty as it stood when the cycle began), so there a penalised answer
        depends on where the cycles fall. Nothing at the defaults, so a protocol without them sends the requests it
        always sent."""
        penalty = getattr(protocol, "repetition_penalty", None)
        return {} if penalty is None else {"repetition_penalty": penalty}

    def start_profile(self, base_url: str) -> None:
        """Start the engine's own profiler on a running server (whose ``ServeRequest`` named a profile dir)."""
        raise NotImplementedError(f"{self.kind}: the cells cannot drive this engine's profiler")

    def stop_profile(self, base_url: str) -> None:
        """Stop the engine's profiler and let it write its traces."""
        raise NotImplementedError(f"{self.kind}: the cells cannot drive this engine's profiler")

    def request_fields(self, extensions: Mapping[str, Any]) -> dict[str, Any]:
        """Columns of requests.parquet taken from a response's non-OpenAI fields."""
        return {}

    def counters_from_requests(
        self,
        rows: Sequence[Mapping[str, Any]],
        arm: str,
        k: int,
        server_delta: Mapping[str, float] | None = None,
    ) -> dict[str, float] | None:
        """A rung's counters from its measured rows (or the server's differences over the rung, ``server_delta``),
        where the server's own spec-decode counters cannot be differenced; else None."""
        return None
