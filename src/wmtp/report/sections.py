"""The figure- and table-ready frames of the report (each ``*_section`` returns a :class:`Section`), and
:func:`load_report_data`, everything the notebook shows in one object.

The notebook only plots and formats; every number it shows comes from this package or from
:mod:`wmtp.analyze.analysis`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from wmtp.analyze import analysis as an
from wmtp.analyze import answer
from wmtp.analyze.lossless import lossless_summary, lossless_table
from wmtp.report.compare import (
    costmodel_section,
    paper_claim,
    paper_claim_section,
    paper_models,
    published_comparison,
    published_sources,
    replica_batch_section,
    replica_floor_section,
    ring_reclaim_section,
    wedge_section,
)
from wmtp.report.cycle_profile import cycle_profile_section, load_traces
from wmtp.report.engine_steps import (
    clock_check_section,
    cross_engine_section,
    engine_cycles,
    engine_step_section,
    growth_check_section,
    load_engine_steps,
    window_gain_split,
    windows_sentence,
)
from wmtp.report.headline import paper_marks
from wmtp.report.labels import (
    add_labels,
    arm_order,
    context_label,
    facet_value,
    fmt_ci,
    fmt_value,
    read_window_note,
    series_label,
    series_styles,
    with_read_window,
)
from wmtp.report.load import (
    Section,
    Tidy,
    default_replica_path,
    load_published,
    load_replica,
    load_replica_table,
    load_tidy,
)
from wmtp.report.paper_steps import paper_steps_section
from wmtp.report.window_cost import window_cost_section

NOTE_NO_POWER = "not measured: no NVML on this machine"
NOTE_RELATIVE_POWER = (
    "relative only: this machine reports board power but no calibrated energy (as on the Spark's GB10); "
    "compare arms with each other, not with other machines"
)
NOTE_NO_DRAFT = "no drafting arm in this study"
NOTE_NO_BASE = "no arm 'none' in this study: speedups need the no-draft baseline"
NOTE_ONE_RUNG = "only one context length in this study: nothing to compare across context"


# --------------------------------------------------------------------------------------------------
# Sections (figure/table-ready data)
# --------------------------------------------------------------------------------------------------


def overview(tidy: Tidy) -> pd.DataFrame:
    """One row per series: the cells of the study, their rungs and repeats."""
    r, req = tidy.rungs, tidy.requests
    keys = [c for c in an.SERIES_KEYS if c in r.columns]
    # Which measurement each row is: its cell's identity, as collect checked it against the study file.
    identity_of = (
        req.drop_duplicates("cell_id").set_index("cell_id")["identity_hash"].dropna()
        if {"cell_id", "identity_hash"} <= set(req.columns)
        else pd.Series(dtype=object)
    )
    rows = []
    for key, group in an.group_rows(r, keys):
        cells = group["cell_id"].unique() if "cell_id" in group.columns else []
        rows.append(
            {
                **key,
                "rungs": ", ".join(context_label(x) for x in sorted(group["rung"].unique())),
                "repeats": ", ".join(str(int(n)) for n in group.sort_values("rung")["n_repeats"]),
                "identity": ", ".join(sorted({str(identity_of[c]) for c in cells if c in identity_of.index})),
            }
        )
    out = pd.DataFrame(rows)
    for col in ("k", "sink", "window", "concurrency"):
        if col in out.columns:
            out[col] = pd.to_numeric(out[col], errors="coerce").astype("Int64")
    return arm_order(out)


def decode_section(tidy: Tidy, **boot: Any) -> Section:
    """Decode tok/s per series vs context (median over repeats, bootstrap CI)."""
    frame = an.decode_table(tidy.requests, **boot)
    if frame.empty:
        return Section(notes=("no measured requests with a decode rate",))
    return Section(arm_order(add_labels(frame, tidy.rungs)))


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
        return f"{answer.format_value(row['value'], quantity)} (n = {int(row['n'])})"
    return (
        f"{answer.format_value(row['value'], quantity)} [{answer.format_value(row['lo'], quantity)}, "
        f"{answer.format_value(row['hi'], quantity)}] n = {int(row['n'])}"
        + (f", {row['verdict']}" if row["verdict"] else "")
    )


def answer_section(tidy: Tidy, rows: pd.DataFrame | None = None) -> Section:
    """The page's opening table: per context and drafting series, each paired comparison in one cell.
    ``rows``: :func:`answer_rows`, where the caller has them already."""
    rows = answer_rows(tidy) if rows is None else rows
    if rows.empty:
        return Section(notes=(NOTE_NO_DRAFT if not tidy.has_drafting else NOTE_NO_BASE,))
    titles = {
        "speedup": "speedup over no draft",
        "cost_side_ratio": "cost-side ratio vs mtp",
        "acceptance": "acceptance",
        "acceptance_change": "acceptance vs mtp",
    }
    keys = ["model", "engine", "concurrency", "workload", "rung", "arm", "k", "sink", "window"]
    qualify = answer.varying_settings(rows)
    out = []
    for key, group in rows.groupby(keys, dropna=False, sort=True):
        record = dict(zip(keys, key, strict=True))
        read = read_window_note(with_read_window(pd.DataFrame([record]), tidy.rungs).iloc[0])
        line = {
            "workload": record["workload"],
            "context": context_label(record["rung"]),
            "series": f"{answer.series_label(record, qualify)} {read}".strip(),
        }
        for _, r in group.iterrows():
            line[titles[r["quantity"]]] = _interval_text(r, r["quantity"])
        out.append(line)
    frame = pd.DataFrame(out).fillna("—")
    return Section(frame[[c for c in ["workload", "context", "series", *titles.values()] if c in frame.columns]])


def answer_sentences(tidy: Tidy, rows: pd.DataFrame | None = None) -> list[str]:
    """The findings at each workload's longest context, in words: resolved ones first."""
    rows = answer_rows(tidy) if rows is None else rows
    if rows.empty:
        return []
    longest = rows[rows["rung"] == rows.groupby("workload")["rung"].transform("max")]
    order = {"speedup": 0, "cost_side_ratio": 1, "acceptance_change": 2, "acceptance": 3}
    longest = longest.assign(_o=longest["quantity"].map(order), _r=longest["verdict"] != answer.RESOLVED)
    qualify = answer.varying_settings(rows)
    return [answer.sentence(r, qualify) for _, r in longest.sort_values(["_r", "workload", "_o"]).iterrows()]


