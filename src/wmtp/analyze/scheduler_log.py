"""The paper's own statistic, read from the lines an engine's scheduler logs while it decodes.

The paper times one speculative iteration (the draft's forwards plus the verify) as TPOT × the mean accept length,
TPOT being the median, over the steady-state decode lines of the scheduler's log, of the line's accept length over
its generation throughput, divided by the mean accept length. So the iteration is the median of accept length over
throughput, times the requests that share the throughput. This module reads those lines from a server's log and
computes that figure, to be set beside the cycle the engine's per-request clock gives.

SGLang logs a decode line every few dozen decode steps, each over decode alone. vLLM logs every 10 s (its stats
interval) whatever ran in it: a line whose interval held a prefill, or only part of a request's decode, is not a
steady state, so only lines with no prompt throughput, the batch running and nothing waiting count, and a vLLM
request shorter than its interval has none.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

_VLLM_STATS = re.compile(
    r"Avg prompt throughput: (?P<prompt>[\d.]+) tokens/s, Avg generation throughput: (?P<gen>[\d.]+) tokens/s, "
    r"Running: (?P<running>\d+) reqs, Waiting: (?P<waiting>\d+) reqs"
)
_VLLM_SPEC = re.compile(r"SpecDecoding metrics: Mean acceptance length: (?P<accept>[\d.]+)")
_SGLANG_DECODE = re.compile(r"Decode batch[^#]*#running-req: (?P<running>\d+),")
_SGLANG_FIELD = {
    "accept": re.compile(r"accept len: (?P<v>[\d.]+)"),
    "gen": re.compile(r"gen throughput \(token/s\): (?P<v>[\d.]+)"),
    "waiting": re.compile(r"#queue-req: (?P<v>\d+)"),
}


@dataclass(frozen=True)
class DecodeLine:
    """One interval the scheduler logged: requests running and waiting, tokens per verify, tokens per second."""

    running: int
    waiting: int
    accept_length: float
    gen_tokens_per_s: float
    prompt_tokens_per_s: float = 0.0


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


def sglang_lines(log: Iterable[str]) -> list[DecodeLine]:
    """SGLang's "Decode batch" lines (an accept length of 1 where no draft runs)."""
    found: list[DecodeLine] = []
    for text in log:
        decode = _SGLANG_DECODE.search(text)
        if not decode:
            continue
        fields = {name: pattern.search(text) for name, pattern in _SGLANG_FIELD.items()}
        if fields["gen"] is None:
            continue
        found.append(
            DecodeLine(
                running=int(decode["running"]),
                waiting=int(fields["waiting"]["v"]) if fields["waiting"] else 0,
                accept_length=float(fields["accept"]["v"]) if fields["accept"] else 1.0,
                gen_tokens_per_s=float(fields["gen"]["v"]),
            )
        )
    return found


def steady_lines(lines: Iterable[DecodeLine], batch: int) -> list[DecodeLine]:
    """Lines of decode alone at ``batch`` requests: nothing prefilled, nothing waiting, tokens generated."""
    return [
        line
        for line in lines
        if line.running == batch and line.waiting == 0 and line.prompt_tokens_per_s == 0 and line.gen_tokens_per_s > 0
    ]


def iteration_statistic(lines: Iterable[DecodeLine], batch: int) -> IterationStatistic | None:
    """The paper's iteration and TPOT over the steady-state lines at ``batch``; None where there are none."""
    steady = steady_lines(lines, batch)
    if not steady:
        return None
    iteration_s = statistics.median(batch * line.accept_length / line.gen_tokens_per_s for line in steady)
    mean_accept = statistics.fmean(line.accept_length for line in steady)
    return IterationStatistic(
        iteration_ms=1000 * iteration_s,
        tpot_ms=1000 * iteration_s / mean_accept,
        mean_accept_length=mean_accept,
        lines=len(steady),
    )
