"""The study report: loads the tidy tables and the published numbers, prepares figure-ready frames,
saves figures, and renders ``notebooks/report.ipynb`` into one self-contained HTML page.

The notebook only plots and formats; every number it shows comes from here or from
:mod:`wmtp.analyze.analysis`. Each ``*_section`` function returns a :class:`Section`: a frame (possibly
empty) and, when something is missing, a note that says so in words ("not measured: no NVML on this
machine"), so the notebook never plots zeros or NaN.

Published numbers (``config/published/*.csv``) are one number per row with the exact sentence they
come from: ``study, quantity, arm, k, rung, rung_from, position, value, pm, lo, hi, unit, primary,
source, source_quote``. ``source`` labels which text the quote is from (docs/design.md, "Published
numbers": ``seed 000`` is the Spark study's write-up, ``seed 001``/``seed 003`` texts on the Windowed-MTP
paper). ``rung`` is the context the text names (its server-counted prompt tokens where it gives them,
1,048,576 for the paper's "1M", the rung the studies measure); ``primary`` is false for a rounded
restatement of a number stated more precisely elsewhere, and for what a text says a change *would* do.
Percentages are stored as the text writes them (78.7, unit %).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from wmtp.analyze import analysis as an
from wmtp.analyze import answer
from wmtp.layout import DERIVED_DIR, REPO_ROOT, TIDY_TABLES

log = logging.getLogger(__name__)

NOTEBOOK = REPO_ROOT / "notebooks" / "report.ipynb"
PUBLISHED_DIR = REPO_ROOT / "config" / "published"
PAPER_STUDY = "windowed-mtp-paper"


NOTE_NO_POWER = "not measured: no NVML on this machine"
NOTE_RELATIVE_POWER = (
    "relative only: this machine reports board power but no calibrated energy (as on the Spark's GB10); "
    "compare arms with each other, not with other machines"
)
NOTE_NO_WINDOWED = "no windowed arm in this study"
NOTE_NO_REPLICA = "no GPU replica data (results/replica/tidy/replica.parquet not found)"
NOTE_NO_DRAFT = "no drafting arm in this study"
NOTE_NO_BASE = "no arm 'none' in this study: speedups need the no-draft baseline"
NOTE_ONE_RUNG = "only one context length in this study: nothing to compare across context"
NOTE_COSTMODEL_MISSING = "cost model: not yet available (wmtp.analyze.costmodel.predict cannot be imported)"


@dataclass(frozen=True)
class Tidy:
    """The three tidy tables of a study (empty frames where a table is absent)."""

    requests: pd.DataFrame
    rungs: pd.DataFrame
    positions: pd.DataFrame
    # <study>/derived beside the tidy folder, where the derive stage writes what the report shows.
    derived_dir: Path | None = None

    @property
    def arms(self) -> list[str]:
        return sorted(self.rungs["arm"].dropna().unique()) if "arm" in self.rungs.columns else []

    @property
    def has_windowed(self) -> bool:
        return any(a in an.WINDOWED_ARMS for a in self.arms)

    @property
    def has_drafting(self) -> bool:
        return any(a != an.BASE_ARM for a in self.arms)


@dataclass(frozen=True)
class Section:
    """Figure- or table-ready data plus the note to print when part of it is missing."""

    frame: pd.DataFrame = field(default_factory=pd.DataFrame)
    notes: tuple[str, ...] = ()

    @property
    def available(self) -> bool:
        return not self.frame.empty


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def load_tidy(tidy_dir: Path | str) -> Tidy:
    """Reads requests/rungs/positions.parquet from ``tidy_dir``; a missing table is an empty frame."""
    tidy_dir = Path(tidy_dir)
    if not tidy_dir.is_dir():
        raise FileNotFoundError(f"report: tidy directory {tidy_dir} does not exist (run the collect step first)")
    frames = {}
    for name in TIDY_TABLES:
        path = tidy_dir / f"{name}.parquet"
        frames[name] = pd.read_parquet(path) if path.exists() else pd.DataFrame()
    if frames["rungs"].empty:
        raise FileNotFoundError(f"report: {tidy_dir}/rungs.parquet is missing or empty")
    return Tidy(**frames, derived_dir=tidy_dir.parent / DERIVED_DIR)


def load_published(
    published_dir: Path | str | None = None, study: str | None = None, *, primary_only: bool = False
) -> pd.DataFrame:
    """All published CSVs of ``published_dir`` in one frame (optionally one study's, primary rows only)."""
    published_dir = Path(published_dir) if published_dir else PUBLISHED_DIR
    files = sorted(published_dir.glob("*.csv")) if published_dir.is_dir() else []
    if not files:
        return pd.DataFrame()
    frame = pd.concat(
        [pd.read_csv(f, dtype={"study": str, "quantity": str, "arm": str}) for f in files], ignore_index=True
    )
    frame["arm"] = frame["arm"].fillna("")
    for col in ("k", "rung", "rung_from", "position"):
        frame[col] = pd.to_numeric(frame[col], errors="coerce").astype("Int64")
    for col in ("value", "pm", "lo", "hi"):
        frame[col] = pd.to_numeric(frame[col], errors="coerce")
    frame["primary"] = frame["primary"].astype(str).str.lower().eq("true")
    if study is not None:
        frame = frame[frame["study"] == study]
    if primary_only:
        frame = frame[frame["primary"]]
    return frame.reset_index(drop=True)


def default_replica_path(tidy_dir: Path | str) -> Path:
    """results/<study>/tidy → results/replica/tidy/replica.parquet."""
    return Path(tidy_dir).resolve().parent.parent / "replica" / "tidy" / "replica.parquet"


def load_replica(path: Path | str | None) -> pd.DataFrame | None:
    """The GPU replica table, or None when it has not been built."""
    if not path:
        return None
    path = Path(path)
    if not path.exists():
        return None
    frame = normalise_replica(pd.read_parquet(path))
    return frame if not frame.empty else None


def normalise_replica(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, context, k, sink, window[, backend]) with ``ratio`` and ``predicted_ratio``.

    Accepts the summary shape (step_nat_ms, step_win_ms, ratio, predicted_ratio) and the long
    per-arm shape of ``wmtp.replica.replica.tidy`` (arm, measured_ms, measured_ratio, predicted_ratio).
    """
    if frame.empty:
        return frame
    out = frame.copy()
    if "arm" in out.columns:
        windowed = out[out["arm"] == "wmtp"]
        out = windowed if not windowed.empty else out
    if "ratio" not in out.columns and "measured_ratio" in out.columns:
        out = out.rename(columns={"measured_ratio": "ratio"})
    if "ratio" not in out.columns and {"step_nat_ms", "step_win_ms"} <= set(out.columns):
        out["ratio"] = [an.cost_side_ratio(n, w) for n, w in zip(out["step_nat_ms"], out["step_win_ms"], strict=True)]
    if "ratio" not in out.columns or "context" not in out.columns:
        return pd.DataFrame()
    keys = [c for c in ("model", "context", "k", "sink", "window", "backend") if c in out.columns]
    return out.drop_duplicates(subset=keys).reset_index(drop=True)


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


def _int_or_none(value: Any) -> int | None:
    try:
        return None if value is None or pd.isna(value) else int(value)
    except (TypeError, ValueError):
        return None


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
    k = _int_or_none(row.get("k"))
    if k:
        parts.append(f"k={k}")
    sink, window = _int_or_none(row.get("sink")), _int_or_none(row.get("window"))
    if sink is not None or window is not None:
        parts.append(f"S={sink} W={window}")
    label = " ".join(parts)
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
    out["facet"] = [" · ".join(_facet_value(c, r.get(c)) for c in facet_keys) for r in records]
    out["series"] = [series_label(r, with_concurrency=varies["concurrency"]) for r in records]
    if "rung" in out.columns:
        out["context"] = [context_label(r) for r in out["rung"]]
    return out


WORKLOAD_LABELS = {"code": "code prompts", "copy": "copy task (repeats a far-back passage)"}


def _facet_value(key: str, value: Any) -> str:
    return WORKLOAD_LABELS.get(str(value), str(value)) if key == "workload" else str(value)


def _arm_order(frame: pd.DataFrame) -> pd.DataFrame:
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


def _fmt(value: Any, digits: int = 4) -> str:
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


def fmt_ci(point: float, lo: float, hi: float, digits: int = 4) -> str:
    """'1.605 [1.581, 1.629]' or just the point when the interval is missing."""
    if not np.isfinite(point):
        return ""
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return _fmt(point, digits)
    return f"{_fmt(point, digits)} [{_fmt(lo, digits)}, {_fmt(hi, digits)}]"


# --------------------------------------------------------------------------------------------------
# Figure styles: the same series looks the same in every figure of a report
# --------------------------------------------------------------------------------------------------

#: Per arm: a matplotlib colormap whose shades tell that arm's series apart, and a marker.
ARM_STYLES: dict[str, tuple[str, str]] = {
    "none": ("Greys", "o"),
    "mtp": ("Blues", "s"),
    "wmtp": ("Oranges", "^"),
    "wmtp-ring": ("Greens", "D"),
}
OTHER_ARM_STYLE = ("Purples", "v")


def series_styles(frame: pd.DataFrame, key: str = "series") -> dict[str, dict[str, Any]]:
    """``name → {color, marker, ls}`` for every series of ``frame`` (which has ``key``, ``arm`` and the
    series keys, e.g. the labelled overview), named by its ``key`` column (default ``series``, so a series
    looks the same in every model's panel): one hue per arm (none grey, mtp blue, wmtp orange, wmtp-ring
    green), darker shades for larger k within an arm, one marker per arm, wmtp-ring dashed."""
    import matplotlib as mpl

    if frame.empty or key not in frame.columns:
        return {}
    sort = [c for c in ("k", "sink", "window", "concurrency", "model", "engine") if c in frame.columns]
    styles: dict[str, dict[str, Any]] = {}
    for arm, group in frame.groupby("arm", sort=False, dropna=False):
        cmap_name, marker = ARM_STYLES.get(str(arm), OTHER_ARM_STYLE)
        labels = list(dict.fromkeys(group.sort_values(sort, na_position="first", kind="stable")[key]))
        shades = [0.7] if len(labels) == 1 else np.linspace(0.5, 0.95, len(labels))
        cmap = mpl.colormaps[cmap_name]
        for label, shade in zip(labels, shades, strict=True):
            styles[label] = {
                "color": mpl.colors.to_hex(cmap(float(shade))),
                "marker": marker,
                "ls": "--" if arm == "wmtp-ring" else "-",
            }
    return styles


def k_color(k: Any) -> str:
    """The colour of draft depth ``k`` wherever k is the colour (the wedge): an ordinal palette fixed
    across reports (plasma: k=1 dark blue … k=3 magenta … k=5 orange)."""
    import matplotlib as mpl

    ki = _int_or_none(k) or 1
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


# --------------------------------------------------------------------------------------------------
# Sections (figure/table-ready data)
# --------------------------------------------------------------------------------------------------


def overview(tidy: Tidy) -> pd.DataFrame:
    """One row per series: the cells of the study, their rungs and repeats."""
    r = tidy.rungs
    keys = [c for c in an.SERIES_KEYS if c in r.columns]
    rows = []
    for key, group in an._groups(r, keys):
        rows.append(
            {
                **key,
                "rungs": ", ".join(context_label(x) for x in sorted(group["rung"].unique())),
                "repeats": ", ".join(str(int(n)) for n in group.sort_values("rung")["n_repeats"]),
            }
        )
    out = pd.DataFrame(rows)
    for col in ("k", "sink", "window", "concurrency"):
        if col in out.columns:
            out[col] = pd.to_numeric(out[col], errors="coerce").astype("Int64")
    return _arm_order(out)


def decode_section(tidy: Tidy, **boot: Any) -> Section:
    """Decode tok/s per series vs context (median over repeats, bootstrap CI)."""
    frame = an.decode_table(tidy.requests, **boot)
    if frame.empty:
        return Section(notes=("no measured requests with a decode rate",))
    return Section(_arm_order(add_labels(frame, tidy.rungs)))


def answer_rows(tidy: Tidy) -> pd.DataFrame:
    """Paired comparisons with their intervals and verdicts: the derive stage's table where it was written
    (``<study>/derived/answer.parquet`` beside the tidy folder), else computed the same way."""
    if tidy.requests.empty or "excluded" not in tidy.requests.columns:
        return pd.DataFrame(columns=answer.COLUMNS)
    if tidy.derived_dir is not None and (tidy.derived_dir / "answer.parquet").exists():
        return pd.read_parquet(tidy.derived_dir / "answer.parquet")
    return answer.answer_table(tidy.requests, tidy.rungs)


def _interval_text(row: pd.Series, quantity: str) -> str:
    if not math.isfinite(row["lo"]):
        return f"{answer._fmt(row['value'], quantity)} (n = {int(row['n'])})"
    return (
        f"{answer._fmt(row['value'], quantity)} [{answer._fmt(row['lo'], quantity)}, "
        f"{answer._fmt(row['hi'], quantity)}] n = {int(row['n'])}" + (f", {row['verdict']}" if row["verdict"] else "")
    )


def answer_section(tidy: Tidy) -> Section:
    """The page's opening table: per context and drafting series, each paired comparison in one cell."""
    rows = answer_rows(tidy)
    if rows.empty:
        return Section(notes=(NOTE_NO_DRAFT if not tidy.has_drafting else NOTE_NO_BASE,))
    titles = {
        "speedup": "speedup over no draft",
        "cost_side_ratio": "cost-side ratio vs mtp",
        "acceptance": "acceptance",
        "acceptance_change": "acceptance vs mtp",
    }
    keys = ["model", "engine", "concurrency", "workload", "rung", "arm", "k", "sink", "window"]
    out = []
    for key, group in rows.groupby(keys, dropna=False, sort=True):
        record = dict(zip(keys, key, strict=True))
        line = {
            "workload": record["workload"],
            "context": context_label(record["rung"]),
            "series": answer.series_label(record),
        }
        for _, r in group.iterrows():
            line[titles[r["quantity"]]] = _interval_text(r, r["quantity"])
        out.append(line)
    frame = pd.DataFrame(out).fillna("—")
    return Section(frame[[c for c in ["workload", "context", "series", *titles.values()] if c in frame.columns]])


def answer_sentences(tidy: Tidy) -> list[str]:
    """The findings at each workload's longest context, in words: resolved ones first."""
    rows = answer_rows(tidy)
    if rows.empty:
        return []
    longest = rows[rows["rung"] == rows.groupby("workload")["rung"].transform("max")]
    order = {"speedup": 0, "cost_side_ratio": 1, "acceptance_change": 2, "acceptance": 3}
    longest = longest.assign(_o=longest["quantity"].map(order), _r=longest["verdict"] != answer.RESOLVED)
    return [answer.sentence(r) for _, r in longest.sort_values(["_r", "workload", "_o"]).iterrows()]


def excluded_section(tidy: Tidy) -> Section:
    """Requests whose numbers are physically impossible: excluded from every figure and table, listed here."""
    if tidy.derived_dir is not None and (tidy.derived_dir / "excluded.parquet").exists():
        return Section(pd.read_parquet(tidy.derived_dir / "excluded.parquet"))
    r = tidy.requests
    if r.empty or "excluded" not in r.columns or not r["excluded"].any():
        return Section()
    cols = ["cell_id", "workload", "rung", "repeat", "slot", "completion_tokens", "decode_s", "exclusion"]
    return Section(r.loc[r["excluded"], [c for c in cols if c in r.columns]].reset_index(drop=True))


def speedup_section(tidy: Tidy, **boot: Any) -> Section:
    """Speedup over the none arm per drafting series vs context: paired geometric mean with its t interval."""
    if not tidy.has_drafting:
        return Section(notes=(NOTE_NO_DRAFT,))
    if an.BASE_ARM not in tidy.arms:
        return Section(notes=(NOTE_NO_BASE,))
    rows = answer_rows(tidy)
    if rows.empty:  # tidy tables written before requests were screened and paired
        frame = an.speedup_table(tidy.requests, **boot)
    else:
        frame = rows[rows["quantity"] == "speedup"].rename(columns={"value": "speedup"}).reset_index(drop=True)
    return (
        Section(_arm_order(add_labels(frame, tidy.rungs)))
        if not frame.empty
        else Section(notes=("no drafting series shares a rung with the none arm",))
    )


def speedup_change_section(tidy: Tidy, **boot: Any) -> Section:
    """Change of the speedup from the smallest to every larger rung, with CI (table)."""
    if not tidy.has_drafting or an.BASE_ARM not in tidy.arms:
        return Section(notes=(NOTE_NO_DRAFT if not tidy.has_drafting else NOTE_NO_BASE,))
    rungs = an.rungs_of(tidy.rungs)
    if len(rungs) < 2:
        return Section(notes=(NOTE_ONE_RUNG,))
    frames = [an.speedup_change_table(tidy.requests, rung_from=rungs[0], rung_to=r, **boot) for r in rungs[1:]]
    frame = (
        pd.concat([f for f in frames if not f.empty], ignore_index=True)
        if any(not f.empty for f in frames)
        else pd.DataFrame()
    )
    if frame.empty:
        return Section(notes=("no drafting series has two rungs in common with the none arm",))
    return Section(_arm_order(add_labels(frame, tidy.rungs)))


def cycle_section(tidy: Tidy) -> Section:
    """cycleMs per series vs context (from rungs.parquet: median decode tok/s and tokPerVerify)."""
    cols = [c for c in (*an.SERIES_KEYS, "rung", "cycle_ms", "decode_tok_s", "tok_per_verify") if c in tidy.rungs]
    frame = tidy.rungs[cols].copy()
    frame = frame[pd.to_numeric(frame["cycle_ms"], errors="coerce").notna()]
    if frame.empty:
        return Section(notes=("no cycle time could be computed (no decode rate or no tokPerVerify)",))
    return Section(_arm_order(add_labels(frame, tidy.rungs)))


def draft_tax_section(tidy: Tidy, **boot: Any) -> Section:
    """The draft-tax decomposition from the smallest to every larger rung."""
    if not tidy.has_drafting or an.BASE_ARM not in tidy.arms:
        return Section(notes=(NOTE_NO_DRAFT if not tidy.has_drafting else NOTE_NO_BASE,))
    rungs = an.rungs_of(tidy.rungs)
    if len(rungs) < 2:
        return Section(notes=(NOTE_ONE_RUNG,))
    frames = [an.draft_tax_table(tidy.rungs, tidy.requests, rung_from=rungs[0], rung_to=r, **boot) for r in rungs[1:]]
    frames = [f for f in frames if not f.empty]
    if not frames:
        return Section(notes=("no drafting series has two rungs in common with the none arm",))
    frame = pd.concat(frames, ignore_index=True)
    notes = []
    if (pd.to_numeric(frame["target_growth_ms"], errors="coerce") <= 0).any():
        notes.append(
            "the plain decode step did not grow with context on some series: the share is not meaningful there"
        )
    return Section(_arm_order(add_labels(frame, tidy.rungs)), tuple(notes))


def draft_tax_display(section: Section) -> pd.DataFrame:
    """The decomposition as a table for people (ms, %)."""
    if not section.available:
        return pd.DataFrame()
    f = section.frame
    out = pd.DataFrame(
        {
            "series": f["label"],
            "from → to": [
                f"{context_label(a)} → {context_label(b)}" for a, b in zip(f["rung_from"], f["rung_to"], strict=True)
            ],
            "plain step (ms)": [
                f"{_fmt(a)} → {_fmt(b)}" for a, b in zip(f["target_from_ms"], f["target_to_ms"], strict=True)
            ],
            "verify cycle (ms)": [
                f"{_fmt(a)} → {_fmt(b)}" for a, b in zip(f["cycle_from_ms"], f["cycle_to_ms"], strict=True)
            ],
            "target growth (ms)": [_fmt(v) for v in f["target_growth_ms"]],
            "cycle growth (ms)": [_fmt(v) for v in f["cycle_growth_ms"]],
            "draft growth (ms)": [_fmt(v) for v in f["draft_growth_ms"]],
            "per draft step (ms)": [
                fmt_ci(p, lo, hi)
                for p, lo, hi in zip(
                    f["per_step_ms"],
                    f.get("per_step_lo", f["per_step_ms"] * np.nan),
                    f.get("per_step_hi", f["per_step_ms"] * np.nan),
                    strict=True,
                )
            ],
            "share of target growth (%)": [
                fmt_ci(100 * p, 100 * lo, 100 * hi)
                for p, lo, hi in zip(
                    f["share"],
                    f.get("share_lo", f["share"] * np.nan),
                    f.get("share_hi", f["share"] * np.nan),
                    strict=True,
                )
            ],
        }
    )
    return out


def speedup_change_display(section: Section) -> pd.DataFrame:
    if not section.available:
        return pd.DataFrame()
    f = section.frame
    return pd.DataFrame(
        {
            "series": f["label"],
            "from → to": [
                f"{context_label(a)} → {context_label(b)}" for a, b in zip(f["rung_from"], f["rung_to"], strict=True)
            ],
            "speedup from": [_fmt(v, 4) for v in f["speedup_from"]],
            "speedup to": [_fmt(v, 4) for v in f["speedup_to"]],
            "change [95% CI]": [fmt_ci(p, lo, hi) for p, lo, hi in zip(f["change"], f["lo"], f["hi"], strict=True)],
            "± se": [_fmt(v) for v in f["se"]],
        }
    )


def acceptance_section(tidy: Tidy) -> Section:
    """tokPerVerify and acceptance rate per drafting series vs context."""
    if not tidy.has_drafting:
        return Section(notes=(NOTE_NO_DRAFT,))
    frame = an.acceptance_table(tidy.rungs)
    frame = frame[pd.to_numeric(frame["tok_per_verify"], errors="coerce").notna()] if not frame.empty else frame
    if frame.empty:
        return Section(notes=("the spec-decode counters did not move: no acceptance to show",))
    return Section(_arm_order(add_labels(frame, tidy.rungs)))


def acceptance_display(section: Section) -> pd.DataFrame:
    """Acceptance per series (and workload, where there are several) with one column per context:
    'accepted % (tokens per verify)', so full and windowed drafts read side by side."""
    if not section.available:
        return pd.DataFrame()
    f = section.frame
    by_workload = "workload" in f.columns and f["workload"].nunique() > 1
    varies = {c: c in f.columns and f[c].nunique(dropna=False) > 1 for c in ("model", "engine", "concurrency")}
    rows: dict[tuple[str, str], dict[str, str]] = {}
    for r in f.to_dict("records"):
        label = series_label(
            r, with_model=varies["model"], with_engine=varies["engine"], with_concurrency=varies["concurrency"]
        )  # the workload has its own column
        key = (_facet_value("workload", r["workload"]) if by_workload else "", label)
        rows.setdefault(key, {})[context_label(r["rung"])] = (
            f"{_fmt(100 * r['acceptance_rate'], 3)} % ({_fmt(r['tok_per_verify'], 3)})"
        )
    contexts = [context_label(x) for x in sorted(f["rung"].unique())]
    out = pd.DataFrame(
        [
            {"workload": w, "series": label, **{c: cells.get(c, "") for c in contexts}}
            for (w, label), cells in rows.items()
        ]
    )
    return out.sort_values(["workload"], kind="stable").drop(columns=[] if by_workload else ["workload"])


def positions_section(tidy: Tidy) -> Section:
    """Per-position acceptance rate per drafting series and rung."""
    if not tidy.has_drafting:
        return Section(notes=(NOTE_NO_DRAFT,))
    if tidy.positions.empty:
        return Section(notes=("not measured: the engine exposed no per-position acceptance counters",))
    frame = an.position_table(tidy.positions, tidy.rungs)
    frame = frame[pd.to_numeric(frame["rate"], errors="coerce").notna()]
    if frame.empty:
        return Section(notes=("the spec-decode counters did not move: no per-position acceptance to show",))
    return Section(_arm_order(add_labels(frame, tidy.rungs)))


def _power_notes(rungs: pd.DataFrame) -> tuple[str, ...]:
    status = set(rungs["power_status"].fillna("unavailable")) if "power_status" in rungs.columns else {"unavailable"}
    notes = []
    if status == {"unavailable"}:
        notes.append(NOTE_NO_POWER)
    elif "unavailable" in status:
        notes.append("partly not measured: some rungs have no energy reading (no NVML or a counter reset)")
    if "relative-only" in status:
        notes.append(NOTE_RELATIVE_POWER)
    return tuple(notes)


def energy_section(tidy: Tidy, **boot: Any) -> Section:
    """tok/J and mean board power per series vs context, where energy was measured."""
    notes = _power_notes(tidy.rungs)
    frame = an.energy_table(tidy.rungs, tidy.requests, **boot)
    if frame.empty:
        return Section(notes=notes or (NOTE_NO_POWER,))
    return Section(_arm_order(add_labels(frame, tidy.rungs)), notes)


def prefill_section(tidy: Tidy, **boot: Any) -> Section:
    """TTFT and prefill tok/s per series vs context, with CI."""
    frame = an.prefill_table(tidy.requests, **boot)
    if frame.empty:
        return Section(notes=("no measured requests with a first-token time",))
    return Section(_arm_order(add_labels(frame, tidy.rungs)))


def paper_claim(published: pd.DataFrame) -> dict[str, float] | None:
    """The paper's headline cost-side ratio as a wedge band: {'rung', 'lo', 'hi'} (ratio − 1)."""
    if published.empty:
        return None
    rows = published[
        (published["study"] == PAPER_STUDY) & (published["quantity"] == "cost_side_ratio") & published["primary"]
    ]
    if rows.empty:
        return None
    r = rows.iloc[0]
    return {"rung": float(r["rung"]), "lo": float(r["lo"]) - 1.0, "hi": float(r["hi"]) - 1.0}


PAPER_STUDY_CONFIG = REPO_ROOT / "config" / "studies" / "paper-1m.yaml"
PAPER_K = 3


def _against_ceiling(lo: float, hi: float, ceiling: float) -> str:
    if not math.isfinite(ceiling):
        return "—"
    if lo > ceiling:
        return "above the ceiling"
    return "upper end above the ceiling" if hi > ceiling else "within the ceiling"


PAPER_RECLAIM_PCT = (7.7, 11.1)


def ring_reclaim_section(models_dir: Path | str | None = None, context: int = 1 << 20, k: int = PAPER_K) -> Section:
    """What a ring buffer for the draft's KV gives back at 1M, predicted per model in config/models: the draft
    layer's share of all attention KV, 1/(L_full + 1), next to the paper's 7.7–11.1 %."""
    from wmtp.analyze.costmodel import predict

    directory = Path(models_dir) if models_dir else MODELS_DIR
    rows = []
    for path in sorted(directory.glob("*.json")):
        p = predict(path, context, k, sink=64, window=4032)
        rows.append(
            {
                "model": p.model,
                "context": context_label(context),
                "draft KV share (%)": round(100 * p.draft_kv_share, 1),
                "KV reclaimed by the ring (%)": round(100 * p.ring_reclaimed_fraction, 1),
                "paper (%)": f"{PAPER_RECLAIM_PCT[0]}–{PAPER_RECLAIM_PCT[1]}",
            }
        )
    return Section(pd.DataFrame(rows))


def kv_capacity_section(tidy: Tidy) -> Section:
    """The engine's own KV capacity per cell (tokens, and requests of max_model_len it admits at once)."""
    r = tidy.requests
    if r.empty or "kv_cache_tokens" not in r.columns or r["kv_cache_tokens"].isna().all():
        return Section()
    cols = ["arm", "k", "sink", "window", "kv_cache_tokens", "max_concurrency"]
    frame = r[[c for c in ["cell_id", *cols] if c in r.columns]].drop_duplicates("cell_id").drop(columns="cell_id")
    return Section(_arm_order(frame.reset_index(drop=True)))


def paper_claim_section(replica: pd.DataFrame | None, published: pd.DataFrame, k: int = PAPER_K) -> Section:
    """The paper's 1.28–1.44× at 1M next to what bounds it: per replica model at its longest context, the
    ratio the H200 replica measured, the cost model's prediction, and the ceiling 1 + k·(draft KV)/(target KV)
    that holds when the draft's KV reads are all that windowing removes (weights and everything else equal).
    """
    claim = paper_claim(published)
    if claim is None or replica is None or replica.empty or "measured_ratio" not in replica.columns:
        return Section()
    from wmtp.analyze.costmodel import limit_ratio

    rows = []
    at_k = replica[replica["k"] == k]
    for model, group in at_k.groupby("model", sort=True):
        longest = group[group["context"] == group["context"].max()].iloc[0]
        # The replica names models as their vendors do ("NVIDIA-Nemotron-…"); config/models without the vendor.
        path = model_file(canonical_model(model)) or model_file(canonical_model(model).split("-", 1)[-1])
        ceiling = limit_ratio(path, k) if path else math.nan
        lo, hi = 1.0 + claim["lo"], 1.0 + claim["hi"]
        rows.append(
            {
                "model": model,
                "context": context_label(longest["context"]),
                "replica (H200)": round(float(longest["measured_ratio"]), 3),
                "cost model": round(float(longest["predicted_ratio"]), 3),
                f"ceiling 1 + {k}/L_full": round(ceiling, 3),
                "paper": f"{lo:.2f}–{hi:.2f}",
                "the paper's range": (
                    "above the ceiling"
                    if lo > ceiling
                    else "upper end above the ceiling"
                    if hi > ceiling
                    else "below it"
                ),
            }
        )
    return Section(pd.DataFrame(rows))


def canonical_model(name: Any, models_dir: Path | str | None = None) -> str:
    """A model's name as its config/models file spells it, lower-cased, so that a study's checkpoint name
    and the replica's name meet: 'qwen3.5-122b-a10b-fp8' and 'Qwen3.5-122B-A10B' → 'qwen3.5-122b-a10b'.
    The name itself, lower-cased, when no file matches."""
    lowered = str(name).lower()
    path = model_file(lowered, models_dir)
    if path is None:
        return lowered
    try:
        return str(json.loads(path.read_text())["name"]).lower()
    except (OSError, ValueError, KeyError):
        return path.stem


def paper_models(study_config: Path | str | None = None, models_dir: Path | str | None = None) -> frozenset[str]:
    """The paper's models (its 1M study's ``models``, as :func:`canonical_model` names); empty when that
    config is absent. The paper's cost-side claim is drawn only next to these models."""
    import yaml

    path = Path(study_config) if study_config else PAPER_STUDY_CONFIG
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return frozenset()
    models = (config.get("models") or []) if isinstance(config, dict) else []
    return frozenset(
        canonical_model(m["name"], models_dir) for m in models if isinstance(m, dict) and m.get("name") is not None
    )


def wedge_section(
    tidy: Tidy, replica: pd.DataFrame | None, paper: frozenset[str] | set[str] | None = None, **boot: Any
) -> Section:
    """The paper's Fig. 3 wedge, step_nat/step_win − 1 vs context, from the windowed arms and the replica.

    Columns: source ('measured' | 'replica' | 'replica model'), label, model, arm, k, sink, window, rung,
    context, wedge, wedge_lo, wedge_hi, and for small multiples: ``panel`` (one per model and kind:
    '<model> · GPU replica' or '<model> · this study'), ``variant`` (the series without its k, which is
    the colour: 'wmtp S=64 W=4032'), ``paper_model`` (the paper measured this model, see
    :func:`paper_models`; default: the paper's study config). Rows come panel by panel: replica panels
    of the paper's models first, then other replica models, then this study's measured panels.
    """
    paper = paper_models() if paper is None else frozenset(paper)
    parts = []
    notes = []
    if tidy.has_windowed:
        measured = an.cost_side_table(tidy.rungs, tidy.requests, **boot)
        if not measured.empty:
            measured = add_labels(measured, tidy.rungs)
            varies = {
                c: c in tidy.rungs.columns and tidy.rungs[c].nunique(dropna=False) > 1
                for c in ("engine", "concurrency")
            }
            measured["variant"] = [
                series_label({**r, "k": None}, with_engine=varies["engine"], with_concurrency=varies["concurrency"])
                for r in measured.to_dict("records")
            ]
            several_workloads = "workload" in measured.columns and measured["workload"].nunique() > 1
            measured["panel"] = [
                " · ".join(
                    [str(r["model"]), "this study"]
                    + ([_facet_value("workload", r["workload"])] if several_workloads else [])
                )
                for r in measured.to_dict("records")
            ]
            parts.append(measured.assign(source="measured"))
        else:
            notes.append("the windowed arms share no (k, rung) with an mtp arm: no measured wedge")
    else:
        notes.append(NOTE_NO_WINDOWED)
    if replica is not None and not replica.empty:
        rep = replica.copy()
        rep["rung"] = rep["context"]
        rep["arm"] = "wmtp"
        rep["wedge"] = pd.to_numeric(rep["ratio"], errors="coerce") - 1.0
        rep["context"] = [context_label(c) for c in rep["rung"]]
        backends = rep["backend"] if "backend" in rep.columns else pd.Series([None] * len(rep), index=rep.index)
        several = backends.nunique(dropna=True) > 1
        rep["variant"] = [
            series_label({"arm": "wmtp", "sink": sk, "window": w}) + (f" [{b}]" if several and b is not None else "")
            for sk, w, b in zip(rep["sink"], rep["window"], backends, strict=True)
        ]
        rep["label"] = [
            f"replica {m} {series_label({'arm': 'wmtp', 'k': k, 'sink': sk, 'window': w})}"
            + (f" [{b}]" if several and b is not None else "")
            for m, k, sk, w, b in zip(rep["model"], rep["k"], rep["sink"], rep["window"], backends, strict=True)
        ]
        rep["panel"] = [f"{m} · GPU replica" for m in rep["model"]]
        parts.append(rep.assign(source="replica"))
        if "predicted_ratio" in rep.columns and pd.to_numeric(rep["predicted_ratio"], errors="coerce").notna().any():
            pred = rep.copy()
            pred["wedge"] = pd.to_numeric(rep["predicted_ratio"], errors="coerce") - 1.0
            pred["label"] = [f"{lab} (roofline model)" for lab in rep["label"]]
            parts.append(pred.assign(source="replica model"))
    else:
        notes.append(NOTE_NO_REPLICA)
    if not parts:
        return Section(notes=tuple(notes))
    frame = pd.concat(parts, ignore_index=True)
    frame = frame[pd.to_numeric(frame["wedge"], errors="coerce").notna()]
    for col in ("wedge_lo", "wedge_hi"):
        if col not in frame.columns:
            frame[col] = np.nan
    frame["paper_model"] = [canonical_model(m) in paper for m in frame["model"]]
    frame = frame.assign(_measured=frame["source"] == "measured", _other=~frame["paper_model"], _model=frame["model"])
    frame = frame.sort_values(["_measured", "_other", "_model"], kind="stable")
    keep = [
        "source",
        "panel",
        "paper_model",
        "label",
        "variant",
        "model",
        "arm",
        "k",
        "sink",
        "window",
        "rung",
        "context",
        "wedge",
        "wedge_lo",
        "wedge_hi",
    ]
    frame = frame[[c for c in keep if c in frame.columns]].reset_index(drop=True)
    return Section(frame, tuple(notes)) if not frame.empty else Section(notes=(*notes, "no finite wedge value"))


# --------------------------------------------------------------------------------------------------
# Measured vs published
# --------------------------------------------------------------------------------------------------


def _q(
    quantity: str,
    arm: str,
    value: float,
    *,
    k: Any = None,
    rung: Any = None,
    rung_from: Any = None,
    position: Any = None,
    lo: float = math.nan,
    hi: float = math.nan,
    **key: Any,
) -> dict[str, Any]:
    return {
        "quantity": quantity,
        "arm": arm,
        "k": _int_or_none(k),
        "rung": _int_or_none(rung),
        "rung_from": _int_or_none(rung_from),
        "position": _int_or_none(position),
        "value": value,
        "lo": lo,
        "hi": hi,
        **{c: key.get(c) for c in ("model", "engine", "concurrency", "sink", "window")},
    }


# One flat block per published quantity, in the CSVs' vocabulary: long, but each branch is one lookup.
def measured_quantities(tidy: Tidy, **boot: Any) -> pd.DataFrame:  # noqa: C901
    """Every quantity the published CSVs name, as measured, in the CSVs' units (long format).

    Columns: quantity, arm, k, rung, rung_from, position, value, lo, hi, model, engine, concurrency,
    sink, window. Changes across context are taken from the smallest rung to each larger one.
    """
    rows: list[dict[str, Any]] = []
    r = tidy.rungs
    for rec in r.to_dict("records"):
        arm, k = rec["arm"], (_int_or_none(rec.get("k")) or None)
        key = {c: rec.get(c) for c in ("model", "engine", "concurrency", "sink", "window")}
        common = {"k": k, "rung": rec["rung"], **key}
        rows.append(_q("prompt_tokens", arm, float(rec["prompt_tokens"]), **common))
        rows.append(_q("n_repeats", arm, float(rec["n_repeats"]), **common))
        rows.append(_q("cycle_ms", arm, float(rec["cycle_ms"]), **common))
        rows.append(_q("ttft_s", arm, float(rec["ttft_s"]), **common))
        rows.append(_q("prefill_tok_s", arm, float(rec["prefill_tok_s"]), **common))
        rows.append(_q("decode_tok_s", arm, float(rec["decode_tok_s"]), **common))
        if arm != an.BASE_ARM:
            rows.append(_q("tok_per_verify", arm, float(rec["tok_per_verify"]), **common))
            rows.append(_q("acceptance_rate_pct", arm, 100 * float(rec["acceptance_rate"]), **common))
    energy = an.energy_table(r, tidy.requests, **boot)
    for rec in energy.to_dict("records"):
        common = {
            "k": _int_or_none(rec.get("k")) or None,
            "rung": rec["rung"],
            **{c: rec.get(c) for c in ("model", "engine", "concurrency", "sink", "window")},
        }
        rows.append(_q("tok_per_j", rec["arm"], float(rec["tok_per_j"]), **common))
        rows.append(_q("power_w", rec["arm"], float(rec["power_w"]), **common))
    if not tidy.positions.empty:
        for rec in an.position_table(tidy.positions).to_dict("records"):
            rows.append(
                _q(
                    "accepted_at_position",
                    rec["arm"],
                    float(rec["d_accepted_pos"]),
                    k=_int_or_none(rec.get("k")) or None,
                    rung=rec["rung"],
                    position=rec["position"],
                    **{c: rec.get(c) for c in ("model", "engine", "concurrency", "sink", "window")},
                )
            )
    # spread of the repeats
    dec = an.decode_table(tidy.requests, **boot)
    req = tidy.requests
    for rec in dec.to_dict("records"):
        common = {
            "k": _int_or_none(rec.get("k")) or None,
            "rung": rec["rung"],
            **{c: rec.get(c) for c in ("model", "engine", "concurrency", "sink", "window")},
        }
        rows.append(_q("decode_tok_s_range", rec["arm"], math.nan, lo=rec["min"], hi=rec["max"], **common))
        vals = an._clean(
            an._select(req, {**{c: rec.get(c) for c in an.SERIES_KEYS if c in req.columns}, "rung": rec["rung"]})[
                "decode_tok_s"
            ]
        )
        if len(vals) > 1:
            sd = float(np.std(vals, ddof=1))
            rows.append(_q("decode_tok_s_sigma_run_to_run", rec["arm"], sd, **common))
            rows.append(_q("decode_tok_s_sem", rec["arm"], sd / math.sqrt(len(vals)), **common))
    # speedups and their change across context
    rungs = an.rungs_of(r)
    if tidy.has_drafting and an.BASE_ARM in tidy.arms:
        for rec in an.speedup_table(req, **boot).to_dict("records"):
            common = {
                "k": _int_or_none(rec.get("k")),
                "rung": rec["rung"],
                **{c: rec.get(c) for c in ("model", "engine", "concurrency", "sink", "window")},
            }
            rows.append(_q("speedup", rec["arm"], rec["speedup"], lo=rec["lo"], hi=rec["hi"], **common))
            rows.append(_q("decode_tok_s_gain_pct", rec["arm"], 100 * (rec["speedup"] - 1), **common))
        for to in rungs[1:]:
            for rec in an.speedup_change_table(req, rung_from=rungs[0], rung_to=to, **boot).to_dict("records"):
                common = {
                    "k": _int_or_none(rec.get("k")),
                    "rung": to,
                    "rung_from": rungs[0],
                    **{c: rec.get(c) for c in ("model", "engine", "concurrency", "sink", "window")},
                }
                rows.append(_q("speedup_change", rec["arm"], rec["change"], lo=rec["lo"], hi=rec["hi"], **common))
                if rec["se"] and np.isfinite(rec["se"]) and rec["se"] > 0:
                    rows.append(_q("speedup_change_sigmas", rec["arm"], rec["change"] / rec["se"], **common))
                    rows.append(_q("speedup_dip_sigmas", rec["arm"], abs(rec["change"]) / rec["se"], **common))
            for rec in an.draft_tax_table(r, req, rung_from=rungs[0], rung_to=to, **boot).to_dict("records"):
                key = {c: rec.get(c) for c in ("model", "engine", "concurrency", "sink", "window")}
                common = {"k": _int_or_none(rec.get("k")), "rung": to, "rung_from": rungs[0], **key}
                base = {"rung": to, "rung_from": rungs[0], **{**key, "sink": None, "window": None}}
                rows.append(_q("target_growth_ms", an.BASE_ARM, rec["target_growth_ms"], **base))
                rows.append(
                    _q(
                        "target_growth_pct",
                        an.BASE_ARM,
                        100 * an.relative_change(rec["target_from_ms"], rec["target_to_ms"]),
                        **base,
                    )
                )
                rows.append(_q("cycle_growth_ms", rec["arm"], rec["cycle_growth_ms"], **common))
                rows.append(_q("draft_growth_ms", rec["arm"], rec["draft_growth_ms"], **common))
                rows.append(
                    _q(
                        "draft_growth_per_step_ms",
                        rec["arm"],
                        rec["per_step_ms"],
                        lo=rec.get("per_step_lo", math.nan),
                        hi=rec.get("per_step_hi", math.nan),
                        **common,
                    )
                )
                rows.append(
                    _q(
                        "draft_share_pct",
                        rec["arm"],
                        100 * rec["share"],
                        lo=100 * rec.get("share_lo", math.nan),
                        hi=100 * rec.get("share_hi", math.nan),
                        **common,
                    )
                )
    # relative changes read off the rungs table
    for key, group in an._groups(r, an.SERIES_KEYS):
        if len(rungs) < 2:
            break
        g = group.set_index("rung")
        first = rungs[0]
        if first not in g.index:
            continue
        for to in rungs[1:]:
            if to not in g.index:
                continue
            common = {
                "k": _int_or_none(key.get("k")) or None,
                "rung": to,
                "rung_from": first,
                **{c: key.get(c) for c in ("model", "engine", "concurrency", "sink", "window")},
            }
            if key["arm"] != an.BASE_ARM:
                rows.append(
                    _q(
                        "tok_per_verify_erosion_pct",
                        key["arm"],
                        -100
                        * an.relative_change(float(g.at[first, "tok_per_verify"]), float(g.at[to, "tok_per_verify"])),
                        **common,
                    )
                )
    # the draft's cost on TTFT, and the windowed arms' recovery, at matched rung
    if an.BASE_ARM in tidy.arms:
        for rec in r[r["arm"] != an.BASE_ARM].to_dict("records"):
            base = an._select(
                r,
                {
                    "arm": an.BASE_ARM,
                    "rung": rec["rung"],
                    **{c: rec.get(c) for c in an.MATCH_KEYS if c in r.columns},
                },
            )
            if base.empty:
                continue
            rows.append(
                _q(
                    "ttft_cost_pct",
                    rec["arm"],
                    100 * an.relative_change(float(base["ttft_s"].iloc[0]), float(rec["ttft_s"])),
                    k=rec.get("k"),
                    rung=rec["rung"],
                    **{c: rec.get(c) for c in ("model", "engine", "concurrency", "sink", "window")},
                )
            )
    if tidy.has_windowed:
        for rec in an.cost_side_table(r, req, **boot).to_dict("records"):
            k = _int_or_none(rec.get("k")) or 1
            common = {
                "k": rec.get("k"),
                "rung": rec["rung"],
                **{c: rec.get(c) for c in ("model", "engine", "concurrency", "sink", "window")},
            }
            rows.append(_q("cost_side_ratio", rec["arm"], rec["ratio"], **common))
            rows.append(
                _q(
                    "cost_side_wedge_pct",
                    rec["arm"],
                    100 * rec["wedge"],
                    lo=100 * rec.get("wedge_lo", math.nan),
                    hi=100 * rec.get("wedge_hi", math.nan),
                    **common,
                )
            )
            recovery = rec["step_nat_ms"] - rec["step_win_ms"]
            rows.append(_q("wmtp_recovery_per_cycle_ms", rec["arm"], recovery, **common))
            rows.append(_q("wmtp_recovery_per_step_ms", rec["arm"], recovery / k, **common))
            rows.append(_q("wmtp_recovery_pct_of_decode", rec["arm"], 100 * recovery / rec["step_nat_ms"], **common))
    out = pd.DataFrame(rows)
    if not out.empty:
        out["value"] = pd.to_numeric(out["value"], errors="coerce")
        ident = [
            "quantity",
            "arm",
            "k",
            "rung",
            "rung_from",
            "position",
            "model",
            "engine",
            "concurrency",
            "sink",
            "window",
        ]
        out = out.drop_duplicates(subset=[c for c in (*ident, "workload") if c in out.columns]).reset_index(drop=True)
    return out


def _matches(pub: pd.Series, meas: pd.DataFrame) -> pd.DataFrame:
    sel = meas[meas["quantity"] == pub["quantity"]]
    if "workload" in sel.columns:  # the published studies measured plain prompts, never the copy task
        sel = sel[sel["workload"].fillna("code") == "code"]
    if pub["arm"]:
        sel = sel[sel["arm"] == pub["arm"]]
    for col in ("k", "rung", "rung_from", "position"):
        if not pd.isna(pub[col]):
            sel = sel[sel[col] == int(pub[col])]
        elif col in ("rung_from", "position"):
            sel = sel[sel[col].isna()]
    return sel


def _difference(pub: pd.Series, value: float, lo: float, hi: float) -> tuple[float, float, str]:
    """(difference, relative difference, verdict) of a measured number against a published one."""
    if np.isfinite(pub["value"]) and np.isfinite(value):
        diff = value - pub["value"]
        rel = diff / pub["value"] if pub["value"] else math.nan
        verdict = ""
        if np.isfinite(pub["pm"]):
            verdict = "within ±" if abs(diff) <= pub["pm"] else "outside ±"
        return diff, rel, verdict
    if np.isfinite(pub["lo"]) or np.isfinite(pub["hi"]):
        plo = pub["lo"] if np.isfinite(pub["lo"]) else -math.inf
        phi = pub["hi"] if np.isfinite(pub["hi"]) else math.inf
        if np.isfinite(value):
            diff = 0.0 if plo <= value <= phi else (value - plo if value < plo else value - phi)
            return diff, math.nan, "inside range" if diff == 0 else "outside range"
        if np.isfinite(lo) and np.isfinite(hi):
            return (
                (lo - plo if np.isfinite(plo) else math.nan),
                math.nan,
                ("inside range" if plo <= lo and hi <= phi else "range differs"),
            )
    return math.nan, math.nan, ""


def published_comparison(tidy: Tidy, published: pd.DataFrame, study: str, **boot: Any) -> Section:
    """Measured vs published for every published number of ``study`` that this study measures.

    One row per (published number, matching measured series). Published numbers the pipeline does
    not measure (model facts, the recipe's headline, idle power) are listed in the note.
    """
    pub = published[published["study"] == study] if not published.empty else published
    if pub.empty:
        return Section(notes=(f"no published numbers for study '{study}'",))
    meas = measured_quantities(tidy, **boot)
    rows = []
    unmatched = []
    for _, p in pub.iterrows():
        sel = _matches(p, meas) if not meas.empty else meas
        if sel.empty:
            unmatched.append(p["quantity"])
            continue
        for _, m in sel.iterrows():
            diff, rel, verdict = _difference(p, m["value"], m["lo"], m["hi"])
            rows.append(
                {
                    "quantity": p["quantity"],
                    "arm": m["arm"],
                    "k": m["k"],
                    "sink": m["sink"],
                    "window": m["window"],
                    "rung": m["rung"],
                    "rung_from": m["rung_from"],
                    "position": m["position"],
                    "unit": p["unit"],
                    "published": p["value"],
                    "published_pm": p["pm"],
                    "published_lo": p["lo"],
                    "published_hi": p["hi"],
                    "measured": m["value"],
                    "measured_lo": m["lo"],
                    "measured_hi": m["hi"],
                    "difference": diff,
                    "relative_difference": rel,
                    "verdict": verdict,
                    "primary": p["primary"],
                    "model": m["model"],
                    "engine": m["engine"],
                    "concurrency": m["concurrency"],
                    "source_quote": p["source_quote"],
                }
            )
    notes = []
    if unmatched:
        notes.append("published but not measured here: " + ", ".join(sorted(set(unmatched))))
    if not rows:
        return Section(notes=(*notes, f"nothing this study measured matches the published numbers of '{study}'"))
    return Section(pd.DataFrame(rows), tuple(notes))


def published_display(section: Section) -> pd.DataFrame:
    """The comparison as a table for people."""
    if not section.available:
        return pd.DataFrame()
    f = section.frame

    def pub_text(r: pd.Series) -> str:
        if np.isfinite(r["published"]):
            pm = f" ± {_fmt(r['published_pm'])}" if np.isfinite(r["published_pm"]) else ""
            return f"{_fmt(r['published'], 4)}{pm}"
        lo = _fmt(r["published_lo"], 4) if np.isfinite(r["published_lo"]) else "…"
        hi = _fmt(r["published_hi"], 4) if np.isfinite(r["published_hi"]) else "…"
        return f"{lo}–{hi}"

    def meas_text(r: pd.Series) -> str:
        if np.isfinite(r["measured"]):
            return fmt_ci(r["measured"], r["measured_lo"], r["measured_hi"], 4)
        if np.isfinite(r["measured_lo"]):
            return f"{_fmt(r['measured_lo'], 4)}–{_fmt(r['measured_hi'], 4)}"
        return ""

    def where(r: pd.Series) -> str:
        parts = []
        if not pd.isna(r["rung_from"]):
            parts.append(f"{context_label(r['rung_from'])} → {context_label(r['rung'])}")
        elif not pd.isna(r["rung"]):
            parts.append(context_label(r["rung"]))
        if not pd.isna(r["position"]):
            parts.append(f"pos {int(r['position'])}")
        return " ".join(parts)

    return pd.DataFrame(
        {
            "quantity": f["quantity"],
            "series": [series_label(r) for r in f.to_dict("records")],
            "context": [where(r) for _, r in f.iterrows()],
            "unit": f["unit"],
            "published": [pub_text(r) for _, r in f.iterrows()],
            "measured": [meas_text(r) for _, r in f.iterrows()],
            "difference": [_fmt(v) for v in f["difference"]],
            "relative": [f"{100 * v:+.1f} %" if np.isfinite(v) else "" for v in f["relative_difference"]],
            "verdict": f["verdict"],
        }
    )


# --------------------------------------------------------------------------------------------------
# Cost model (optional)
# --------------------------------------------------------------------------------------------------

MODELS_DIR = REPO_ROOT / "config" / "models"
NOTE_COSTMODEL_SCOPE = (
    "the cost model is a roofline at the replica's dtype and bandwidth; only bandwidth-free shapes are "
    "compared here (the draft's share of the target's growth, the cost-side ratio), not milliseconds"
)


def model_file(model: str, models_dir: Path | str | None = None) -> Path | None:
    """config/models/<name>.json for a study's model name: exact stem, else the longest stem it starts
    with (``qwen3.6-35b-a3b-nvfp4`` → ``qwen3.6-35b-a3b.json``); None when there is none."""
    models_dir = Path(models_dir) if models_dir else MODELS_DIR
    stems = {f.stem: f for f in models_dir.glob("*.json")} if models_dir.is_dir() else {}
    if model in stems:
        return stems[model]
    prefixes = [st for st in stems if model.startswith(st)]
    return stems[max(prefixes, key=len)] if prefixes else None


def costmodel_section(tidy: Tidy, models_dir: Path | str | None = None) -> Section:
    """Measured vs ``wmtp.analyze.costmodel.predict`` on the quantities that do not depend on bandwidth.

    Rows (``quantity``): ``draft_share_pct`` (per draft step growth / target growth between the smallest
    and each larger rung, predicted from the none and native step costs) for every drafting series,
    and ``cost_side_ratio`` (step_nat / step_win) per rung for every windowed series. Columns: the
    series keys, label, quantity, rung_from, rung, context, measured, predicted, difference.
    """
    try:
        from wmtp.analyze.costmodel import predict
    except ImportError:
        return Section(notes=(NOTE_COSTMODEL_MISSING,))
    if not tidy.has_drafting or an.BASE_ARM not in tidy.arms:
        return Section(notes=("cost model: nothing to compare without a drafting arm and the none arm",))
    notes: list[str] = [NOTE_COSTMODEL_SCOPE]
    rows: list[dict[str, Any]] = []
    rungs = an.rungs_of(tidy.rungs)
    missing = sorted({m for m in tidy.rungs["model"].unique() if model_file(m, models_dir) is None})
    if missing:
        notes.append("cost model: no architecture file in config/models for " + ", ".join(map(str, missing)))
    cache: dict[tuple[Any, ...], Any] = {}

    def pred(path: Path, context: int, k: int, sink: int, window: int) -> Any:
        key = (path, context, k, sink, window)
        if key not in cache:
            cache[key] = predict(path, int(context), int(k), int(sink), int(window))
        return cache[key]

    try:
        for to in rungs[1:]:
            tax = an.draft_tax_table(tidy.rungs, rung_from=rungs[0], rung_to=to)
            for rec in tax.to_dict("records"):
                path = model_file(rec["model"], models_dir)
                if path is None:
                    continue
                k = int(rec["k"])
                sink, window = (_int_or_none(rec.get("sink")) or 0), (_int_or_none(rec.get("window")) or 0)
                p0, p1 = pred(path, rungs[0], k, sink, window), pred(path, to, k, sink, window)
                step = "windowed" if rec["arm"] in an.WINDOWED_ARMS else "native"
                predicted = an.draft_tax(
                    p0.none.time_s * 1e3,
                    p1.none.time_s * 1e3,
                    getattr(p0, step).time_s * 1e3,
                    getattr(p1, step).time_s * 1e3,
                    k,
                )
                rows.append(
                    {
                        **{c: rec.get(c) for c in an.SERIES_KEYS},
                        "quantity": "draft_share_pct",
                        "rung_from": rungs[0],
                        "rung": to,
                        "measured": 100 * rec["share"],
                        "predicted": 100 * predicted.share,
                    }
                )
        if tidy.has_windowed:
            for rec in an.cost_side_table(tidy.rungs).to_dict("records"):
                path = model_file(rec["model"], models_dir)
                if path is None:
                    continue
                p = pred(
                    path,
                    rec["rung"],
                    int(rec["k"]),
                    _int_or_none(rec.get("sink")) or 0,
                    _int_or_none(rec.get("window")) or 0,
                )
                rows.append(
                    {
                        **{c: rec.get(c) for c in an.SERIES_KEYS},
                        "quantity": "cost_side_ratio",
                        "rung_from": None,
                        "rung": rec["rung"],
                        "measured": rec["ratio"],
                        "predicted": float(p.ratio),
                    }
                )
    except Exception as exc:  # the cost model is another module's code: report it, do not guess
        return Section(notes=(*notes, f"cost model failed: {type(exc).__name__}: {exc}"))
    if not rows:
        return Section(notes=tuple(notes))
    frame = pd.DataFrame(rows)
    frame["difference"] = frame["measured"] - frame["predicted"]
    return Section(_arm_order(add_labels(frame, tidy.rungs)), tuple(notes))


def costmodel_display(section: Section) -> pd.DataFrame:
    if not section.available:
        return pd.DataFrame()
    f = section.frame
    names = {"draft_share_pct": "draft share of target growth (%)", "cost_side_ratio": "step_nat / step_win"}
    return pd.DataFrame(
        {
            "series": f["label"],
            "quantity": [names.get(q, q) for q in f["quantity"]],
            "context": [
                f"{context_label(a)} → {context_label(b)}" if not pd.isna(a) else context_label(b)
                for a, b in zip(f["rung_from"], f["rung"], strict=True)
            ],
            "measured": [_fmt(v) for v in f["measured"]],
            "cost model": [_fmt(v) for v in f["predicted"]],
            "difference": [_fmt(v) for v in f["difference"]],
        }
    )


# --------------------------------------------------------------------------------------------------
# Everything the notebook needs, in one object
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReportData:
    study: str
    tidy: Tidy
    published: pd.DataFrame
    replica: pd.DataFrame | None
    overview: pd.DataFrame
    decode: Section
    speedup: Section
    speedup_change: Section
    cycle: Section
    draft_tax: Section
    acceptance: Section
    positions: Section
    energy: Section
    prefill: Section
    wedge: Section
    paper_claim: dict[str, float] | None
    styles: dict[str, dict[str, Any]]
    published_vs_measured: Section
    costmodel: Section
    answer: Section
    findings: list[str]
    excluded: Section
    paper: Section
    ring_reclaim: Section
    kv_capacity: Section


def load_report_data(
    study: str,
    tidy_dir: Path | str,
    published_dir: Path | str | None = None,
    replica_path: Path | str | None = None,
    *,
    n_boot: int = an.DEFAULT_N_BOOT,
    seed: int = an.DEFAULT_SEED,
) -> ReportData:
    """Loads and derives everything the report shows. ``replica_path`` '' or None: the default location."""
    tidy = load_tidy(tidy_dir)
    published = load_published(published_dir)
    replica = load_replica(replica_path or default_replica_path(tidy_dir))
    boot = {"n_boot": n_boot, "seed": seed}
    ov = overview(tidy)
    return ReportData(
        study=study,
        tidy=tidy,
        published=published,
        replica=replica,
        overview=ov,
        decode=decode_section(tidy, **boot),
        speedup=speedup_section(tidy, **boot),
        speedup_change=speedup_change_section(tidy, **boot),
        cycle=cycle_section(tidy),
        draft_tax=draft_tax_section(tidy, **boot),
        acceptance=acceptance_section(tidy),
        positions=positions_section(tidy),
        energy=energy_section(tidy, **boot),
        prefill=prefill_section(tidy, **boot),
        wedge=wedge_section(tidy, replica, paper_models(), **boot),
        paper_claim=paper_claim(published),
        styles=series_styles(add_labels(ov, tidy.rungs)),
        published_vs_measured=published_comparison(tidy, published, study, **boot),
        costmodel=costmodel_section(tidy),
        answer=answer_section(tidy),
        findings=answer_sentences(tidy),
        excluded=excluded_section(tidy),
        paper=paper_claim_section(replica, published),
        ring_reclaim=ring_reclaim_section(),
        kv_capacity=kv_capacity_section(tidy),
    )


# --------------------------------------------------------------------------------------------------
# Figures and rendering
# --------------------------------------------------------------------------------------------------


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


def save_figure(fig: Any, figures_dir: Path | str, name: str, *, dpi: int = 120) -> Path:
    """Saves a matplotlib figure as ``<name>.png`` and ``<name>.svg``; returns the PNG path."""
    figures_dir = Path(figures_dir)
    figures_dir.mkdir(parents=True, exist_ok=True)
    png = figures_dir / f"{name}.png"
    fig.savefig(png, dpi=dpi, bbox_inches="tight")
    fig.savefig(figures_dir / f"{name}.svg", bbox_inches="tight")
    return png


def img_tag(png_path: Path | str, alt: str) -> str:
    """An ``<img>`` with the PNG embedded as a data URI and its alternative text (for the notebook)."""
    import base64
    import html

    data = base64.b64encode(Path(png_path).read_bytes()).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{html.escape(alt, quote=True)}"/>'


_HTML_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""


@contextlib.contextmanager
def _venv_kernel() -> Iterator[None]:
    """Makes kernel 'python3' this interpreter, for this process only.

    A kernelspec named python3 pointing at ``sys.executable`` goes into a temporary directory that is
    put first on JUPYTER_PATH, so a user-level or system 'python3' kernel cannot win. Nothing is
    registered outside the temporary directory.
    """
    with tempfile.TemporaryDirectory(prefix="wmtp-kernel-") as tmp:
        spec_dir = Path(tmp) / "kernels" / "python3"
        spec_dir.mkdir(parents=True)
        spec = {
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (wmtp)",
            "language": "python",
            "env": {"MPLBACKEND": "Agg"},
        }
        (spec_dir / "kernel.json").write_text(json.dumps(spec))
        old = os.environ.get("JUPYTER_PATH")
        os.environ["JUPYTER_PATH"] = os.pathsep.join(p for p in (tmp, old) if p)
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("JUPYTER_PATH", None)
            else:
                os.environ["JUPYTER_PATH"] = old


def notebook_to_html(notebook_path: Path | str, html_path: Path | str) -> Path:
    """Converts an executed notebook into one self-contained HTML page without code cells.

    Images are embedded as data URIs; the CDN scripts (require.js, MathJax, Mermaid) are left out.
    """
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(str(notebook_path), as_version=4)
    with tempfile.TemporaryDirectory(prefix="wmtp-nbconvert-") as tmp:
        template = Path(tmp) / "wmtp_report.html.j2"
        template.write_text(_HTML_TEMPLATE)
        exporter = HTMLExporter(
            template_file=str(template),
            exclude_input=True,
            exclude_input_prompt=True,
            exclude_output_prompt=True,
            embed_images=True,
        )
        body, _ = exporter.from_notebook_node(nb)
    html_path = Path(html_path)
    html_path.write_text(body, encoding="utf-8")
    return html_path


def render_report(
    study: str,
    tidy_dir: Path | str,
    out_dir: Path | str,
    *,
    published_dir: Path | str | None = None,
    replica_path: Path | str | None = None,
    notebook: Path | str | None = None,
    timeout_s: int = 900,
) -> Path:
    """Runs the report notebook for one study with papermill and writes ``out_dir/index.html``.

    Figures land in ``out_dir/figures`` (PNG + SVG each), the executed notebook in
    ``out_dir/report.ipynb``. Returns the HTML path. The kernel is this interpreter (see
    :func:`_venv_kernel`), so the pipeline venv that runs this function also runs the notebook.
    """
    import papermill as pm

    out_dir = Path(out_dir).resolve()
    figures_dir = out_dir / "figures"
    figures_dir.mkdir(parents=True, exist_ok=True)
    tidy_dir = Path(tidy_dir).resolve()
    load_tidy(tidy_dir)  # fail here, with the path in the message, rather than inside the kernel
    parameters = {
        "study": study,
        "tidy_dir": str(tidy_dir),
        "published_dir": str(Path(published_dir).resolve() if published_dir else PUBLISHED_DIR),
        "figures_dir": str(figures_dir),
        "replica_path": str(Path(replica_path).resolve()) if replica_path else "",
    }
    executed = out_dir / "report.ipynb"
    with _venv_kernel():
        pm.execute_notebook(
            str(notebook or NOTEBOOK),
            str(executed),
            parameters=parameters,
            kernel_name="python3",
            cwd=str(out_dir),
            progress_bar=False,
            log_output=False,
            execution_timeout=timeout_s,
        )
    return notebook_to_html(executed, out_dir / "index.html")


def main_report(argv: Sequence[str] | None = None) -> int:
    """``python -m wmtp report --study S --tidy DIR --out DIR [--published DIR] [--replica FILE]``."""
    parser = argparse.ArgumentParser(prog="wmtp report", description="Render a study's report as one HTML page.")
    parser.add_argument("--study", required=True, help="study name (as in the study config)")
    parser.add_argument("--tidy", required=True, type=Path, help="results/<study>/tidy")
    parser.add_argument("--out", required=True, type=Path, help="output directory (index.html, figures/)")
    parser.add_argument("--published", type=Path, default=None, help=f"published CSVs (default {PUBLISHED_DIR})")
    parser.add_argument(
        "--replica",
        type=Path,
        default=None,
        help="replica.parquet (default results/replica/tidy/replica.parquet next to --tidy)",
    )
    parser.add_argument("--notebook", type=Path, default=None, help=f"report notebook (default {NOTEBOOK})")
    parser.add_argument("--timeout", type=int, default=900, help="per-cell timeout in seconds")
    args = parser.parse_args(list(argv) if argv is not None else None)
    html = render_report(
        args.study,
        args.tidy,
        args.out,
        published_dir=args.published,
        replica_path=args.replica,
        notebook=args.notebook,
        timeout_s=args.timeout,
    )
    log.info("report written to %s", html)
    return 0