def lossless_section(tidy: Tidy) -> Section:
    """Per series, its recorded answers judged against the same prompts' without a draft: identical, equal up to
    near ties, diverged. Empty where the study recorded no tokens."""
    path = tidy.derived_dir / "lossless.parquet" if tidy.derived_dir is not None else None
    table = pd.read_parquet(path) if path is not None and path.exists() else lossless_table(tidy.requests)
    summary = lossless_summary(table)
    if summary.empty:
        return Section()
    diverged = table[~table["equal"].astype(bool)]
    notes = tuple(f"{r['cell_id']} ({r['workload']}, rung {r['rung']}): {r['reason']}" for _, r in diverged.iterrows())
    return Section(summary, notes)


def excluded_section(tidy: Tidy) -> Section:
    """Requests whose numbers are physically impossible: excluded from every figure and table, listed here."""
    if tidy.derived_dir is not None and (tidy.derived_dir / "excluded.parquet").exists():
        return Section(pd.read_parquet(tidy.derived_dir / "excluded.parquet"))
    r = tidy.requests
    if r.empty or "excluded" not in r.columns or not r["excluded"].any():
        return Section()
    cols = ["cell_id", "workload", "rung", "repeat", "slot", "completion_tokens", "decode_s", "exclusion"]
    return Section(r.loc[r["excluded"], [c for c in cols if c in r.columns]].reset_index(drop=True))


