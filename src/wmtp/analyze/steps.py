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
from collections.abc import Iterable, Mapping
from typing import Any

import pandas as pd

from wmtp.analyze import analysis, costmodel

COLUMNS = [
    "engine_version",
    "attention_config",
    "arm",
    "k",
    "S",
    "W",
    "window_anchor",
    "window_kernels",
    "context",
    "batch",
    "step_ms",
    "step_ms_min",
    "step_ms_max",
    "n",
    "servers",
    "server_step_ms",
    "server_spread",
    "server_gpus",
    "gpus",
    "clock",
    "client_step_ms",
    "clock_disagreement_max",
    "floor_ms",
    "over_floor",
    "growth_ms",
    "growth_floor_ms",
    "growth_servers",
    "cycle_ms",
    "cycle_ms_p10",
    "cycle_ms_p90",
    "cycles",
    "chunk_ms",
    "tokens_per_chunk",
    "first_chunk_tokens",
    "tokens_per_cycle",
    "ttft_s",
    "ttft_s_min",
    "ttft_s_max",
    "windowed_forwards",
    "hook_host_us_per_build",
    "read_sink_tokens",
    "kv_cache_tokens",
    "wmtp_revision",
    "plugin_sha256",
]
SHAPE = ["attention_config", "arm", "k", "S", "W", "window_anchor", "window_kernels", "context", "batch"]
_RUNG = ["cell_id", "workload", "rung"]


def request_step_ms(decode_s: float, completion_tokens: int, tokens_per_cycle: float) -> float:
    """One request's cycle time: its decode window over the cycles it took (NaN without a decoded token)."""
    if not tokens_per_cycle > 0:
        return math.nan
    return float(analysis.cycle_ms(tokens_per_cycle, analysis.decode_rate(completion_tokens, decode_s)))


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
    # Two chunks inside the client clock's rounding have a gap of 0 ms: an unbounded rate, a cycle of 0 ms.
    return [
        analysis.cycle_ms(tokens_per_cycle, tokens * 1e3 / gap if gap > 0 else math.inf)
        for gap, tokens in zip(gaps, new_tokens, strict=True)
        if tokens > 0
    ]


def _optional(group: pd.DataFrame, column: str) -> float:
    if column not in group.columns:
        return math.nan
    values = pd.to_numeric(group[column], errors="coerce").dropna()
    return float(values.iloc[0]) if len(values) else math.nan


def _column(group: pd.DataFrame, column: str) -> pd.Series:
    if column not in group.columns:
        return pd.Series(math.nan, index=group.index, dtype=float)
    return pd.to_numeric(group[column], errors="coerce")


def _median(values: pd.Series) -> float:
    return float(values.median()) if len(values) else math.nan


