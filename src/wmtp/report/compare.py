"""Measured numbers next to published ones, the cost model and the GPU replica: the paper's claim and
wedge, the ring's reclaimed KV, the measured-vs-published table and the cost-model table."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from wmtp.analyze import analysis as an
from wmtp.config import PAPER_DRAFT_TOKENS, PAPER_SINK, PAPER_WINDOW
from wmtp.layout import REPO_ROOT
from wmtp.report.labels import (
    add_labels,
    arm_order,
    context_label,
    facet_value,
    fmt_ci,
    fmt_value,
    int_or_none,
    series_label,
)
from wmtp.report.load import Section, Tidy

PAPER_STUDY = "windowed-mtp-paper"
NOTE_NO_WINDOWED = "no windowed arm in this study"
NOTE_NO_REPLICA = "no GPU replica data (results/replica/tidy/replica.parquet not found)"
NOTE_COSTMODEL_MISSING = "cost model: not yet available (wmtp.analyze.costmodel.predict cannot be imported)"


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
PAPER_DRAFT_FORWARDS = PAPER_DRAFT_TOKENS - 1


def _against_ceiling(lo: float, hi: float, ceiling: float) -> str:
    if not math.isfinite(ceiling):
        return "—"
    if lo > ceiling:
        return "above the ceiling"
    return "upper end above the ceiling" if hi > ceiling else "within the ceiling"


PAPER_RECLAIM_PCT = (7.7, 11.1)


RING_CONTEXTS = (1 << 17, 1 << 18, 1 << 19, 1 << 20)


def ring_reclaim_section(
    models_dir: Path | str | None = None, contexts: tuple[int, ...] = RING_CONTEXTS, k: int = PAPER_K
) -> Section:
    """What a ring buffer for the draft's KV gives back at 128K–1M, predicted per model in config/models: close to
    the draft layer's share of all attention KV, 1/(L_full + 1), next to the paper's 7.7–11.1 % at 1M."""
    from wmtp.analyze.costmodel import predict

    directory = Path(models_dir) if models_dir else MODELS_DIR
    rows = []
    for path in sorted(directory.glob("*.json")):
        for context in contexts:
            p = predict(path, context, k, sink=PAPER_SINK, window=PAPER_WINDOW)
            rows.append(
                {
                    "model": p.model,
                    "context": context_label(context),
                    "draft KV share (%)": round(100 * p.draft_kv_share, 1),
                    "KV reclaimed by the ring (%)": round(100 * p.ring_reclaimed_fraction, 1),
                    "paper (%)": f"{PAPER_RECLAIM_PCT[0]}–{PAPER_RECLAIM_PCT[1]}" if context == 1 << 20 else "",
                }
            )
    return Section(pd.DataFrame(rows))


def single_request(replica: pd.DataFrame) -> pd.DataFrame:
    """The replica's rows at one request per step (tables from before the batch sweep have only those)."""
    if "batch" not in replica.columns:
        return replica
    return replica[pd.to_numeric(replica["batch"], errors="coerce").fillna(1) == 1]


def replica_batch_section(replica: pd.DataFrame | None, ks: tuple[int, ...] = (1, 3, 5)) -> Section:
    """The cost-side ratio against concurrency at each model's longest context: the replica's, the floor's,
    and the ceiling 1 + k/L_full it climbs towards as the KV's share of the step grows.

    ``replica`` is the tidy replica table (one row per arm, with ``batch``)."""
    need = {"batch", "arm", "measured_ratio", "predicted_ratio"}
    if replica is None or replica.empty or not need <= set(replica.columns):
        return Section()
    from wmtp.analyze.costmodel import limit_ratio

    nat = replica[(replica["arm"] == "mtp") & replica["k"].isin(ks)]
    rows = []
    for model, group in nat.groupby("model", sort=True):
        longest = group[group["context"] == group["context"].max()]
        path = model_file(canonical_model(model)) or model_file(canonical_model(model).split("-", 1)[-1])
        for r in longest.sort_values(["k", "batch"]).itertuples(index=False):
            rows.append(
                {
                    "model": model,
                    "context": context_label(r.context),
                    "k": int(r.k),
                    "batch": int(r.batch),
                    "replica (H200)": round(float(r.measured_ratio), 3),
                    "floor": round(float(r.predicted_ratio), 3),
                    "replica / floor": round(float(r.measured_ratio) / float(r.predicted_ratio), 3),
                    "ceiling 1 + k/L_full": round(limit_ratio(path, int(r.k)), 3) if path else math.nan,
                }
            )
    return Section(pd.DataFrame(rows))


