"""What a window costs: acceptance on the copy workload against how far back the copied passage sits,
relative to the draft's window W.

A copy-task prompt ends by starting to repeat a passage that begins ``distance`` tokens before the end of
the prompt (wmtp.measure.workload.CopyTask.distance). A windowed draft sees the sink and the last W
tokens, so once ``distance / W`` passes 1 it can no longer read the passage, and its acceptance should
fall towards what a draft without the passage guesses. The full draft (arm ``mtp``, no window) is the
reference at every distance: its ``distance / W`` is 0.

Each point is the mean of per-request acceptances with a Student-t interval, plus the paired difference
to the full draft on the same prompts (same model, engine, concurrency, draft depth k, rung and prompt),
also with a t interval.

All of it presumes that the model copies: a target that leaves the passage at once makes every draft guess,
windowed or not, and the curve reads flat. So each point also carries how many tokens of the passage the
output reproduced (``copied``, recorded by the cell), and the section says where that is too few to tell.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from wmtp.analyze.analysis import WINDOWED_ARMS
from wmtp.analyze.intervals import Interval, mean_interval, paired_difference_interval
from wmtp.config import COPY_LEAD_TOKENS
from wmtp.report.labels import SERIES_LINESTYLES, arm_style, series_label
from wmtp.report.load import Section

COPY_WORKLOAD = "copy"
FULL_DRAFT_ARM = "mtp"
# Fewer tokens of the passage than this reproduced on average, and the copy task does not test a window there.
MIN_COPIED_TOKENS = 8

NOTE_APPROXIMATE = (
    "the intervals are Student t over the prompts; per-request acceptance is bounded and often the same for both "
    "drafts, and on such data a nominal 95 % t interval covers about 79 % at 3 prompts and 88 % at 5 (simulated, "
    "tests/test_intervals.py): read them as approximate. A point with one prompt, or the same value on every "
    "prompt, has no interval; 'pairs' counts the prompts its difference to the full draft rests on"
)

#: What else tells the rows of a study apart; each present in the requests leads the output, and a windowed
#: draft is compared only with the full draft of the same model, engine, concurrency and draft depth k.
SETTING_KEYS: tuple[str, ...] = ("model", "engine", "concurrency", "k")

#: One row per (setting, arm, sink, window, rung): where the passage sat, how far that is in windows, and
#: acceptance; the columns of :data:`SETTING_KEYS` that the requests carry come first.
COLUMNS: tuple[str, ...] = (
    "arm",
    "sink",
    "window",
    "rung",
    "distance",
    "distance_over_window",
    "covered",
    "n",
    "acceptance",
    "lo",
    "hi",
    "vs_full",
    "vs_full_lo",
    "vs_full_hi",
    "vs_full_n",
    "copied",
    "copied_lo",
    "copied_hi",
)


def passage_distance(frame: pd.DataFrame, lead_tokens: int | None = None) -> pd.Series:
    """Tokens from the end of each prompt back to the start of its passage.

    A row's own ``distance`` where it has one (cells record it per copy-task request, scripts/acceptance_cpu.py
    writes it too), else ``rung - lead_tokens``: the passage follows a lead-in of about ``lead_tokens`` tokens
    (cells recorded before the distance was).
    """
    recorded = (
        pd.to_numeric(frame["distance"], errors="coerce").astype(float)
        if "distance" in frame.columns
        else pd.Series(math.nan, index=frame.index)
    )
    if recorded.notna().all():
        return recorded
    if lead_tokens is None:
        raise ValueError("some rows have no 'distance': pass lead_tokens (the copy prompt's lead-in)")
    return recorded.fillna(pd.to_numeric(frame["rung"]).astype(float) - float(lead_tokens))


def request_acceptance(frame: pd.DataFrame) -> pd.Series:
    """Per-request acceptance: the tidy table's ``req_acceptance``, else accepted / draft tokens."""
    if "req_acceptance" in frame.columns:
        return pd.to_numeric(frame["req_acceptance"], errors="coerce").astype(float)
    tokens = pd.to_numeric(frame["draft_tokens"]).astype(float)
    return (pd.to_numeric(frame["accepted"]).astype(float) / tokens.where(tokens > 0)).astype(float)


