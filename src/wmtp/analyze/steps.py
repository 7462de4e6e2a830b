"""The engine's decode cycle per shape: one row per (engine version, arm, k, S, W, context, batch), from tidy tables.

This is the contract of the measured step files beside the replica's (measurements/<device>/vllm_<model>.csv):
what a real engine's cells say one verify cycle costs, to set next to the replica's step at the same shape. A
cycle is one target forward and k draft forwards; its time is a request's decode window (first token to last)
divided by its cycles, the tokens it decoded over the rung's tokens per cycle (1 without a draft; about 1 with
random weights, which accept almost nothing).

Where the requests recorded when each streamed chunk arrived and how many tokens it added, the cycle is also
measured chunk by chunk: a gap between two chunks over the cycles its tokens took (its tokens over the rung's
tokens per cycle), so that a rung of one long prefill still gives a median and a spread over its many cycles. The
gaps alone are not cycles: a chunk may hold several steps' tokens when the server's output loop falls behind the
engine, so ``tokens_per_chunk`` says how far they were from one step each.
"""

from __future__ import annotations

import math

import pandas as pd

COLUMNS = [
    "engine_version",
    "arm",
    "k",
    "S",
    "W",
    "context",
    "batch",
    "step_ms",
    "step_ms_min",
    "step_ms_max",
    "n",
    "cycle_ms",
    "cycle_ms_p10",
    "cycle_ms_p90",
    "cycles",
    "chunk_ms",
    "tokens_per_chunk",
    "tokens_per_cycle",
    "ttft_s",
    "ttft_s_min",
    "ttft_s_max",
    "windowed_forwards",
    "hook_host_us_per_build",
    "read_sink_tokens",
    "kv_cache_tokens",
]
_RUNG = ["cell_id", "workload", "rung"]


def request_step_ms(decode_s: float, completion_tokens: int, tokens_per_cycle: float) -> float:
    """One request's cycle time: its decode window over the cycles it took (NaN without a decoded token)."""
    if completion_tokens <= 1 or not decode_s > 0 or not tokens_per_cycle > 0:
        return math.nan
    return 1e3 * decode_s * tokens_per_cycle / (completion_tokens - 1)


def _lists(group: pd.DataFrame, column: str) -> list:
    if column not in group.columns:
        return [None] * len(group)
    return [
        None if value is None or (isinstance(value, float) and math.isnan(value)) else list(value)
        for value in group[column]
    ]


# Where a cycle yields about one token, a chunk's tokens count its cycles; where drafts are accepted, a cycle
# yields 1 to k + 1 tokens, and a chunk's tokens tell acceptance, not how many steps the server merged.
ONE_TOKEN_CYCLES = 1.05


def chunk_cycles(gaps: list[float], new_tokens: list[int], tokens_per_cycle: float) -> list[float]:
    """One request's cycle times (ms), chunk by chunk: each gap over the cycles its chunk's tokens took.

    Only at about one token a cycle (no draft, or a draft almost never accepted); empty otherwise.
    """
    if not 0 < tokens_per_cycle <= ONE_TOKEN_CYCLES or len(gaps) != len(new_tokens):
        return []
    return [gap * tokens_per_cycle / tokens for gap, tokens in zip(gaps, new_tokens, strict=True) if tokens > 0]


def _optional(group: pd.DataFrame, column: str) -> float:
    if column not in group.columns:
        return math.nan
    values = pd.to_numeric(group[column], errors="coerce").dropna()
    return float(values.iloc[0]) if len(values) else math.nan