def replica_floor_section(replica: pd.DataFrame | None, batch: int = 1) -> Section:
    """Each arm's whole step against its bytes/bandwidth floor, per model and context, at ``batch`` requests."""
    need = {"batch", "arm", "measured_ms", "predicted_ms"}
    if replica is None or replica.empty or not need <= set(replica.columns):
        return Section()
    at = replica[replica["batch"] == batch]
    rows = [
        {
            "model": r.model,
            "context": context_label(r.context),
            "arm": r.arm,
            "k": int(r.k),
            "step (ms)": round(float(r.measured_ms), 3),
            "floor (ms)": round(float(r.predicted_ms), 3),
            "step / floor": round(float(r.measured_ms) / float(r.predicted_ms), 3),
        }
        for r in at.sort_values(["model", "context", "k", "arm"]).itertuples(index=False)
    ]
    return Section(pd.DataFrame(rows))


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
    at_k = single_request(replica)
    at_k = at_k[at_k["k"] == k]
    for model, group in at_k.groupby("model", sort=True):
        longest = group[group["context"] == group["context"].max()].iloc[0]
        # The replica names models as their vendors do ("NVIDIA-Nemotron-…"); config/models without the vendor.
        path = model_file(canonical_model(model)) or model_file(canonical_model(model).split("-", 1)[-1])
        ceiling = limit_ratio(path, k) if path else math.nan
        # The paper measured at its own depth: its claim is bounded by the ceiling at its draft forwards, not ours.
        paper_ceiling = limit_ratio(path, PAPER_DRAFT_FORWARDS) if path else math.nan
        lo, hi = 1.0 + claim["lo"], 1.0 + claim["hi"]
        rows.append(
            {
                "model": model,
                "context": context_label(longest["context"]),
                "replica (H200)": round(float(longest["measured_ratio"]), 3),
                "cost model": round(float(longest["predicted_ratio"]), 3),
                f"ceiling 1 + {k}/L_full": round(ceiling, 3),
                f"ceiling at the paper's d {PAPER_DRAFT_TOKENS}": round(paper_ceiling, 3),
                "paper": f"{lo:.2f}–{hi:.2f}",
                "the paper's range, at its own d": _against_ceiling(lo, hi, paper_ceiling),
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
    the colour: 'wmtp S=16 W=256'), ``paper_model`` (the paper measured this model, see
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
                    + ([facet_value("workload", r["workload"])] if several_workloads else [])
                )
                for r in measured.to_dict("records")
            ]
            parts.append(measured.assign(source="measured"))
        else:
            notes.append("the windowed arms share no (k, rung) with an mtp arm: no measured wedge")
    else:
        notes.append(NOTE_NO_WINDOWED)
    if replica is not None and not replica.empty:
        rep = single_request(replica).copy()
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


#: What a measured quantity is of, besides its arm, k and rung: every row carries all of them, so that a
#: comparison can select the workload the published number was measured on and no two series collapse.
QUANTITY_KEYS: tuple[str, ...] = ("model", "engine", "concurrency", "workload", "sink", "window")


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
        "k": int_or_none(k),
        "rung": int_or_none(rung),
        "rung_from": int_or_none(rung_from),
        "position": int_or_none(position),
        "value": value,
        "lo": lo,
        "hi": hi,
        **{c: key.get(c) for c in QUANTITY_KEYS},
    }