def _prompt_keys(frame: pd.DataFrame) -> list[str]:
    """The columns that name one prompt within a rung: its index (and the slot, with several at once)."""
    for column in ("index", "repeat"):
        if column in frame.columns:
            return [column, *(["slot"] if "slot" in frame.columns else [])]
    raise ValueError("the frame names no prompt ('index' or 'repeat'): acceptance cannot be paired")


def setting_keys(frame: pd.DataFrame) -> list[str]:
    """The :data:`SETTING_KEYS` that ``frame`` carries."""
    return [column for column in SETTING_KEYS if column in frame.columns]


def _copied(group: pd.DataFrame, level: float) -> Interval:
    """Mean tokens of the passage the outputs reproduced, with a t interval; NaN where the cells did not record it."""
    if "copied_tokens" not in group.columns:
        return Interval(math.nan, math.nan, math.nan, 0)
    return mean_interval(pd.to_numeric(group["copied_tokens"], errors="coerce").dropna().to_numpy(float), level)


def copying_notes(frame: pd.DataFrame, min_copied: float = MIN_COPIED_TOKENS) -> tuple[str, ...]:
    """Where the copy task cannot show a window's cost: the full draft's outputs copied too little, or the
    cells did not record how much they copied. ``frame`` is :func:`window_cost`'s."""
    full = frame[frame["arm"] == FULL_DRAFT_ARM]
    if full.empty:
        return ()
    if full["copied"].isna().all():
        return (
            "these cells did not record how much of the passage the model reproduced: whether it copies at all, "
            "and so whether this curve can show a window's cost, is not known",
        )
    notes = []
    several = full["rung"].duplicated().any()
    for _, row in full.iterrows():
        copied = row["copied"]
        if np.isfinite(copied) and copied < min_copied:
            which = f" ({draft_label(row, full)})" if several else ""
            notes.append(
                f"at {int(row['rung']):,} tokens{which} the model reproduced {copied:.1f} tokens of the passage on "
                "average: it hardly copies there, so every draft guesses and the copy task cannot show what a "
                "window costs"
            )
    return tuple(notes)


