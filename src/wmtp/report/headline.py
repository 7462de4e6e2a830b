"""The report's opening answer: a few sentences on the cost-side ratio, each number with its interval."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from wmtp.config import PAPER_DRAFT_TOKENS, PAPER_SINK, PAPER_WINDOW
from wmtp.report.compare import PAPER_DRAFT_FORWARDS
from wmtp.report.engine_steps import TRITON_KERNELS, ceiling_ratio, cell_number, plugin_order
from wmtp.report.labels import fmt_interval

MAX_SENTENCES = 6
# What one clause of the answer is about: an engine (release and attention options), a model, a depth and a batch.
_GROUP = ["engine", "model", "k", "batch"]
# Where the plugin set the windowed draft's window (the step file's window_anchor), as a sentence says it.
_PLUGINS = {"cycle": "once a decode cycle", "forward": "for each draft forward"}


def _plugin_text(plugin: str) -> str:
    """'once a decode cycle', and ', by the plugin's Triton kernels' where they set it (engine_steps.TRITON_KERNELS)."""
    anchor, triton, _ = str(plugin).partition(TRITON_KERNELS)
    return _PLUGINS.get(anchor, anchor) + (", by the plugin's Triton kernels" if triton else "")


def _ratio(value: Any) -> str:
    return "" if value is None or not math.isfinite(float(value)) else f"{float(value):.2f}"


PAPER_MARK_COLUMNS = ["model", "rung", "ratio", "lo", "hi", "ceiling"]


def paper_marks(engine: pd.DataFrame | None, claim: dict[str, float] | None) -> pd.DataFrame:
    """The paper's marks on the headline figure, one row per model of ``engine`` (the real engine's section): its
    cost-side ratio at its own context as the middle of its range (``ratio``, ``lo``, ``hi``), and the ceiling
    1 + k/L_full at the paper's own depth (``ceiling``). Empty without an engine or a claim."""
    if engine is None or engine.empty or not claim:
        return pd.DataFrame(columns=PAPER_MARK_COLUMNS)
    lo, hi = 1 + claim["lo"], 1 + claim["hi"]
    return pd.DataFrame(
        [
            {
                "model": model,
                "rung": claim["rung"],
                "ratio": (lo + hi) / 2,
                "lo": lo,
                "hi": hi,
                "ceiling": ceiling_ratio(str(model), PAPER_DRAFT_FORWARDS),
            }
            for model in dict.fromkeys(engine["model"])
        ],
        columns=PAPER_MARK_COLUMNS,
    )


def _measured(row: pd.Series) -> str:
    """'1M: 1.141 [1.137, 1.143]'. Where the servers ran on several GPUs (which have differed by more than the
    arms), the ratio over the pairings of servers on one GPU leads (the section's ``lead``) and the range over every
    pairing follows; a range that passes the ceiling says so, since windowing cannot save more than that."""
    pooled = fmt_interval(row["engine mtp / wmtp"], row["ratio_lo"], row["ratio_hi"], null=1.0)
    gpus = cell_number(row, "gpus")
    text = f"{row['context']}: "
    if cell_number(row, "lead_on_one_gpu") == 1:
        single = " (one pairing)" if cell_number(row, "lead_pairs") == 1 else ""
        lead = fmt_interval(row["lead"], row["lead_lo"], row["lead_hi"], null=1.0)
        text += f"{lead} between servers on one GPU{single}, {pooled} over {int(gpus)} GPUs"
    elif gpus > 1:
        text += f"{pooled} over {int(gpus)} GPUs, no two of its servers on one GPU"
    else:
        text += pooled
    ceiling = cell_number(row, "ceiling 1 + k/L_full")
    if math.isfinite(ceiling) and cell_number(row, "ratio_hi") > ceiling:
        text += f" (its range passes the ceiling {ceiling:.2f}: servers, not the window)"
    return text