def speedup_section(tidy: Tidy, rows: pd.DataFrame | None = None, **boot: Any) -> Section:
    """Speedup over the none arm per drafting series vs context: paired geometric mean with its t interval."""
    if not tidy.has_drafting:
        return Section(notes=(NOTE_NO_DRAFT,))
    if an.BASE_ARM not in tidy.arms:
        return Section(notes=(NOTE_NO_BASE,))
    rows = answer_rows(tidy) if rows is None else rows
    if rows.empty:  # tidy tables written before requests were screened and paired
        frame = an.speedup_table(tidy.requests, **boot)
    else:
        frame = rows[rows["quantity"] == "speedup"].rename(columns={"value": "speedup"}).reset_index(drop=True)
    return (
        Section(arm_order(add_labels(frame, tidy.rungs)))
        if not frame.empty
        else Section(notes=("no drafting series shares a rung with the none arm",))
    )


NOTE_SPEEDUP_CHANGE_METHOD = (
    "computed as the published study computes it, so that the two compare: each speedup is the ratio of the two "
    "arms' median decode rates at that rung (the answer table's are paired geometric means over the same "
    "prompts, and may differ in the second or third digit), and the interval resamples each arm's requests on "
    "their own, ignoring that the arms decoded the same prompts: wider than a paired interval, never narrower "
    "than its level promises"
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
    return Section(arm_order(add_labels(frame, tidy.rungs)), (NOTE_SPEEDUP_CHANGE_METHOD,))


def cycle_section(tidy: Tidy) -> Section:
    """cycleMs per series vs context (from rungs.parquet: median decode tok/s and tokPerVerify)."""
    cols = [c for c in (*an.SERIES_KEYS, "rung", "cycle_ms", "decode_tok_s", "tok_per_verify") if c in tidy.rungs]
    frame = tidy.rungs[cols].copy()
    frame = frame[pd.to_numeric(frame["cycle_ms"], errors="coerce").notna()]
    if frame.empty:
        return Section(notes=("no cycle time could be computed (no decode rate or no tokPerVerify)",))
    return Section(arm_order(add_labels(frame, tidy.rungs)))


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
    return Section(arm_order(add_labels(frame, tidy.rungs)), tuple(notes))


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
                f"{fmt_value(a)} → {fmt_value(b)}" for a, b in zip(f["target_from_ms"], f["target_to_ms"], strict=True)
            ],
            "verify cycle (ms)": [
                f"{fmt_value(a)} → {fmt_value(b)}" for a, b in zip(f["cycle_from_ms"], f["cycle_to_ms"], strict=True)
            ],
            "target growth (ms)": [fmt_value(v) for v in f["target_growth_ms"]],
            "cycle growth (ms)": [fmt_value(v) for v in f["cycle_growth_ms"]],
            "draft growth (ms)": [fmt_value(v) for v in f["draft_growth_ms"]],
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
                fmt_ci(100 * p, 100 * lo, 100 * hi, null=0.0)
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
            "speedup from": [fmt_value(v, 4) for v in f["speedup_from"]],
            "speedup to": [fmt_value(v, 4) for v in f["speedup_to"]],
            "change [bootstrap interval, unpaired]": [
                fmt_ci(p, lo, hi, null=0.0) for p, lo, hi in zip(f["change"], f["lo"], f["hi"], strict=True)
            ],
            "± se": [fmt_value(v) for v in f["se"]],
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
    return Section(arm_order(add_labels(frame, tidy.rungs)), (pooled_acceptance_note(tidy.requests),))