def _server_rows(kept: pd.DataFrame, rungs: pd.DataFrame, engine_version: str) -> list[dict]:
    """One row per server and rung: that server's requests' cycles (engine clock and client's), chunk cycles,
    floors and the plugin's figures."""
    # One server lifetime's rung: a cell served again later (another start) is another server.
    lifetime = [*_RUNG, "server_started_at"] if "server_started_at" in kept.columns else _RUNG
    rung_key = lifetime if set(lifetime) <= set(rungs.columns) else _RUNG
    per_rung = rungs.set_index(rung_key)["tok_per_verify"]
    rows = []
    for _, group in kept.groupby(lifetime, sort=True, dropna=False):
        first = group.iloc[0]
        tpc = 1.0 if first["arm"] == "none" else _one(per_rung, tuple(first[rung_key]))
        completions = [int(c) for c in group["completion_tokens"]]
        steps = pd.Series([request_step_ms(d, c, tpc) for d, c in zip(group["decode_s"], completions, strict=True)])
        client_decode = group["client_decode_s"] if "client_decode_s" in group.columns else group["decode_s"]
        client = pd.Series([request_step_ms(d, c, tpc) for d, c in zip(client_decode, completions, strict=True)])
        gap_lists, token_lists = _lists(group, "chunk_gaps_ms"), _lists(group, "chunk_new_tokens")
        windowed = first["arm"] in ("wmtp", "wmtp-ring")
        clocks = set(group["clock"]) if "clock" in group.columns else {"client"}
        rows.append(
            {
                "engine_version": engine_version,
                "arm": first["arm"],
                "k": int(first["k"]),
                "S": int(first["sink"]) if windowed else math.nan,
                "W": int(first["window"]) if windowed else math.nan,
                # Where the plugin set a draft forward's window start: two plugins that differ here are two arms.
                "window_anchor": (_distinct(group, "cell_window_anchor") or "forward") if windowed else "",
                # What set it on the device: the plugin's Triton kernels or PyTorch operations, two plugins again.
                "window_kernels": (_distinct(group, "cell_window_kernels") or "torch") if windowed else "",
                "context": int(first["rung"]),
                "batch": int(first["concurrency"]),
                # The engine's attention options (vLLM's --attention-config): another setting is another engine.
                "attention_config": _distinct(group, "attention_config"),
                # One server lifetime: its cell id and when it started (a cell id may be served again later).
                "server": (first["cell_id"], str(first.get("server_started_at") or "")),
                "steps": steps.dropna().tolist(),
                "client_steps": client.dropna().tolist(),
                "clock": clocks.pop() if len(clocks) == 1 else "mixed",
                "disagreement": _column(group, "clock_disagreement"),
                "floors": _column(group, "floor_ms"),
                "gpu_name": first.get("gpu_name"),
                "gpu": _short_gpu_id(first.get("gpu_uuid")),
                "gaps": [g for one in gap_lists if one for g in one],
                "cycles": [
                    c
                    for one, tokens in zip(gap_lists, token_lists, strict=True)
                    if one and tokens
                    for c in chunk_cycles(one, tokens, tpc)
                ],
                # Tokens after the first over the chunks after the first: counted where recorded, else the request's.
                "chunked": [
                    (sum(tokens) if tokens else c - 1, len(one))
                    for one, tokens, c in zip(gap_lists, token_lists, completions, strict=True)
                    if one
                ],
                "first_chunk_tokens": _column(group, "first_chunk_tokens"),
                "tokens_per_cycle": tpc,
                "ttft": pd.to_numeric(group["ttft_s"], errors="coerce").dropna(),
                # The cell's server in total (the plugin's counter): > 0 shows the window was really applied.
                "windowed_forwards": _optional(group, "cell_windowed_forwards"),
                # The plugin's own host time per draft metadata build, in microseconds.
                "hook_host_us_per_build": _optional(group, "cell_hook_host_us_per_build"),
                # What the draft really read as its sink: the engine rounds S up to whole KV blocks.
                "read_sink_tokens": _optional(group, "read_sink_tokens"),
                "kv_cache_tokens": _optional(group, "kv_cache_tokens"),
                "wmtp_revision": _distinct(group, "wmtp_revision"),
                "plugin_sha256": _distinct(group, "plugin_sha256"),
            }
        )
    return rows


def _short_gpu_id(uuid: object) -> str:
    """'GPU-cf466104-12f8-…' → 'cf466104': enough to tell a study's GPUs apart; empty where none was recorded."""
    if not isinstance(uuid, str) or not uuid:
        return ""
    return uuid.removeprefix("GPU-").split("-")[0]


def _one(series: pd.Series, key: tuple) -> float:
    """The value at ``key``; NaN where there is none, or more than one (two servers under one key)."""
    try:
        value = series.loc[[key]]
    except KeyError:
        return math.nan
    return float(value.iloc[0]) if len(value) == 1 else math.nan


def _distinct(group: pd.DataFrame, column: str) -> str:
    """The column's values, once each, joined by ';' (empty where it was not recorded)."""
    if column not in group.columns:
        return ""
    return ";".join(sorted({str(v) for v in group[column] if isinstance(v, str) and v}))


def _numbers(parts: list[dict], key: str) -> pd.Series:
    series = [pd.Series(p[key], dtype=float) for p in parts if p[key] is not None and len(p[key])]
    return pd.concat(series, ignore_index=True).dropna() if series else pd.Series(dtype=float)


