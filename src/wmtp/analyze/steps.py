"""The engine's decode cycle per shape: one row per (engine version, arm, k, S, W, context, batch), from tidy tables.

This is the contract of the measured step files beside the replica's (measurements/<device>/vllm_<model>.csv):
what a real engine's cells say one verify cycle costs, to set next to the replica's step at the same shape. A
cycle is one target forward and k draft forwards; its time is a request's decode window (first token to last)
divided by its cycles, the tokens it decoded over the rung's tokens per cycle (1 without a draft; about 1 with
random weights, which accept almost nothing).
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
    "tokens_per_cycle",
    "ttft_s",
    "ttft_s_min",
    "ttft_s_max",
    "windowed_forwards",
    "read_sink_tokens",
    "kv_cache_tokens",
]
_RUNG = ["cell_id", "workload", "rung"]


def request_step_ms(decode_s: float, completion_tokens: int, tokens_per_cycle: float) -> float:
    """One request's cycle time: its decode window over the cycles it took (NaN without a decoded token)."""
    if completion_tokens <= 1 or not decode_s > 0 or not tokens_per_cycle > 0:
        return math.nan
    return 1e3 * decode_s * tokens_per_cycle / (completion_tokens - 1)


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
                "tokens_per_cycle": tpc,
                "ttft_s": float(ttft.median()) if len(ttft) else math.nan,
                "ttft_s_min": float(ttft.min()) if len(ttft) else math.nan,
                "ttft_s_max": float(ttft.max()) if len(ttft) else math.nan,
                # The cell's server in total (the plugin's counter): > 0 shows the window was really applied.
                "windowed_forwards": _optional(group, "cell_windowed_forwards"),
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