def window_cost(frame: pd.DataFrame, lead_tokens: int | None = None, level: float = 0.95) -> pd.DataFrame:
    """The window's cost curve on the copy workload (see the module's docstring); :data:`COLUMNS`.

    ``frame`` holds one row per request: ``arm``, ``sink``, ``window``, ``workload``, ``rung``, a prompt
    index (``index`` or ``repeat``), and either ``req_acceptance`` or ``accepted`` and ``draft_tokens``;
    requests flagged ``excluded`` are left out. Rows are sorted by arm, window and distance.
    """
    f = frame[frame["workload"] == COPY_WORKLOAD]
    if "excluded" in f.columns:
        f = f[~f["excluded"].astype(bool)]
    f = f[f["arm"] != "none"].copy()
    if f.empty:
        return pd.DataFrame(columns=list(COLUMNS))
    settings = setting_keys(f)
    pair_keys = [*settings, "rung", *_prompt_keys(f)]
    f["_acceptance"] = request_acceptance(f)
    f["_distance"] = passage_distance(f, lead_tokens)
    full = f[f["arm"] == FULL_DRAFT_ARM].set_index(pair_keys)["_acceptance"]
    if full.index.has_duplicates:
        raise ValueError(
            f"two full-draft requests share one prompt ({', '.join(pair_keys)}): something else varies between "
            "them, so a windowed draft's paired difference would be ambiguous"
        )
    rows = []
    groups = f.fillna({"sink": -1, "window": -1}).groupby([*settings, "arm", "sink", "window", "rung"], sort=True)
    for group_key, g in groups:
        setting = dict(zip(settings, group_key[: len(settings)], strict=True))
        arm, sink, window, rung = group_key[len(settings) :]
        acc = mean_interval(g["_acceptance"].to_numpy(), level)
        own = [tuple(row) for row in g[pair_keys].itertuples(index=False)]
        pairs = [(a, full.get(k, math.nan)) for a, k in zip(g["_acceptance"], own, strict=True)]
        paired = [(a, b) for a, b in pairs if np.isfinite(a) and np.isfinite(b)]
        diff = (
            paired_difference_interval([a for a, _ in paired], [b for _, b in paired], level)
            if paired and arm != FULL_DRAFT_ARM
            else Interval(math.nan, math.nan, math.nan, 0)
        )
        copied = _copied(g, level)
        distance = float(g["_distance"].mean())
        has_window = window is not None and float(window) > 0
        rows.append(
            {
                **setting,
                "arm": arm,
                "sink": None if sink == -1 else sink,
                "window": None if window == -1 else window,
                "rung": rung,
                "distance": distance,
                "distance_over_window": distance / float(window) if has_window else 0.0,
                "covered": bool(not has_window or distance <= float(window)),
                "n": acc.n,
                "acceptance": acc.value,
                # A rate lies in [0, 1] and a difference of rates in [-1, 1]: t intervals at n = 2-5 overshoot.
                "lo": max(acc.lo, 0.0),
                "hi": min(acc.hi, 1.0),
                "vs_full": diff.value,
                "vs_full_lo": max(diff.lo, -1.0),
                "vs_full_hi": min(diff.hi, 1.0),
                # The prompts both drafts kept: the difference rests on these, which may be fewer than n.
                "vs_full_n": diff.n if arm != FULL_DRAFT_ARM else None,
                # Tokens lie in [0, output length]: the t interval is clipped at 0 only (the length is not here).
                "copied": copied.value,
                "copied_lo": max(copied.lo, 0.0),
                "copied_hi": copied.hi,
            }
        )
    out = pd.DataFrame(rows, columns=[*settings, *COLUMNS])
    out["_order"] = out["window"].fillna(math.inf)
    order = [*settings, "arm", "_order", "distance"]
    return out.sort_values(order, kind="stable").drop(columns="_order").reset_index(drop=True)


def window_cost_section(requests: pd.DataFrame, lead_tokens: int | None = COPY_LEAD_TOKENS) -> Section:
    """:func:`window_cost` of a study's tidy requests as a report section, with a note where it cannot be drawn."""
    if requests.empty or "workload" not in requests.columns or not (requests["workload"] == COPY_WORKLOAD).any():
        return Section(notes=("no copy-task prompts in this study: no distance to the copied passage to show",))
    if not requests["arm"].isin(WINDOWED_ARMS).any():
        return Section(notes=("no windowed draft in this study: nothing for a window to cost",))
    if "req_acceptance" not in requests.columns and not {"accepted", "draft_tokens"} <= set(requests.columns):
        return Section(notes=("these cells recorded no per-request acceptance (counters only per rung)",))
    frame = window_cost(requests, lead_tokens)
    if frame["acceptance"].isna().all():
        return Section(notes=("the spec-decode counters did not move on the copy task: no acceptance to show",))
    return Section(frame, (*copying_notes(frame), NOTE_APPROXIMATE))


