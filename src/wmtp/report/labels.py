"""Labels and formatting for the report: context labels and ticks, series labels and styles, the
sideways dodge of equal points, robust y limits."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

# --------------------------------------------------------------------------------------------------
# Labels and formatting helpers
# --------------------------------------------------------------------------------------------------


def context_label(tokens: float) -> str:
    """2040 → '2K', 32779 → '32K', 131290 → '131K', 1536 → '1.5K', 1000000 → '1M' (the Spark study's style)."""
    if tokens is None or (isinstance(tokens, float) and math.isnan(tokens)):
        return ""
    t = float(tokens)
    for scale, suffix in ((1e6, "M"), (1e3, "K")):
        if t >= scale:
            x = t / scale
            text = f"{x:.1f}".rstrip("0").rstrip(".") if x < 10 else str(int(x))
            return f"{text}{suffix}"
    return str(int(t))


def context_ticks(values: Sequence[float], min_ratio: float = 1.08) -> list[int]:
    """Distinct tick positions for a log context axis: values closer than ``min_ratio`` collapse into the
    first (131072 and 131290 would both read '131K')."""
    ticks: list[int] = []
    for v in sorted({int(x) for x in values if x is not None and not pd.isna(x)}):
        if not ticks or v / ticks[-1] >= min_ratio:
            ticks.append(v)
    return ticks


def context_tick_labels(ticks: Sequence[float], width_in: float, *, label_in: float = 0.45) -> list[str]:
    """Labels for the ticks of a log context axis ``width_in`` inches wide: a tick closer than ``label_in``
    inches to the previous labelled one stays a bare tick ('' label), so labels never collide. The smallest
    and the largest tick are always labelled (2K … 131K … 1M on a narrow panel)."""
    logs = [math.log10(t) for t in ticks]
    if len(logs) < 2:
        return [context_label(t) for t in ticks]
    span = (logs[-1] - logs[0]) * 1.1 or 1.0  # the axis has some margin around its ticks
    gap = label_in * span / max(width_in, 0.1)  # decades one label needs
    keep = [0]
    for i in range(1, len(logs)):
        if logs[i] - logs[keep[-1]] >= gap:
            keep.append(i)
    if keep[-1] != len(logs) - 1:
        while len(keep) > 1 and logs[-1] - logs[keep[-1]] < gap:
            keep.pop()
        keep.append(len(logs) - 1)
    return [context_label(t) if i in keep else "" for i, t in enumerate(ticks)]


def int_or_none(value: Any) -> int | None:
    try:
        return None if value is None or pd.isna(value) else int(value)
    except (TypeError, ValueError):
        return None


def read_window_note(row: dict[str, Any] | pd.Series) -> str:
    """'(block 256: reads S=256 W=256–511)': what the windowed draft read, as its plugin reported it.

    The draft reads whole KV blocks: the sink rounded up, the window from the block boundary before the last W
    tokens, so W to W + B - 1 tokens. Empty when the plugin did not report (arms without a window).
    """
    block = int_or_none(row.get("kv_block_size"))
    read_sink, low, high = (int_or_none(row.get(c)) for c in ("read_sink_tokens", "read_window_min", "read_window_max"))
    if block is None or read_sink is None or low is None or high is None:
        return ""
    window = f"{low}" if low == high else f"{low}–{high}"
    return f"(block {block}: reads S={read_sink} W={window})"


def series_label(
    row: dict[str, Any] | pd.Series,
    *,
    with_model: bool = False,
    with_engine: bool = False,
    with_concurrency: bool = False,
    with_workload: bool = False,
) -> str:
    """'none', 'mtp k=3', 'wmtp k=3 S=16 W=128' (+ model / engine / concurrency / workload when they vary)."""
    parts = [str(row.get("arm"))]
    k = int_or_none(row.get("k"))
    if k:
        parts.append(f"k={k}")
    sink, window = int_or_none(row.get("sink")), int_or_none(row.get("window"))
    if sink is not None or window is not None:
        parts.append(f"S={sink} W={window}")
        parts.append(read_window_note(row))
    label = " ".join(p for p in parts if p)
    extra = []
    if with_model:
        extra.append(str(row.get("model")))
    if with_engine:
        extra.append(str(row.get("engine")))
    if with_concurrency:
        extra.append(f"c={row.get('concurrency')}")
    if with_workload:
        extra.append(str(row.get("workload")))
    return f"{label} ({', '.join(extra)})" if extra else label


def add_labels(frame: pd.DataFrame, reference: pd.DataFrame | None = None) -> pd.DataFrame:
    """Adds ``label`` (see :func:`series_label`), ``facet``, ``series`` and ``context`` columns.

    Model/engine/concurrency appear in ``label`` only when they vary in ``reference`` (default: the frame
    itself). Figures draw one panel per ``facet`` (the model, and the engine, where they vary; '' when
    they do not; and the workload where there are several) and name a line by ``series``: the label
    without what the facet already says.
    """
    if frame.empty:
        return frame
    ref = frame if reference is None else reference
    frame = with_read_window(frame, ref)
    varies = {
        c: c in ref.columns and ref[c].nunique(dropna=False) > 1 for c in ("model", "engine", "concurrency", "workload")
    }
    out = frame.copy()
    records = out.to_dict("records")
    out["label"] = [
        series_label(
            r,
            with_model=varies["model"],
            with_engine=varies["engine"],
            with_concurrency=varies["concurrency"],
            with_workload=varies["workload"] and "workload" in out.columns,
        )
        for r in records
    ]
    facet_keys = [c for c in ("model", "engine", "workload") if varies[c] and c in out.columns]
    out["facet"] = [" · ".join(facet_value(c, r.get(c)) for c in facet_keys) for r in records]
    out["series"] = [series_label(r, with_concurrency=varies["concurrency"]) for r in records]
    if "rung" in out.columns:
        out["context"] = [context_label(r) for r in out["rung"]]
    return out


def with_read_window(frame: pd.DataFrame, reference: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with the effective-window columns of ``reference`` (the rung table), matched on the series."""
    columns = ["kv_block_size", "read_sink_tokens", "read_window_min", "read_window_max"]
    # The whole series, or no join: a frame without its model or engine could take another one's block size.
    keys = ["model", "engine", "arm", "k", "sink", "window"]
    complete = set(keys) <= set(frame.columns) and set(keys) <= set(reference.columns)
    if not complete or not set(columns) <= set(reference.columns) or set(columns) <= set(frame.columns):
        return frame

    def series_key(row: dict[str, Any]) -> tuple:
        return tuple(int_or_none(row[c]) if c in ("k", "sink", "window") else str(row[c]) for c in keys)

    reads = {
        series_key(r): [r[c] for c in columns]
        for r in reference.to_dict("records")
        if int_or_none(r.get("kv_block_size")) is not None
    }
    if not reads:
        return frame
    out = frame.copy()
    found = [reads.get(series_key(r), [math.nan] * len(columns)) for r in frame.to_dict("records")]
    for i, column in enumerate(columns):
        out[column] = [values[i] for values in found]
    return out


WORKLOAD_LABELS = {"code": "code prompts", "copy": "copy task (repeats a far-back passage)"}


def facet_value(key: str, value: Any) -> str:
    return WORKLOAD_LABELS.get(str(value), str(value)) if key == "workload" else str(value)


def arm_order(frame: pd.DataFrame) -> pd.DataFrame:
    order = {a: i for i, a in enumerate(("none", "mtp", "wmtp", "wmtp-ring"))}
    keys = [
        c
        for c in ("arm", "k", "sink", "window", "model", "engine", "concurrency", "workload", "rung", "position")
        if c in frame.columns
    ]
    out = frame.assign(_arm_rank=frame["arm"].map(order).fillna(99)) if "arm" in frame.columns else frame
    sort = (["_arm_rank"] if "_arm_rank" in out.columns else []) + [k for k in keys if k != "arm"]
    out = out.sort_values(sort, na_position="first", kind="stable")
    return out.drop(columns=["_arm_rank"], errors="ignore").reset_index(drop=True)


def fmt_value(value: Any, digits: int = 4) -> str:
    """Numbers for tables: integers with separators, otherwise ``digits`` significant digits."""
    if value is None or isinstance(value, str):
        return value or ""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return str(value)
    if not math.isfinite(v):
        return ""
    if abs(v) < 1e-9:
        return "0"
    if v.is_integer() and abs(v) < 1e15:
        return f"{int(v):,}"
    if abs(v) >= 10**digits:
        return f"{v:,.0f}"
    return f"{v:.{digits}g}"


def interval_step(lo: float, hi: float) -> float:
    """The rounding step an interval supports: the half-width's leading digit, or its first two digits
    when the leading one is 1 or 2 (±0.032 → 0.01, ±0.15 → 0.01, ±9,353 → 1,000); a digit finer than
    that states a precision the interval denies."""
    half = abs(hi - lo) / 2
    if not math.isfinite(half) or half == 0:
        return 0.0
    exponent = math.floor(math.log10(half))
    leading = half / 10**exponent
    return 10.0 ** (exponent - 1 if leading < 3 else exponent)


def _fmt_step(value: float, step: float) -> str:
    rounded = round(value / step) * step
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    text = f"{rounded:,.{decimals}f}"
    return "0" if float(rounded) == 0 else text.replace("-", "−")


def fmt_interval(point: float, lo: float, hi: float, *, null: float | None = None) -> str:
    """A point and its interval rounded to what the interval supports: '0.08 [0.05, 0.11]'.

    With ``null`` (1 for a ratio, 0 for a change) an interval that holds it reads 'not resolved [lo, hi]':
    the point is not a number to read. Missing numbers give ''; a missing interval, the point alone."""
    if point is None or not math.isfinite(point):
        return ""
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)) or hi == lo:
        return fmt_value(point)
    step = interval_step(lo, hi)
    bounds = f"[{_fmt_step(lo, step)}, {_fmt_step(hi, step)}]"
    if null is not None and lo <= null <= hi:
        return f"not resolved {bounds}"
    return f"{_fmt_step(point, step)} {bounds}"


def fmt_ci(point: float, lo: float, hi: float, *, null: float | None = None) -> str:
    """A table's point and interval: :func:`fmt_interval`."""
    return fmt_interval(point, lo, hi, null=null)


# --------------------------------------------------------------------------------------------------
# Figure styles: the same series looks the same in every figure of a report
# --------------------------------------------------------------------------------------------------

#: The one colour and marker of each arm, in every figure of a report: a reader learns them once and reads
#: every figure by them. Series of one arm (several k, windows or models) differ by line style instead.
ARM_COLORS: dict[str, str] = {
    "none": "#555555",
    "mtp": "#1f77b4",
    "wmtp": "#e6740f",
    "wmtp-ring": "#2a9d3a",
}
ARM_MARKERS: dict[str, str] = {"none": "o", "mtp": "s", "wmtp": "^", "wmtp-ring": "D"}
OTHER_ARM_COLOR, OTHER_ARM_MARKER = "#8c5fb7", "v"
#: The ratio mtp / wmtp by each source (the headline figure): colours no arm has, so no line reads as one arm's.
RATIO_SOURCE_COLORS: dict[str, str] = {"engine mtp / wmtp": "#111111", "replica": "#b2182b", "cost model": "#8c6d31"}
#: Line styles that tell one arm's series apart, in the order of their k, sink, window.
SERIES_LINESTYLES: tuple[str, ...] = ("-", "--", "-.", ":")


def arm_style(arm: Any) -> dict[str, str]:
    """``{color, marker}`` of ``arm``: the only place a figure takes an arm's colour or marker from."""
    name = str(arm)
    return {"color": ARM_COLORS.get(name, OTHER_ARM_COLOR), "marker": ARM_MARKERS.get(name, OTHER_ARM_MARKER)}


def arm_of(label: str) -> str:
    """The arm a series label names first ('wmtp-ring k=3 S=16 W=128' → 'wmtp-ring')."""
    return str(label).split(" ", 1)[0]


def series_styles(frame: pd.DataFrame, key: str = "series") -> dict[str, dict[str, Any]]:
    """``name → {color, marker, ls}`` for every series of ``frame`` (which has ``key``, ``arm`` and the
    series keys, e.g. the labelled overview), named by its ``key`` column (default ``series``, so a series
    looks the same in every model's panel): its arm's colour and marker (:func:`arm_style`), and a line
    style per series within the arm, in the order of k, sink and window."""
    if frame.empty or key not in frame.columns:
        return {}
    sort = [c for c in ("k", "sink", "window", "concurrency", "model", "engine") if c in frame.columns]
    styles: dict[str, dict[str, Any]] = {}
    for arm, group in frame.groupby("arm", sort=False, dropna=False):
        labels = list(dict.fromkeys(group.sort_values(sort, na_position="first", kind="stable")[key]))
        for i, label in enumerate(labels):
            styles[label] = {**arm_style(arm), "ls": SERIES_LINESTYLES[i % len(SERIES_LINESTYLES)]}
    return styles


def k_color(k: Any) -> str:
    """The colour of draft depth ``k`` wherever k is the colour (the wedge): an ordinal palette fixed
    across reports (plasma: k=1 dark blue … k=3 magenta … k=5 orange)."""
    import matplotlib as mpl

    ki = int_or_none(k) or 1
    return mpl.colors.to_hex(mpl.colormaps["plasma"](min(0.85, 0.18 * (max(ki, 1) - 1))))


def dodge(n: int, rungs: Sequence[float], *, frac: float = 0.012, total: float = 0.05) -> list[float]:
    """Multipliers that spread ``n`` series sideways on a log context axis so that equal points and error
    bars stay visible: each step is ``frac`` of the axis width (at most ``total`` for all steps)."""
    if n <= 1:
        return [1.0] * max(n, 0)
    values = [float(r) for r in rungs if r and not pd.isna(r)]
    decades = math.log10(max(values) / min(values)) if values and min(values) > 0 else 0.0
    decades = decades or 0.6  # one rung: a sensible axis width
    step = min(frac, total / (n - 1)) * decades
    return [10 ** (step * (i - (n - 1) / 2)) for i in range(n)]


def robust_limits(values: Sequence[float], pad: float = 0.08) -> tuple[float, float] | None:
    """y limits that no single far point sets: the points within 6 spreads of the middle half (the spread is
    the interquartile range, at least a tenth of the median), padded; None when the plain limits would do
    (the screened data seldom needs them)."""
    v = np.asarray([x for x in values if np.isfinite(x)], float)
    if len(v) < 4:
        return None
    q1, q3 = np.percentile(v, [25, 75])
    spread = max(q3 - q1, 0.1 * abs(np.median(v)), 1e-12)
    kept = v[(v >= q1 - 6 * spread) & (v <= q3 + 6 * spread)]
    if len(kept) == len(v):
        return None
    low, high = kept.min(), kept.max()
    margin = pad * max(high - low, abs(high) * 0.05, 1e-12)
    return low - margin, high + margin