# One flat block per published quantity, in the CSVs' vocabulary: long, but each branch is one lookup.
def measured_quantities(tidy: Tidy, **boot: Any) -> pd.DataFrame:  # noqa: C901
    """Every quantity the published CSVs name, as measured, in the CSVs' units (long format).

    Columns: quantity, arm, k, rung, rung_from, position, value, lo, hi, model, engine, concurrency,
    workload, sink, window. Changes across context are taken from the smallest rung to each larger one.
    """
    rows: list[dict[str, Any]] = []
    r = tidy.rungs
    for rec in r.to_dict("records"):
        arm, k = rec["arm"], (int_or_none(rec.get("k")) or None)
        key = {c: rec.get(c) for c in QUANTITY_KEYS}
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
            "k": int_or_none(rec.get("k")) or None,
            "rung": rec["rung"],
            **{c: rec.get(c) for c in QUANTITY_KEYS},
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
                    k=int_or_none(rec.get("k")) or None,
                    rung=rec["rung"],
                    position=rec["position"],
                    **{c: rec.get(c) for c in QUANTITY_KEYS},
                )
            )
    # spread of the repeats
    dec = an.decode_table(tidy.requests, **boot)
    req = tidy.requests
    for rec in dec.to_dict("records"):
        common = {
            "k": int_or_none(rec.get("k")) or None,
            "rung": rec["rung"],
            **{c: rec.get(c) for c in QUANTITY_KEYS},
        }
        rows.append(_q("decode_tok_s_range", rec["arm"], math.nan, lo=rec["min"], hi=rec["max"], **common))
        vals = an.finite_values(
            an.select_rows(req, {**{c: rec.get(c) for c in an.SERIES_KEYS if c in req.columns}, "rung": rec["rung"]})[
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
                "k": int_or_none(rec.get("k")),
                "rung": rec["rung"],
                **{c: rec.get(c) for c in QUANTITY_KEYS},
            }
            rows.append(_q("speedup", rec["arm"], rec["speedup"], lo=rec["lo"], hi=rec["hi"], **common))
            rows.append(_q("decode_tok_s_gain_pct", rec["arm"], 100 * (rec["speedup"] - 1), **common))
        for to in rungs[1:]:
            for rec in an.speedup_change_table(req, rung_from=rungs[0], rung_to=to, **boot).to_dict("records"):
                common = {
                    "k": int_or_none(rec.get("k")),
                    "rung": to,
                    "rung_from": rungs[0],
                    **{c: rec.get(c) for c in QUANTITY_KEYS},
                }
                rows.append(_q("speedup_change", rec["arm"], rec["change"], lo=rec["lo"], hi=rec["hi"], **common))
                if rec["se"] and np.isfinite(rec["se"]) and rec["se"] > 0:
                    rows.append(_q("speedup_change_sigmas", rec["arm"], rec["change"] / rec["se"], **common))
                    rows.append(_q("speedup_dip_sigmas", rec["arm"], abs(rec["change"]) / rec["se"], **common))
            for rec in an.draft_tax_table(r, req, rung_from=rungs[0], rung_to=to, **boot).to_dict("records"):
                key = {c: rec.get(c) for c in QUANTITY_KEYS}
                common = {"k": int_or_none(rec.get("k")), "rung": to, "rung_from": rungs[0], **key}
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
    for key, group in an.group_rows(r, an.SERIES_KEYS):
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
                "k": int_or_none(key.get("k")) or None,
                "rung": to,
                "rung_from": first,
                **{c: key.get(c) for c in QUANTITY_KEYS},
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
            base = an.select_rows(
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
                    **{c: rec.get(c) for c in QUANTITY_KEYS},
                )
            )
    if tidy.has_windowed:
        for rec in an.cost_side_table(r, req, **boot).to_dict("records"):
            k = int_or_none(rec.get("k")) or 1
            common = {
                "k": rec.get("k"),
                "rung": rec["rung"],
                **{c: rec.get(c) for c in QUANTITY_KEYS},
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
        # End to end: the windowed arm's decode rate over the native arm's, acceptance included (its TPOT ratio).
        for rec in r[r["arm"].isin(an.WINDOWED_ARMS)].to_dict("records"):
            match = {c: rec.get(c) for c in an.MATCH_KEYS if c in r.columns}
            native = an.select_rows(r, {"arm": an.NATIVE_ARM, "k": rec.get("k"), "rung": rec["rung"], **match})
            if native.empty:
                continue
            rows.append(
                _q(
                    "windowed_decode_speedup",
                    rec["arm"],
                    float(rec["decode_tok_s"]) / float(native["decode_tok_s"].iloc[0]),
                    k=rec.get("k"),
                    rung=rec["rung"],
                    **{c: rec.get(c) for c in QUANTITY_KEYS},
                )
            )
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
            "workload",
        ]
        out = out.drop_duplicates(subset=ident).reset_index(drop=True)
    return out