def window_cost_display(section: Section) -> pd.DataFrame:
    """The section as a table: one row per arm, window and rung, acceptance and its change vs the full draft."""
    if not section.available:
        return pd.DataFrame()
    f = section.frame

    def pct(value: float) -> str:
        return "" if not np.isfinite(value) else f"{100 * value:.1f}"

    def with_interval(value: float, lo: float, hi: float, show=pct) -> str:
        """'value [lo, hi]'; the value alone where there is no interval (one prompt, or no spread)."""
        if not np.isfinite(value):
            return ""
        return f"{show(value)} [{show(lo)}, {show(hi)}]" if np.isfinite(lo) else show(value)

    def tokens(value: float) -> str:
        return f"{value:.1f}"

    return pd.DataFrame(
        {
            "draft": [draft_label(row, f) for _, row in f.iterrows()],
            "context": f["rung"].astype(int),
            "passage back (tokens)": f["distance"].round().astype(int),
            "back / W": [f"{x:.2g}" if x else "" for x in f["distance_over_window"]],
            "acceptance % [95 % t]": [
                with_interval(v, lo, hi) for v, lo, hi in zip(f["acceptance"], f["lo"], f["hi"], strict=True)
            ],
            "vs full draft, points [95 % t]": [
                with_interval(v, lo, hi)
                for v, lo, hi in zip(f["vs_full"], f["vs_full_lo"], f["vs_full_hi"], strict=True)
            ],
            "passage copied, tokens [95 % t]": [
                with_interval(c, lo, hi, tokens)
                for c, lo, hi in zip(f["copied"], f["copied_lo"], f["copied_hi"], strict=True)
            ],
            "n": f["n"],
            "pairs": f["vs_full_n"].astype("Int64"),
        }
    )


def draft_label(row: pd.Series, frame: pd.DataFrame) -> str:
    """'wmtp k=3 S=16 W=256', plus the model, engine and concurrency where ``frame`` holds more than one."""
    varies = {c: c in frame.columns and frame[c].nunique() > 1 for c in ("model", "engine", "concurrency")}
    return series_label(
        row, with_model=varies["model"], with_engine=varies["engine"], with_concurrency=varies["concurrency"]
    )


def window_cost_figure(section: Section):
    """Acceptance (with its interval) against distance / W, one line per windowed draft in its arm's colour and
    marker; the full draft's acceptance at each distance as open marks of its own arm's style at W's reach
    (distance / W = 1 is the window's edge)."""
    import matplotlib.pyplot as plt

    f = section.frame
    fig, ax = plt.subplots(figsize=(7, 4))
    settings = setting_keys(f)
    windowed = f[f["window"].notna()]
    full_style = arm_style(FULL_DRAFT_ARM)
    for i, (key, g) in enumerate(windowed.groupby([*settings, "arm", "sink", "window"], sort=True)):
        g = g.sort_values("distance_over_window")
        x, y = g["distance_over_window"], 100 * g["acceptance"]
        err = [y - 100 * g["lo"], 100 * g["hi"] - y]
        # Drafts that accept the same (the ring and wmtp at one S and W do, by design; two windows of one arm
        # may too) would hide one another: each later series is drawn thinner, with a smaller marker and another
        # line style, so the one beneath shows. Colour and marker stay the arm's.
        style = arm_style(g["arm"].iloc[0])
        ax.errorbar(
            x,
            y,
            yerr=err,
            color=style["color"],
            marker=style["marker"],
            linestyle=SERIES_LINESTYLES[i % len(SERIES_LINESTYLES)],
            markersize=max(3.0, 9.0 - 2.0 * i),
            linewidth=max(0.8, 2.4 - 0.6 * i),
            capsize=3,
            label=draft_label(g.iloc[0], f),
        )
        same = f["arm"] == FULL_DRAFT_ARM
        for column, value in zip(settings, key[: len(settings)], strict=True):
            same &= f[column] == value
        full = f[same].set_index("rung")["acceptance"]
        ax.plot(
            x,
            [100 * full.get(r, np.nan) for r in g["rung"]],
            linestyle="none",
            marker=full_style["marker"],
            color=full_style["color"],
            markerfacecolor="none",
            markersize=8,
            label=f"_{FULL_DRAFT_ARM} at the same prompts",
            gid=f"arm:{FULL_DRAFT_ARM}",  # unlabelled, yet its arm's: a style check finds it by this
        )
    ax.axvline(1.0, color="black", linewidth=0.8, linestyle=":")
    ax.set_xscale("log")
    ax.set_ylim(-4, 104)
    ax.set_xlabel("distance back to the copied passage / W (tokens / tokens)")
    ax.set_ylabel("accepted / drafted tokens (%)")
    ax.set_title("What the window costs on the copy task (open: the full draft at the same prompts)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
