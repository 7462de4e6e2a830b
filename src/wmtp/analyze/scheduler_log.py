"""The paper's own statistic, read from the lines an engine's scheduler logs while it decodes.

The paper times one speculative iteration (the draft's forwards plus the verify) as TPOT × the mean accept length,
TPOT being the median, over the steady-state decode lines of the scheduler's log, of the line's accept length over
its generation throughput, divided by the mean accept length. So the iteration is the median of accept length over
throughput, times the requests that share the throughput. This module reads those lines from a server's log and
computes that figure, to be set beside the cycle the engine's per-request clock gives.

SGLang logs a decode line every ``--decode-log-interval`` decode steps (40 unless told; the paper's study logs
every step), each over the time since the line before. vLLM logs every 10 s (its stats interval) whatever ran in
it: a line whose interval held a prefill, or only part of a request's decode, is not a steady state, so only lines
with no prompt throughput, the batch running and nothing waiting count, and a vLLM request shorter than its
interval has none.

As the paper's artifact reads them: a line whose pool holds no full-attention token (SGLang's ``#full token: 0``)
is a flush or an empty batch, not a decode step; the first steady lines of a decode are its ramp (SGLang's first
line reaches back over the prefill before it), so ``ramp`` of them are dropped where more than ``ramp + 1`` remain;
and a line whose iteration lies outside 0.4–2.5 times the median is left out of both the median and the mean
accept length. A server log holds every request a cell sent; :func:`segments` splits it where a prefill comes
between decode lines, so that at one request at a time each request's decode is a segment of its own, in order.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

_VLLM_STATS = re.compile(
    r"Avg prompt throughput: (?P<prompt>[\d.]+) tokens/s, Avg generation throughput: (?P<gen>[\d.]+) tokens/s, "
    r"Running: (?P<running>\d+) reqs, Waiting: (?P<waiting>\d+) reqs"
)
_VLLM_SPEC = re.compile(r"SpecDecoding metrics: Mean acceptance length: (?P<accept>[\d.]+)")
_SGLANG_DECODE = re.compile(r"Decode batch[^#]*#running-req: (?P<running>\d+),")
_SGLANG_PREFILL = re.compile(r"Prefill batch")
_SGLANG_FIELD = {
    "accept": re.compile(r"accept len: (?P<v>[\d.]+)"),
    "gen": re.compile(r"gen throughput \(token/s\): (?P<v>[\d.]+)"),
    "waiting": re.compile(r"#queue-req: (?P<v>\d+)"),
    # Tokens in the pool: the full-attention pool's on a hybrid model, the only pool's otherwise.
    "full": re.compile(r"#(?:full )?token: (?P<v>\d+)"),
}
#: Steady lines dropped at the start of a decode: SGLang's first line covers the prefill before it (the paper's
#: artifact drops two); vLLM's lines that held a prefill are not steady in the first place.
RAMP_LINES = {"sglang": 2, "vllm": 0}
#: A line's iteration counts only within this band around the median iteration (the artifact's).
BAND = (0.4, 2.5)


@dataclass(frozen=True)
class DecodeLine:
    """One interval the scheduler logged: requests running and waiting, tokens per verify, tokens per second."""

    running: int
    waiting: int
    accept_length: float
    gen_tokens_per_s: float
    prompt_tokens_per_s: float = 0.0
    # Tokens in the pool (the full-attention pool's on SGLang's hybrid models), where the engine logs them (SGLang).
    full_tokens: int | None = None


@dataclass(frozen=True)
class IterationStatistic:
    """The paper's figures from one log: the iteration and TPOT in ms, over ``lines`` steady-state lines."""

    iteration_ms: float
    tpot_ms: float
    mean_accept_length: float
    lines: int


def vllm_lines(log: Iterable[str]) -> list[DecodeLine]:
    """vLLM's periodic stats lines, each with the acceptance length its SpecDecoding line gives (1 without one)."""
    found: list[DecodeLine] = []
    for text in log:
        stats = _VLLM_STATS.search(text)
        if stats:
            found.append(
                DecodeLine(
                    running=int(stats["running"]),
                    waiting=int(stats["waiting"]),
                    accept_length=1.0,
                    gen_tokens_per_s=float(stats["gen"]),
                    prompt_tokens_per_s=float(stats["prompt"]),
                )
            )
            continue
        spec = _VLLM_SPEC.search(text)
        if spec and found:
            # vLLM logs the SpecDecoding line right after the stats line of the same interval.
            found[-1] = dataclasses.replace(found[-1], accept_length=float(spec["accept"]))
    return found


def _sglang_line(text: str) -> DecodeLine | None:
    decode = _SGLANG_DECODE.search(text)
    if not decode:
        return None
    fields = {name: pattern.search(text) for name, pattern in _SGLANG_FIELD.items()}
    if fields["gen"] is None:
        return None
    return DecodeLine(
        running=int(decode["running"]),
        waiting=int(fields["waiting"]["v"]) if fields["waiting"] else 0,
        accept_length=float(fields["accept"]["v"]) if fields["accept"] else 1.0,
        gen_tokens_per_s=float(fields["gen"]["v"]),
        full_tokens=int(fields["full"]["v"]) if fields["full"] else None,
    )