def _control_sentence(engine: pd.DataFrame) -> str:
    """Where the engine measured the window-off control: what the window alone saves against it, and native MTP
    against it (what loading the plugin costs by itself), each context with its range over servers."""
    if "window off / wmtp" not in engine.columns:
        return ""
    rows = engine[engine["window off / wmtp"].map(lambda v: math.isfinite(float(v)))].sort_values("tokens")
    if rows.empty:
        return ""
    # Where several engines, models or depths ran the control, each context names which.
    keys = [key for key in _GROUP if key in rows.columns and rows[key].nunique() > 1]

    def where(row: pd.Series) -> str:
        named = ", ".join(f"k {row[key]}" if key == "k" else str(row[key]) for key in keys)
        return f"{row['context']} ({named})" if named else str(row["context"])

    saved = "; ".join(
        f"{where(r)}: {fmt_interval(r['window off / wmtp'], r['off_lo'], r['off_hi'], null=1.0)}"
        for _, r in rows.iterrows()
    )
    cost = "; ".join(
        f"{where(r)}: {fmt_interval(r['mtp / window off'], r['mtp_off_lo'], r['mtp_off_hi'], null=1.0)}"
        for _, r in rows.iterrows()
    )
    servers = rows["control servers"].dropna() if "control servers" in rows.columns else pd.Series(dtype=float)
    counted = f"; {int(servers.max())} server{'s' if servers.max() > 1 else ''} of it" if len(servers) else ""
    return (
        f"Against the plugin's window-off control (loaded, its window covering the context{counted}), what the "
        f"window alone saves (the control's cycle over the windowed one) is {saved}; native MTP over that control "
        f"reads {cost}."
    )


def headline_sentences(engine: pd.DataFrame | None, claim: dict[str, float] | None) -> list[str]:
    """At most :data:`MAX_SENTENCES` sentences: what windowing can save at most, what the real engine
    measured per context (not resolved where its range holds 1), the replica and cost model beside it, and
    the paper's claim against the ceiling at the paper's own d."""
    out: list[str] = []
    if engine is not None and not engine.empty:
        first = engine.iloc[0]
        ceilings = "; ".join(
            f"{_ratio(r['ceiling 1 + k/L_full'])} for {r['model']} at k {int(r['k'])}"
            for _, r in engine.drop_duplicates(["model", "k"]).iterrows()
        )
        out.append(
            "Windowing removes only the draft's KV reads, so the cost-side ratio (native MTP's cycle over the "
            f"windowed draft's) cannot exceed 1 + k/L_full: {ceilings}."
        )
        several_models = engine["model"].nunique() > 1
        engines = []
        for (label, model, k, batch), by_shape in engine.groupby(_GROUP, sort=False):
            anchor = "wmtp window set per"
            plugins = by_shape.groupby(anchor, sort=False) if anchor in by_shape.columns else [(None, by_shape)]
            clauses = []
            for plugin, rows in sorted(plugins, key=lambda item: plugin_order(item[0])):
                measured = "; ".join(_measured(r) for _, r in rows.sort_values("tokens").iterrows())
                said = f"with the draft's window set {_plugin_text(plugin)}, {measured}" if plugin else measured
                clauses.append(said)
            shape = f"{label}{f' for {model}' if several_models else ''} at k {int(k)} and batch {int(batch)}, "
            engines.append(shape + "; and ".join(clauses))
        out.append(
            "Native MTP's cycle over the windowed draft's, timed by the engine's own clock, in "
            + "; in ".join(engines)
            + " (ranges over pairings of servers)."
        )
        beside = engine.dropna(subset=["replica"]).drop_duplicates("tokens").sort_values("tokens")
        if not beside.empty:
            out.append(
                "At the same shape the GPU replica gives "
                + ", ".join(f"{_ratio(r['replica'])} at {r['context']}" for _, r in beside.iterrows())
                + " and the cost model "
                + ", ".join(f"{_ratio(r['cost model'])}" for _, r in beside.iterrows())
                + "."
            )
        control = _control_sentence(engine)
        if control:
            out.append(control)
        if claim:
            ceiling = ceiling_ratio(str(first["model"]), PAPER_DRAFT_FORWARDS)
            lo, hi = 1 + claim["lo"], 1 + claim["hi"]
            verdict = "within" if hi <= ceiling else "above"
            out.append(
                f"The paper's {lo:.2f}–{hi:.2f} at 1M was taken at d {PAPER_DRAFT_TOKENS} ({PAPER_DRAFT_FORWARDS} "
                f"draft forwards), W {PAPER_WINDOW}, S {PAPER_SINK}, where the ceiling is {_ratio(ceiling)}: the "
                f"claim is {verdict} it."
            )
    else:
        out.append("No real engine's step file was given, so this report has no measured cost-side ratio.")
    out.append("The figure below sets these side by side; each further question has its own section.")
    return out[:MAX_SENTENCES]