def _shape_row(parts: list[dict]) -> dict:
    """One shape's row from its servers' rows: the median of the servers' median cycles, and their spread."""
    first = parts[0]
    steps, cycles, gaps = _numbers(parts, "steps"), _numbers(parts, "cycles"), _numbers(parts, "gaps")
    by_server = {p["server"]: float(pd.Series(p["steps"]).median()) for p in parts if p["steps"]}
    gpu_of = {p["server"]: p["gpu"] for p in parts if p["steps"]}
    server_steps = list(by_server.values())
    step = float(pd.Series(server_steps).median()) if server_steps else math.nan
    chunked = [pair for p in parts for pair in p["chunked"]]
    ttft, floors = _numbers(parts, "ttft"), _numbers(parts, "floors")
    clocks = {p["clock"] for p in parts}
    disagreement = _numbers(parts, "disagreement")
    floor = _median(floors)
    return {
        **{key: first[key] for key in ("engine_version", *SHAPE)},
        "step_ms": step,
        "step_ms_min": float(steps.min()) if len(steps) else math.nan,
        "step_ms_max": float(steps.max()) if len(steps) else math.nan,
        "n": len(steps),
        "servers": len(server_steps),
        "server_step_ms": ";".join(f"{v:.3f}" for v in server_steps),
        # The servers' median cycles, highest over lowest less 1: what two servers configured alike differ by.
        "server_spread": max(server_steps) / min(server_steps) - 1 if len(server_steps) > 1 else math.nan,
        # Each server's GPU, in server_step_ms's order: servers on one GPU compare without the machines' own spread.
        "server_gpus": ";".join(gpu_of[server] for server in by_server),
        "gpus": len({gpu for gpu in gpu_of.values() if gpu}),
        "clock": clocks.pop() if len(clocks) == 1 else "mixed",
        "client_step_ms": _median(_numbers(parts, "client_steps")),
        "clock_disagreement_max": float(disagreement.abs().max()) if len(disagreement) else math.nan,
        "floor_ms": floor,
        "over_floor": step / floor if floor > 0 else math.nan,
        "cycle_ms": _median(cycles),
        "cycle_ms_p10": float(cycles.quantile(0.1)) if len(cycles) else math.nan,
        "cycle_ms_p90": float(cycles.quantile(0.9)) if len(cycles) else math.nan,
        "cycles": len(cycles),
        "chunk_ms": _median(gaps),
        "tokens_per_chunk": sum(t for t, _ in chunked) / sum(n for _, n in chunked) if chunked else math.nan,
        "first_chunk_tokens": _median(_numbers(parts, "first_chunk_tokens")),
        "tokens_per_cycle": float(pd.Series([p["tokens_per_cycle"] for p in parts]).median()),
        "ttft_s": _median(ttft),
        "ttft_s_min": float(ttft.min()) if len(ttft) else math.nan,
        "ttft_s_max": float(ttft.max()) if len(ttft) else math.nan,
        "by_server": by_server,
        **{
            key: _median(pd.Series([p[key] for p in parts], dtype=float).dropna())
            for key in ("windowed_forwards", "hook_host_us_per_build", "read_sink_tokens", "kv_cache_tokens")
        },
        "gpu_name": first["gpu_name"],
        **{
            key: ";".join(sorted({v for p in parts for v in p[key].split(";") if v}))
            for key in ("wmtp_revision", "plugin_sha256")
        },
    }


def _add_growth(table: pd.DataFrame) -> None:
    """``growth_ms``: each shape's cycle less the same configuration's at the next shorter context, within each
    server that measured both (the median over those servers; ``growth_servers`` counts them), else, with
    ``growth_servers`` 0, between the shapes' medians over different servers; ``growth_floor_ms``: the least that
    growth can be, its extra bytes at the device's peak bandwidth.

    Two servers configured alike have differed by more than a context's extra bytes take, so only growth within a
    server tests the bytes.
    """
    table["growth_ms"] = math.nan
    table["growth_floor_ms"] = math.nan
    table["growth_servers"] = 0
    # One configuration: every key of a shape but its context.
    for _, group in table.groupby([key for key in SHAPE if key != "context"], dropna=False, sort=False):
        ordered = group.sort_values("context")
        for (_, shorter), (index, longer) in zip(ordered.iterrows(), ordered.iloc[1:].iterrows(), strict=False):
            both = sorted(set(shorter["by_server"]) & set(longer["by_server"]))
            within = [longer["by_server"][server] - shorter["by_server"][server] for server in both]
            table.loc[index, "growth_ms"] = (
                _median(pd.Series(within)) if within else longer["step_ms"] - shorter["step_ms"]
            )
            table.loc[index, "growth_servers"] = len(within)
            measured = costmodel.device_bandwidth(longer["gpu_name"])
            peak = costmodel.device_bandwidth(longer["gpu_name"], costmodel.PEAK_BANDWIDTH)
            if measured and peak:
                # The floors are bytes at the measured bandwidth: their difference at the peak instead.
                table.loc[index, "growth_floor_ms"] = (longer["floor_ms"] - shorter["floor_ms"]) * measured / peak


class MixedReleases(ValueError):
    """Cells of one step file that ran different releases of their engine."""


def engine_release(manifests: Iterable[Mapping[str, Any]]) -> str:
    """The one release of the engine the cells ran, as each manifest records it (``engine.versions[<kind>]``).

    A step file's rows are one release's cycles: cells of two releases are refused, and a cell that recorded none
    reads as "?", which no other cell's release matches.
    """
    found = set()
    for manifest in manifests:
        engine = manifest.get("engine") or {}
        found.add(str((engine.get("versions") or {}).get(engine.get("kind") or "", "?")))
    if len(found) != 1:
        raise MixedReleases(
            f"the cells ran {len(found)} releases of their engine: {', '.join(sorted(found)) or 'none'}"
        )
    return found.pop()


