"""A real engine's decode cycle next to the GPU replica's, the cost model's and the ceiling, and its break-even.

The step files (``measurements/<device>/vllm_<model>.csv``, written by ``wmtp step-table`` from a real engine's
cells; ``wmtp.analyze.steps`` owns their columns) give one cycle's time per arm, k, context and batch. From them:

- the cost-side ratio mtp / wmtp at matched k, context and batch: what windowing the draft saves per cycle in
  that engine, acceptance aside;
- beside it the replica's and the cost model's ratio at the same shape (the tidy replica table) and the ceiling
  1 + k/L_full, which holds when the draft's KV reads are all that windowing removes;
- the break-even acceptance: the tokens a cycle must yield for a drafting arm to decode as fast as no draft,
  its cycle over the no-draft step (1 + the accepted drafts per cycle; at most k + 1).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from wmtp.report.compare import canonical_model, model_file
from wmtp.report.labels import context_label
from wmtp.report.load import Section

STEP_FILE_PREFIX = "vllm_"


def load_engine_steps(paths: Iterable[Path | str]) -> pd.DataFrame | None:
    """The step files, one frame with the model of each (from its name, ``vllm_<model>.csv``), or None."""
    frames = []
    for path in sorted(Path(p) for p in paths):
        frame = pd.read_csv(path)
        if frame.empty:
            continue
        frames.append(frame.assign(model=path.stem.removeprefix(STEP_FILE_PREFIX), engine="vLLM"))
    return pd.concat(frames, ignore_index=True) if frames else None


def break_even_tokens(step_ms: float, none_ms: float) -> float:
    """Tokens a cycle must yield for an arm whose cycle takes ``step_ms`` to decode as fast as no draft."""
    if not (step_ms > 0 and none_ms > 0):
        return math.nan
    return step_ms / none_ms


def _batches(replica: pd.DataFrame) -> pd.Series:
    """Requests per step of each replica row (one in tables from before the batch sweep)."""
    if "batch" not in replica.columns:
        return pd.Series(1, index=replica.index)
    return pd.to_numeric(replica["batch"], errors="coerce").fillna(1)


def _replica_ratio(replica: pd.DataFrame | None, model: str, context: int, k: int, batch: int) -> tuple[float, float]:
    """The replica's measured and the cost model's predicted ratio at that shape, or NaNs."""
    if replica is None or replica.empty or "measured_ratio" not in replica.columns:
        return math.nan, math.nan
    names = replica["model"].map(canonical_model)
    at = replica[
        (names == canonical_model(model))
        & (replica["context"] == context)
        & (replica["k"] == k)
        & (_batches(replica) == batch)
        & (replica["arm"] == "mtp")
    ]
    if at.empty:
        return math.nan, math.nan
    return float(at["measured_ratio"].iloc[0]), float(at["predicted_ratio"].iloc[0])


def _ceiling(model: str, k: int) -> float:
    from wmtp.analyze.costmodel import limit_ratio

    path = model_file(canonical_model(model))
    return limit_ratio(path, k) if path else math.nan


def engine_step_section(steps: pd.DataFrame | None, replica: pd.DataFrame | None) -> Section:
    """One row per (model, engine version, context, k, batch) where the engine measured mtp and wmtp at that k."""
    need = {"arm", "k", "context", "batch", "step_ms", "n", "engine_version", "model"}
    if steps is None or steps.empty or not need <= set(steps.columns):
        return Section()
    keys = ["model", "engine_version", "context", "batch"]
    rows = []
    for (model, version, context, batch), group in steps.groupby(keys, sort=True):
        none = group[group["arm"] == "none"]
        none_ms = float(none["step_ms"].iloc[0]) if len(none) else math.nan
        for k in sorted(set(group.loc[group["arm"] == "mtp", "k"]) & set(group.loc[group["arm"] == "wmtp", "k"])):
            mtp = group[(group["arm"] == "mtp") & (group["k"] == k)].iloc[0]
            wmtp = group[(group["arm"] == "wmtp") & (group["k"] == k)].iloc[0]
            replica_ratio, model_ratio = _replica_ratio(replica, model, int(context), int(k), int(batch))
            counts = [int(none["n"].iloc[0]) if len(none) else 0, int(mtp["n"]), int(wmtp["n"])]
            rows.append(
                {
                    "model": model,
                    "engine": f"vLLM {version}",
                    "context": context_label(context),
                    "tokens": int(context),
                    "k": int(k),
                    "batch": int(batch),
                    "none (ms)": round(none_ms, 2),
                    "mtp (ms)": round(float(mtp["step_ms"]), 2),
                    "wmtp (ms)": round(float(wmtp["step_ms"]), 2),
                    "n none/mtp/wmtp": "/".join(str(c) for c in counts),
                    "engine mtp / wmtp": round(float(mtp["step_ms"]) / float(wmtp["step_ms"]), 3),
                    "replica": round(replica_ratio, 3),
                    "cost model": round(model_ratio, 3),
                    "ceiling 1 + k/L_full": round(_ceiling(model, int(k)), 3),
                    "break-even tokens/cycle, mtp": round(break_even_tokens(float(mtp["step_ms"]), none_ms), 2),
                    "break-even tokens/cycle, wmtp": round(break_even_tokens(float(wmtp["step_ms"]), none_ms), 2),
                    # The plugin's count over the wmtp cell's whole server, all of its rungs.
                    "windowed draft forwards (server)": wmtp.get("windowed_forwards", math.nan),
                }
            )
    return Section(pd.DataFrame(rows))