def sglang_lines(log: Iterable[str]) -> list[DecodeLine]:
    """SGLang's "Decode batch" lines (an accept length of 1 where no draft runs)."""
    return [line for line in map(_sglang_line, log) if line is not None]


def segments(log: Iterable[str], engine: str) -> list[list[DecodeLine]]:
    """The log's decode lines in runs that a prefill separates: SGLang's "Prefill batch" lines, vLLM's intervals with
    prompt throughput. At one request at a time, each run is one request's decode, in the order they were sent."""
    runs: list[list[DecodeLine]] = [[]]
    if engine == "vllm":
        for line in vllm_lines(log):
            if line.prompt_tokens_per_s > 0 and runs[-1]:
                runs.append([])
            runs[-1].append(line)
    else:
        for text in log:
            if _SGLANG_PREFILL.search(text):
                if runs[-1]:
                    runs.append([])
                continue
            line = _sglang_line(text)
            if line is not None:
                runs[-1].append(line)
    return [run for run in runs if run]


def steady_lines(lines: Iterable[DecodeLine], batch: int) -> list[DecodeLine]:
    """Lines of decode alone at ``batch`` requests: nothing prefilled, nothing waiting, tokens generated, and full
    tokens in the pool where the engine counts them."""
    return [
        line
        for line in lines
        if line.running == batch
        and line.waiting == 0
        and line.prompt_tokens_per_s == 0
        and line.gen_tokens_per_s > 0
        and line.full_tokens != 0
    ]


def iteration_statistic(lines: Iterable[DecodeLine], batch: int, ramp: int = 0) -> IterationStatistic | None:
    """The paper's iteration and TPOT over the steady-state lines at ``batch``, less the first ``ramp`` of them and
    those outside :data:`BAND` around the median; None where there are none."""
    steady = steady_lines(lines, batch)
    if len(steady) > ramp + 1:
        steady = steady[ramp:]
    if not steady:
        return None
    per_line = [batch * line.accept_length / line.gen_tokens_per_s for line in steady]
    middle = statistics.median(per_line)
    kept = [(line, s) for line, s in zip(steady, per_line, strict=True) if BAND[0] * middle <= s <= BAND[1] * middle]
    iteration_s = statistics.median(s for _, s in kept)
    mean_accept = statistics.fmean(line.accept_length for line, _ in kept)
    return IterationStatistic(
        iteration_ms=1000 * iteration_s,
        tpot_ms=1000 * iteration_s / mean_accept,
        mean_accept_length=mean_accept,
        lines=len(kept),
    )


def rung_of(tokens: int, rungs: Iterable[int], slack: int) -> int | None:
    """The rung whose request holds ``tokens`` in the pool while it decodes: at least the rung, at most ``slack``
    more (its output and the draft's reserved slots); None where no rung does."""
    fits = [rung for rung in rungs if rung <= tokens <= rung + slack]
    return max(fits) if fits else None


def rung_iterations(
    log: Iterable[str], rungs: Iterable[int], slack: int, ramp: int = RAMP_LINES["sglang"]
) -> dict[int, IterationStatistic]:
    """The paper's figures per rung from an SGLang server log of requests sent one at a time: each request's decode
    lines (a run between two prefills) go to the rung whose tokens their pool holds (:func:`rung_of`), less the first
    ``ramp`` steady ones of each request, and a rung's statistic is taken over all of them together. Warm-ups and
    requests of no listed rung are left out."""
    rungs = list(rungs)
    pooled: dict[int, list[DecodeLine]] = {}
    for run in segments(log, "sglang"):
        tokens = [line.full_tokens for line in run if line.full_tokens]
        rung = rung_of(max(tokens), rungs, slack) if tokens else None
        if rung is None:
            continue
        steady = steady_lines(run, 1)
        pooled.setdefault(rung, []).extend(steady[ramp:] if len(steady) > ramp + 1 else steady)
    found = {rung: iteration_statistic(lines, 1) for rung, lines in sorted(pooled.items())}
    return {rung: statistic for rung, statistic in found.items() if statistic is not None}


#: The room a decoding request's pool has beyond its prompt and output: the draft's reserved slots.
SLACK_TOKENS = 256
#: The cell's settings as its manifest names them.
CELL_KEYS = ["model", "engine", "arm", "k", "sink", "window", "concurrency", "server"]
CELL_COLUMNS = ["cell_id", *CELL_KEYS, "rung", "iteration_ms", "tpot_ms", "mean_accept_length", "lines"]


def cell_rows(manifest: Mapping[str, Any], log: Iterable[str]) -> list[dict[str, Any]]:
    """One row per rung (:data:`CELL_COLUMNS`) of an SGLang cell, from its manifest and its server's log; none for
    a cell of another engine or of more than one request at a time, whose lines no rung can be told from."""
    cell = manifest.get("cell") or {}
    protocol = (manifest.get("identity") or {}).get("protocol") or {}
    if (manifest.get("engine") or {}).get("kind") != "sglang" or cell.get("concurrency", 1) != 1:
        return []
    slack = int(protocol.get("output_tokens", 0)) + SLACK_TOKENS
    found = rung_iterations(log, protocol.get("rungs") or [], slack)
    return [
        {"cell_id": manifest["cell_id"], **{key: cell.get(key) for key in CELL_KEYS}, "rung": rung,
         **dataclasses.asdict(statistic)}
        for rung, statistic in found.items()
    ]  # fmt: skip
