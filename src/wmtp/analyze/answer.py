"""The study's answer: per model and context, what each drafting arm buys over no draft, with verdicts.

Every comparison is made on pairs: the arms of a study get the same prompts (one per workload, rung, repeat
and slot), so each prompt gives one ratio and the noise that prompts share cancels. Rows:

- ``speedup``: decode rate of the arm over ``none`` (geometric mean of paired ratios; no effect: 1);
- ``cost_side_ratio``: verify-cycle time of native MTP over the windowed arm at the same k (what the window
  saves per cycle, acceptance aside; no effect: 1);
- ``acceptance``: accepted share of drafted tokens (mean over requests);
- ``acceptance_change``: the windowed arm's acceptance minus native MTP's on the same prompts (no effect: 0).

Each carries its interval (analyze.intervals), n (pairs or requests) and verdict. Excluded requests
(analyze.tidy.screen_requests) carry no rate and so drop out of every pair.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import pandas as pd

from wmtp.analyze.analysis import request_cycle_ms_of
from wmtp.analyze.intervals import (
    RESOLVED,
    Interval,
    mean_interval,
    paired_difference_interval,
    ratio_interval,
    verdict,
)

BASE_ARM = "none"
NATIVE_ARM = "mtp"
WINDOWED_ARMS = ("wmtp", "wmtp-ring")
GROUP_KEYS = ["model", "engine", "concurrency", "workload", "rung"]
PAIR_KEYS = ["repeat", "slot"]
SERIES_KEYS = ["arm", "k", "sink", "window"]
COLUMNS = [*GROUP_KEYS, *SERIES_KEYS, "quantity", "value", "lo", "hi", "n", "no_effect", "verdict"]


def _series(frame: pd.DataFrame) -> Iterator[tuple[dict, pd.DataFrame]]:
    for key, rows in frame.groupby(SERIES_KEYS, dropna=False, sort=True):
        yield dict(zip(SERIES_KEYS, key, strict=True)), rows


def _paired(first: pd.DataFrame, second: pd.DataFrame, column: str):
    """``column`` of both, aligned on the prompt (repeat, slot); pairs with a missing value are dropped."""
    a = first.set_index(PAIR_KEYS)[column].rename("first")
    b = second.set_index(PAIR_KEYS)[column].rename("second")
    both = pd.concat([a, b], axis=1, join="inner").dropna()
    return both["first"].to_numpy(dtype=float), both["second"].to_numpy(dtype=float)


def _cycle_ms(rows: pd.DataFrame) -> pd.Series:
    """Per-request verify-cycle time (:func:`wmtp.analyze.analysis.request_cycle_ms_of`).

    The rung's tokens per verify (``rung_tpv``) stands in for cells that counted per rung only: then acceptance
    noise does not enter the interval. An excluded request has no decode rate and so no cycle.
    """
    own = rows.get("req_tok_per_verify", math.nan)
    return pd.Series(request_cycle_ms_of(own, rows["rung_tpv"], rows["decode_tok_s"]), index=rows.index)


# What a quantity can be: a t interval at 3-5 prompts overshoots these, and a bound outside them is impossible.
RANGES = {"acceptance": (0.0, 1.0), "acceptance_change": (-1.0, 1.0)}


def _row(group: dict, series: dict, quantity: str, interval: Interval, no_effect: float | None) -> dict:
    least, most = RANGES.get(quantity, (-math.inf, math.inf))
    return {
        **group,
        **series,
        "quantity": quantity,
        "value": interval.value,
        # max/min keep NaN (no interval) as it is: a comparison with NaN is false.
        "lo": max(interval.lo, least) if math.isfinite(interval.lo) else interval.lo,
        "hi": min(interval.hi, most) if math.isfinite(interval.hi) else interval.hi,
        "n": interval.n,
        "no_effect": no_effect,
        "verdict": verdict(interval, no_effect) if no_effect is not None else "",
    }


def _group_rows(group: dict, rows: pd.DataFrame) -> list[dict]:
    out: list[dict] = []
    base = rows[rows["arm"] == BASE_ARM]
    natives = {int(s["k"]): r for s, r in _series(rows[rows["arm"] == NATIVE_ARM])}
    for series, arm in _series(rows[rows["arm"] != BASE_ARM]):
        if not base.empty:
            out.append(_row(group, series, "speedup", ratio_interval(*_paired(arm, base, "decode_tok_s")), 1.0))
        if "req_acceptance" in arm:
            out.append(_row(group, series, "acceptance", mean_interval(arm["req_acceptance"].to_numpy()), None))
        native = natives.get(int(series["k"]))
        if series["arm"] in WINDOWED_ARMS and native is not None:
            native_cycle, windowed_cycle = (r.assign(cycle=_cycle_ms(r)) for r in (native, arm))
            ratio = ratio_interval(*_paired(native_cycle, windowed_cycle, "cycle"))
            out.append(_row(group, series, "cost_side_ratio", ratio, 1.0))
            if "req_acceptance" in arm:
                change = paired_difference_interval(*_paired(arm, native, "req_acceptance"))
                out.append(_row(group, series, "acceptance_change", change, 0.0))
    return out


def answer_table(requests: pd.DataFrame, rungs: pd.DataFrame) -> pd.DataFrame:
    """The answer rows for every (model, engine, concurrency, workload, rung) and drafting series."""
    if requests.empty:
        return pd.DataFrame(columns=COLUMNS)
    keys = ["cell_id", "workload", "rung"]
    rung_tpv = rungs[[*keys, "tok_per_verify"]].rename(columns={"tok_per_verify": "rung_tpv"})
    frame = requests.merge(rung_tpv, on=keys, how="left")
    frame["k"] = frame["k"].fillna(0).astype(int)
    rows: list[dict] = []
    for key, group in frame.groupby(GROUP_KEYS, dropna=False, sort=True):
        rows += _group_rows(dict(zip(GROUP_KEYS, key, strict=True)), group)
    return pd.DataFrame([r for r in rows if r["n"] > 0], columns=COLUMNS)


# Settings besides the arm that tell a study's series apart; a label names those that vary in the study.
SETTINGS = ("model", "engine", "concurrency")


def varying_settings(rows: pd.DataFrame) -> tuple[str, ...]:
    """Which of :data:`SETTINGS` take more than one value in ``rows``: the labels must name them."""
    return tuple(c for c in SETTINGS if c in rows.columns and rows[c].nunique(dropna=False) > 1)


def series_label(row: pd.Series | dict, qualify: Sequence[str] = ()) -> str:
    """'wmtp k=3 S=16 W=256', and '(model, engine, c=2)' for the settings in ``qualify``."""
    arm, k = row["arm"], int(row["k"])
    label = f"{arm} k={k}"
    if arm in WINDOWED_ARMS:
        label += f" S={int(row['sink'])} W={int(row['window'])}"
    extra = [f"c={row[c]}" if c == "concurrency" else str(row[c]) for c in qualify]
    return f"{label} ({', '.join(extra)})" if extra else label


def format_value(value: float, quantity: str) -> str:
    """A value in its quantity's unit: 1.23× for a ratio, 54.5 % for acceptance, +1.2 pp for its change."""
    if quantity in ("acceptance", "acceptance_change"):
        return f"{100 * value:+.1f} pp" if quantity == "acceptance_change" else f"{100 * value:.1f} %"
    return f"{value:.3g}×"


def sentence(row: pd.Series | dict, qualify: Sequence[str] = ()) -> str:
    """One finding in words; an unresolved effect is said to be unresolved, never stated as a finding."""
    quantity, value = row["quantity"], row["value"]
    span = (
        f"[{format_value(row['lo'], quantity)}, {format_value(row['hi'], quantity)}]"
        if math.isfinite(row["lo"])
        else "(no interval)"
    )
    where = f"{row['workload']} prompts at {int(row['rung']):,} tokens, n = {int(row['n'])}"
    what = {
        "speedup": "decodes at {v} the rate of no draft",
        "cost_side_ratio": "has a cost-side ratio (native MTP's verify cycle over its own) of {v}",
        "acceptance_change": "changes acceptance by {v} against native MTP",
        "acceptance": "accepts {v} of its drafts",
    }[quantity].format(v=format_value(value, quantity))
    finding = RESOLVED if row["verdict"] == RESOLVED else "not resolved: the interval includes no effect"
    if not math.isfinite(row["lo"]):
        finding = "not resolved: one prompt, or no spread over the prompts, gives no interval"
    if not row["verdict"]:
        finding = "measured"
    return f"{series_label(row, qualify)} {what} {span} on {where} — {finding}."