def step_table(
    requests: pd.DataFrame, rungs: pd.DataFrame, engine_version: str, workload: str = "code"
) -> pd.DataFrame:
    """The step file's rows from the tidy ``requests`` and ``rungs`` tables of one engine's cells.

    Requests the screening excluded are left out; ``n`` counts the rest, ``servers`` the servers they came from.
    A rung's tokens per cycle are its counters' (``rungs.tok_per_verify``; 1 for the arm without a draft). The
    cycle is timed by the clock ``clock`` names (``engine`` where the cells recorded the engine's own), the
    client's beside it. Sorted by attention options, arm, k, S, W, window anchor, context, batch.
    """
    kept = requests[(requests["workload"] == workload) & ~requests["excluded"].astype(bool)]
    parts = _server_rows(kept, rungs, engine_version)
    shapes: dict[tuple, list[dict]] = {}
    for part in parts:
        shapes.setdefault(tuple(str(part[key]) for key in SHAPE), []).append(part)
    table = pd.DataFrame([_shape_row(group) for group in shapes.values()])
    if table.empty:
        return pd.DataFrame(columns=COLUMNS)
    _add_growth(table)
    table = table[COLUMNS].copy()
    # Whole numbers where there is a window, empty where there is none (not 16.0 and NaN).
    table[["S", "W"]] = table[["S", "W"]].astype("Int64")
    order = {"none": 0, "mtp": 1, "wmtp": 2, "wmtp-ring": 3}
    table = table.sort_values(SHAPE, key=lambda c: c.map(order) if c.name == "arm" else c)
    return table.reset_index(drop=True)


def server_ratio(table: pd.DataFrame, numerator: str, denominator: str, **where: object) -> pd.DataFrame:
    """Per context, the ratio of two arms' cycles with its range over every pairing of their servers.

    ``ratio`` is of the medians of the servers' median cycles; ``ratio_lo`` and ``ratio_hi`` the lowest and highest
    ratio of one server of each (equal to ``ratio`` with one server each); ``resolved`` says whether that range
    leaves 1 out. ``same_gpu``, ``same_gpu_lo`` and ``same_gpu_hi`` are the median, lowest and highest ratio over
    the pairings whose two servers ran on one GPU (``same_gpu_pairs`` of them, drawing on ``same_gpu_servers`` of
    each arm; NaN where none did), ``gpus`` how many GPUs the two arms' servers ran on: GPUs of one model have
    differed by more than the arms. ``where`` narrows both arms' rows (k=3, W=4096 …).
    """
    rows = []
    selected = table
    for key, value in where.items():
        selected = selected[selected[key] == value]
    for context, group in selected.groupby("context", sort=True):
        num, den = group[group["arm"] == numerator], group[group["arm"] == denominator]
        if num.empty or den.empty:
            continue
        a, b = (server_steps(frame.iloc[0]) for frame in (num, den))
        ratio = float(num["step_ms"].iloc[0]) / float(den["step_ms"].iloc[0])
        lo, hi = min(a) / max(b), max(a) / min(b)
        gpus_a, gpus_b = (_server_gpus(frame.iloc[0], len(steps)) for frame, steps in ((num, a), (den, b)))
        pairs = [(i, j) for i, gx in enumerate(gpus_a) for j, gy in enumerate(gpus_b) if gx and gx == gy]
        same = pd.Series([a[i] / b[j] for i, j in pairs], dtype=float)
        rows.append(
            {
                "context": int(context),
                "ratio": ratio,
                "ratio_lo": lo,
                "ratio_hi": hi,
                "servers": f"{len(a)}/{len(b)}",
                "resolved": lo > 1 or hi < 1,
                "same_gpu": float(same.median()) if len(same) else math.nan,
                "same_gpu_lo": float(same.min()) if len(same) else math.nan,
                "same_gpu_hi": float(same.max()) if len(same) else math.nan,
                "same_gpu_pairs": len(same),
                # How many servers of each arm those pairings drew on: one server of an arm spans no spread of its own.
                "same_gpu_servers": f"{len({i for i, _ in pairs})}/{len({j for _, j in pairs})}",
                "gpus": len({gpu for gpu in (*gpus_a, *gpus_b) if gpu}),
            }
        )
    columns = ["context", "ratio", "ratio_lo", "ratio_hi", "servers", "resolved"]
    same_gpu = ["same_gpu", "same_gpu_lo", "same_gpu_hi", "same_gpu_pairs", "same_gpu_servers", "gpus"]
    return pd.DataFrame(rows, columns=[*columns, *same_gpu])


def _server_gpus(row: pd.Series, servers: int) -> list[str]:
    """Each server's GPU id, in ``server_step_ms``'s order; empty ids where the step file did not record them."""
    text = row.get("server_gpus")
    gpus = text.split(";") if isinstance(text, str) and text else []
    return gpus if len(gpus) == servers else [""] * servers


def server_steps(row: pd.Series) -> list[float]:
    """A step row's median cycle of each server (``server_step_ms``), or its one ``step_ms`` where not recorded."""
    text = row.get("server_step_ms")
    if isinstance(text, str) and text:
        return [float(v) for v in text.split(";")]
    return [float(row["step_ms"])]