def pooled_acceptance_note(requests: pd.DataFrame) -> str:
    """What the acceptance table's values are: one pooled count per rung, over how many requests."""
    keys = [k for k in ("cell_id", "workload", "rung") if k in requests.columns]
    counts = requests.groupby(keys).size() if len(keys) == 3 and not requests.empty else pd.Series(dtype=int)
    n = (
        ""
        if counts.empty
        else f"{counts.min()} "
        if counts.min() == counts.max()
        else f"{counts.min()}–{counts.max()} "
    )
    return (
        f"each value pools the engine's spec-decode counters over a rung's {n}requests (accepted / drafted "
        "tokens; tokens per verify in brackets): one count per rung, with no interval. Intervals over requests "
        "are in the answer above and, on the copy task, under 'What the window costs'."
    )


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
        key = (facet_value("workload", r["workload"]) if by_workload else "", label)
        rows.setdefault(key, {})[context_label(r["rung"])] = (
            f"{fmt_value(100 * r['acceptance_rate'], 3)} % ({fmt_value(r['tok_per_verify'], 3)})"
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
    return Section(arm_order(add_labels(frame, tidy.rungs)))


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
    return Section(arm_order(add_labels(frame, tidy.rungs)), notes)


def prefill_section(tidy: Tidy, **boot: Any) -> Section:
    """TTFT and prefill tok/s per series vs context, with CI."""
    frame = an.prefill_table(tidy.requests, **boot)
    if frame.empty:
        return Section(notes=("no measured requests with a first-token time",))
    return Section(arm_order(add_labels(frame, tidy.rungs)))


def kv_capacity_section(tidy: Tidy) -> Section:
    """The engine's own KV capacity per cell (tokens, and requests of max_model_len it admits at once)."""
    r = tidy.requests
    if r.empty or "kv_cache_tokens" not in r.columns or r["kv_cache_tokens"].isna().all():
        return Section()
    cols = ["arm", "k", "sink", "window", "kv_cache_tokens", "max_concurrency"]
    frame = r[[c for c in ["cell_id", *cols] if c in r.columns]].drop_duplicates("cell_id").drop(columns="cell_id")
    return Section(arm_order(frame.reset_index(drop=True)))


def admission_section(tidy: Tidy) -> Section:
    """The ring's admission proofs: each arm's KV budget, what the engine counted, and what ran at once; one note
    per proof with its verdict."""
    a = tidy.admission
    if a.empty:
        return Section(notes=("no admission proof: the study has no wmtp-ring cell on a vLLM CPU engine",))
    rows, notes = [], []
    for (model, engine), proof in a.groupby(["model", "engine"], sort=True):
        first = proof.iloc[0]
        measured = proof[proof["arm"].notna()]
        for r in measured.to_dict("records"):
            rows.append(
                {
                    "model": model,
                    "engine": engine,
                    "arm": f"{r['arm']} S={r['sink']} W={r['window']}",
                    "KV memory (MiB)": round(r["kv_cache_memory_bytes"] / 2**20, 2),
                    "KV blocks": r["num_blocks"],
                    f"max concurrency at {r['max_model_len']:,} (engine)": round(r["max_concurrency"], 2),
                    "requests sent at once": r["requests"],
                    "most running at once": r["max_running"],
                    "preemptions": r["preemptions"],
                    "steps with one waiting": r["steps_with_waiting"],
                    "pages per request by KV group (engine)": r.get("pages_by_group") or "",
                }
            )
        if measured.empty:
            notes.append(f"{model} on {engine}: {first['verdict']}")
            continue
        notes.append(
            f"{model} on {engine}: {first['verdict']}. {int(first['requests'])} requests of "
            f"{int(first['prompt_tokens']):,} prompt tokens arrive at once in the same KV memory; what decides is "
            "the most running at once and the preemptions, as the engine counted them after every step (a request "
            "also waits while another's long prefill fills a step). One run (n = 1), no interval. "
            + (
                f"Output: {first['output_check']}."
                if isinstance(first.get("output_check"), str)
                else f"Output identical between the arms: {bool(first['same_output'])}."
            )
        )
    return Section(pd.DataFrame(rows), tuple(notes))


def reclaim_measured_section(tidy: Tidy) -> Section:
    """The share of a request's KV the ring gives back, measured by the engine vs the cost model's bytes.

    Measured twice: in the admission proof (bytes per request from the engine's own concurrency at its length)
    and in this study's cells, where the CPU build gives every cell the same KV memory, so the share is
    1 − wmtp's max concurrency / the ring's at max_model_len (on a GPU the memory left for KV differs per cell).
    """
    rows = []
    a = tidy.admission
    for (model, engine), group in a.groupby(["model", "engine"]) if not a.empty else []:
        by_arm = group[group["arm"].notna()].set_index("arm")
        if not {"wmtp", "wmtp-ring"} <= set(by_arm.index):
            continue
        measured = 1 - by_arm.loc["wmtp-ring", "bytes_per_request"] / by_arm.loc["wmtp", "bytes_per_request"]
        rows.append(
            {
                "model": model,
                "engine": engine,
                "where": f"admission proof, {int(by_arm.loc['wmtp', 'max_model_len']):,} tokens",
                "reclaimed, engine (%)": round(100 * measured, 1),
                "reclaimed, cost model (%)": round(100 * by_arm.loc["wmtp", "predicted_reclaimed_fraction"], 1),
            }
        )
    r = tidy.requests
    if not r.empty and "max_concurrency" in r.columns:
        cells = r.drop_duplicates("cell_id")
        for (model, engine), group in cells.groupby(["model", "engine"]):
            plain, ring = group[group["arm"] == "wmtp"], group[group["arm"] == "wmtp-ring"]
            for _, ring_cell in ring.drop_duplicates(["sink", "window"]).iterrows():
                same = plain[(plain["sink"] == ring_cell["sink"]) & (plain["window"] == ring_cell["window"])]
                if same.empty or pd.isna(ring_cell["max_concurrency"]) or pd.isna(same["max_concurrency"].iloc[0]):
                    continue
                share = 1 - float(same["max_concurrency"].iloc[0]) / float(ring_cell["max_concurrency"])
                rows.append(
                    {
                        "model": model,
                        "engine": engine,
                        "where": f"cells S={int(ring_cell['sink'])} W={int(ring_cell['window'])}, max_model_len",
                        "reclaimed, engine (%)": round(100 * share, 1),
                        "reclaimed, cost model (%)": (
                            round(100 * float(ring_cell["predicted_ring_reclaim"]), 1)
                            if pd.notna(ring_cell.get("predicted_ring_reclaim", math.nan))
                            else "—"
                        ),
                    }
                )
    if not rows:
        return Section()
    notes = (
        "The cost model counts bytes: the draft layer's KV beyond S + W, against the target's attention KV and "
        "the recurrent states. The engine counts whole pages per KV cache group (the admission table lists them): "
        "on a hybrid model it pads each recurrent state to an attention page, groups layers in equal numbers "
        "(padding a group when they do not divide) and holds a prefill chunk's blocks in the ring's bound; the "
        "engine's share is the one that decides admission.",
        "Each engine figure is one count (n = 1 per row, no interval): the engine's own block accounting at start-up; "
        "the cost model's is a formula.",
    )
    return Section(pd.DataFrame(rows), notes)


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
    #: The study's contexts, smallest first: every figure's context axis.
    rungs: list[int]
    #: The paired comparisons (:func:`answer_rows`) behind the answer, the speedup and the acceptance sentence.
    answer_rows: pd.DataFrame
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
    #: The paper's point and the ceiling at its own depth, per model of the headline figure.
    paper_marks: pd.DataFrame
    styles: dict[str, dict[str, Any]]
    published_vs_measured: Section
    #: The verbatim sources of the study's published numbers.
    published_sources: pd.DataFrame
    costmodel: Section
    answer: Section
    findings: list[str]
    excluded: Section
    #: Each series' recorded answers against the same prompts' without a draft (where tokens were recorded).
    lossless: Section
    paper: Section
    ring_reclaim: Section
    kv_capacity: Section
    admission: Section
    reclaim_measured: Section
    window_cost: Section
    replica_floor: Section
    replica_batch: Section
    engine_steps: Section
    #: Each arm's cycle on the real engine by both clocks, the clocks' check and the growth check.
    engine_cycles: pd.DataFrame
    engine_clock: Section
    engine_growth: Section
    #: Which sink and window the replica and the real engine ran.
    engine_windows: str
    #: The artifact's published steps beside their byte floors and the real engine's steps at the same shape.
    paper_steps: Section
    #: Where a real engine's traced cycle goes: each component's device time beside its byte floor, per arm.
    cycle_profile: Section
    #: The window's saving in the engine as it ships and tuned, beside what its bytes allow.
    engine_gain_split: Section
    #: The same shape in each engine that measured it: none, mtp, wmtp and mtp / wmtp side by side.
    cross_engine: Section


def load_report_data(
    study: str,
    tidy_dir: Path | str,
    published_dir: Path | str | None = None,
    replica_path: Path | str | None = None,
    engine_step_paths: Sequence[Path | str] = (),
    trace_paths: Sequence[Path | str] = (),
    *,
    n_boot: int = an.DEFAULT_N_BOOT,
    seed: int = an.DEFAULT_SEED,
) -> ReportData:
    """Loads and derives everything the report shows. ``replica_path`` '' or None: the default location;
    ``engine_step_paths``: a real engine's step files (``measurements/<device>/vllm_<model>.csv``)."""
    tidy = load_tidy(tidy_dir)
    published = load_published(published_dir)
    replica_file = replica_path or default_replica_path(tidy_dir)
    replica = load_replica(replica_file)
    replica_table = load_replica_table(replica_file)  # every arm and batch, for the floor and the paper's claim
    boot = {"n_boot": n_boot, "seed": seed}
    ov = overview(tidy)
    rows = answer_rows(tidy)
    steps = load_engine_steps(engine_step_paths)
    engine = engine_step_section(steps, replica_table)
    claim = paper_claim(published)
    return ReportData(
        study=study,
        tidy=tidy,
        published=published,
        replica=replica,
        overview=ov,
        rungs=an.rungs_of(tidy.rungs),
        answer_rows=rows,
        decode=decode_section(tidy, **boot),
        speedup=speedup_section(tidy, rows, **boot),
        speedup_change=speedup_change_section(tidy, **boot),
        cycle=cycle_section(tidy),
        draft_tax=draft_tax_section(tidy, **boot),
        acceptance=acceptance_section(tidy),
        positions=positions_section(tidy),
        energy=energy_section(tidy, **boot),
        prefill=prefill_section(tidy, **boot),
        wedge=wedge_section(tidy, replica, paper_models(), **boot),
        paper_claim=claim,
        paper_marks=paper_marks(engine.frame if engine.available else None, claim),
        styles=series_styles(add_labels(ov, tidy.rungs)),
        published_vs_measured=published_comparison(tidy, published, study, **boot),
        published_sources=published_sources(published, study),
        costmodel=costmodel_section(tidy),
        answer=answer_section(tidy, rows),
        findings=answer_sentences(tidy, rows),
        excluded=excluded_section(tidy),
        lossless=lossless_section(tidy),
        paper=paper_claim_section(replica_table, published),
        ring_reclaim=ring_reclaim_section(),
        kv_capacity=kv_capacity_section(tidy),
        admission=admission_section(tidy),
        reclaim_measured=reclaim_measured_section(tidy),
        window_cost=window_cost_section(tidy.requests),
        replica_floor=replica_floor_section(replica_table),
        replica_batch=replica_batch_section(replica_table),
        engine_steps=engine,
        engine_cycles=engine_cycles(steps),
        engine_clock=clock_check_section(steps),
        engine_growth=growth_check_section(steps),
        engine_windows=windows_sentence(steps, replica_table),
        paper_steps=paper_steps_section(published, steps),
        cycle_profile=cycle_profile_section(load_traces(trace_paths)),
        engine_gain_split=window_gain_split(steps),
        cross_engine=cross_engine_section(steps),
    )