def step_table(
    requests: pd.DataFrame, rungs: pd.DataFrame, engine_version: str, workload: str = "code"
) -> pd.DataFrame:
    """The step file's rows from the tidy ``requests`` and ``rungs`` tables of one engine's cells.

    Requests the screening excluded are left out; ``n`` counts the rest. A rung's tokens per cycle are its
    counters' (``rungs.tok_per_verify``; 1 for the arm without a draft). Sorted by arm, k, S, W, context, batch.
    """
    kept = requests[(requests["workload"] == workload) & ~requests["excluded"].astype(bool)]
    per_rung = rungs.set_index(_RUNG)["tok_per_verify"]
    rows = []
    for _, group in kept.groupby(_RUNG, sort=True):
        first = group.iloc[0]
        tpc = 1.0 if first["arm"] == "none" else float(per_rung.get(tuple(first[_RUNG]), math.nan))
        steps = pd.Series(
            [
                request_step_ms(d, int(c), tpc)
                for d, c in zip(group["decode_s"], group["completion_tokens"], strict=True)
            ]
        ).dropna()
        gap_lists, token_lists = _lists(group, "chunk_gaps_ms"), _lists(group, "chunk_new_tokens")
        gaps = pd.Series([g for one in gap_lists if one for g in one], dtype=float)
        cycles = pd.Series(
            [
                c
                for one, tokens in zip(gap_lists, token_lists, strict=True)
                if one and tokens
                for c in chunk_cycles(one, tokens, tpc)
            ],
            dtype=float,
        )
        # Tokens the chunks after the first added, over their number: counted where recorded, else the request's.
        chunked = [
            (sum(tokens) if tokens else int(c) - 1, len(one))
            for one, tokens, c in zip(gap_lists, token_lists, group["completion_tokens"], strict=True)
            if one
        ]
        ttft = pd.to_numeric(group["ttft_s"], errors="coerce").dropna()
        windowed = first["arm"] in ("wmtp", "wmtp-ring")
        rows.append(
            {
                "engine_version": engine_version,
                "arm": first["arm"],
                "k": int(first["k"]),
                "S": int(first["sink"]) if windowed else math.nan,
                "W": int(first["window"]) if windowed else math.nan,
                "context": int(first["rung"]),
                "batch": int(first["concurrency"]),
                "step_ms": float(steps.median()) if len(steps) else math.nan,
                "step_ms_min": float(steps.min()) if len(steps) else math.nan,
                "step_ms_max": float(steps.max()) if len(steps) else math.nan,
                "n": len(steps),
                "cycle_ms": float(cycles.median()) if len(cycles) else math.nan,
                "cycle_ms_p10": float(cycles.quantile(0.1)) if len(cycles) else math.nan,
                "cycle_ms_p90": float(cycles.quantile(0.9)) if len(cycles) else math.nan,
                "cycles": len(cycles),
                "chunk_ms": float(gaps.median()) if len(gaps) else math.nan,
                # Tokens after the first over the chunks after the first: 1 when every chunk was one step's.
                "tokens_per_chunk": sum(t for t, _ in chunked) / sum(n for _, n in chunked) if chunked else math.nan,
                "tokens_per_cycle": tpc,
                "ttft_s": float(ttft.median()) if len(ttft) else math.nan,
                "ttft_s_min": float(ttft.min()) if len(ttft) else math.nan,
                "ttft_s_max": float(ttft.max()) if len(ttft) else math.nan,
                # The cell's server in total (the plugin's counter): > 0 shows the window was really applied.
                "windowed_forwards": _optional(group, "cell_windowed_forwards"),
                # The plugin's own host time per draft metadata build, in microseconds.
                "hook_host_us_per_build": _optional(group, "cell_hook_host_us_per_build"),
                # What the draft really read as its sink: the engine rounds S up to whole KV blocks.
                "read_sink_tokens": _optional(group, "read_sink_tokens"),
                "kv_cache_tokens": _optional(group, "kv_cache_tokens"),
            }
        )
    table = pd.DataFrame(rows, columns=COLUMNS)
    # Whole numbers where there is a window, empty where there is none (not 16.0 and NaN).
    table[["S", "W"]] = table[["S", "W"]].astype("Int64")
    order = {"none": 0, "mtp": 1, "wmtp": 2, "wmtp-ring": 3}
    table = table.sort_values(
        ["arm", "k", "S", "W", "context", "batch"], key=lambda c: c.map(order) if c.name == "arm" else c
    )
    return table.reset_index(drop=True)