def _matches(pub: pd.Series, meas: pd.DataFrame) -> pd.DataFrame:
    sel = meas[meas["quantity"] == pub["quantity"]]
    if "workload" in sel.columns:  # a number is of the workload it names; of plain code prompts where it names none
        sel = sel[sel["workload"].fillna("code") == (pub.get("workload") or "code")]
    if pub.get("model"):
        sel = sel[sel["model"] == pub["model"]]
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
                    "workload": m["workload"],
                    "source_quote": p["source_quote"],
                }
            )
    notes = []
    if unmatched:
        notes.append("published but not measured here: " + ", ".join(sorted(set(unmatched))))
    if not rows:
        return Section(notes=(*notes, f"nothing this study measured matches the published numbers of '{study}'"))
    return Section(pd.DataFrame(rows), tuple(notes))


def published_sources(published: pd.DataFrame, study: str) -> pd.DataFrame:
    """Each source of the study's published numbers once, with its verbatim quote (``source``, ``source_quote``)."""
    if published.empty:
        return pd.DataFrame(columns=["source", "source_quote"])
    rows = published[published["study"] == study][["source", "source_quote"]]
    return rows.drop_duplicates().reset_index(drop=True)


def published_display(section: Section) -> pd.DataFrame:
    """The comparison as a table for people."""
    if not section.available:
        return pd.DataFrame()
    f = section.frame

    def pub_text(r: pd.Series) -> str:
        if np.isfinite(r["published"]):
            pm = f" ± {fmt_value(r['published_pm'])}" if np.isfinite(r["published_pm"]) else ""
            return f"{fmt_value(r['published'], 4)}{pm}"
        lo = fmt_value(r["published_lo"], 4) if np.isfinite(r["published_lo"]) else "…"
        hi = fmt_value(r["published_hi"], 4) if np.isfinite(r["published_hi"]) else "…"
        return f"{lo}–{hi}"

    def meas_text(r: pd.Series) -> str:
        if np.isfinite(r["measured"]):
            return fmt_ci(r["measured"], r["measured_lo"], r["measured_hi"])
        if np.isfinite(r["measured_lo"]):
            return f"{fmt_value(r['measured_lo'], 4)}–{fmt_value(r['measured_hi'], 4)}"
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
            "difference": [fmt_value(v) for v in f["difference"]],
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
                sink, window = (int_or_none(rec.get("sink")) or 0), (int_or_none(rec.get("window")) or 0)
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
                    int_or_none(rec.get("sink")) or 0,
                    int_or_none(rec.get("window")) or 0,
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
    return Section(arm_order(add_labels(frame, tidy.rungs)), tuple(notes))


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
            "measured": [fmt_value(v) for v in f["measured"]],
            "cost model": [fmt_value(v) for v in f["predicted"]],
            "difference": [fmt_value(v) for v in f["difference"]],
        }
    )
