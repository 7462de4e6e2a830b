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


def ceiling_ratio(model: str, k: int) -> float:
    """1 + k/L_full for that model: the most windowing the draft can save per cycle when only KV reads count."""
    from wmtp.analyze.costmodel import limit_ratio

    path = model_file(canonical_model(model))
    return limit_ratio(path, k) if path else math.nan


def _windowed(group: pd.DataFrame, k: int, context: int) -> tuple[pd.Series | None, pd.Series | None]:
    """The windowed row at that k whose window acts at this context, and the control row whose S + W covers it."""
    rows = group[(group["arm"] == "wmtp") & (group["k"] == k)]
    if "W" not in rows.columns:  # a step file from before windows were recorded: every row windowed
        return (rows.iloc[0] if len(rows) else None), None
    sink = pd.to_numeric(rows["S"], errors="coerce").fillna(0) if "S" in rows.columns else 0
    reach = sink + pd.to_numeric(rows["W"], errors="coerce").fillna(0)
    acting, control = rows[reach < context], rows[reach >= context]
    return (acting.iloc[0] if len(acting) else None), (control.iloc[0] if len(control) else None)


def _value(row: pd.Series | None, column: str) -> float:
    if row is None or column not in row.index:
        return math.nan
    value = pd.to_numeric(pd.Series([row[column]]), errors="coerce").iloc[0]
    return float(value)


def _interval_text(ratio: float, lo: float, hi: float) -> str:
    """The ratio with its range over servers; 'not resolved' where the range holds 1."""
    if math.isnan(ratio):
        return ""
    if lo == hi:
        return f"{ratio:.2f} (one server each)"
    verdict = "" if lo > 1 or hi < 1 else ", not resolved"
    return f"{ratio:.2f} [{lo:.2f}, {hi:.2f}]{verdict}"


def engine_step_section(steps: pd.DataFrame | None, replica: pd.DataFrame | None) -> Section:
    """One row per (model, engine version, context, k, batch) where the engine measured mtp and wmtp at that k.

    The ratio mtp / wmtp is of the medians of each arm's servers, with its range over every pairing of one server
    of each; each arm's cycle is also shown as a multiple of its byte floor, and the clock that timed it.
    """
    need = {"arm", "k", "context", "batch", "step_ms", "n", "engine_version", "model"}
    if steps is None or steps.empty or not need <= set(steps.columns):
        return Section()
    from wmtp.analyze.steps import server_ratio

    keys = ["model", "engine_version", "context", "batch"]
    rows = []
    for (model, version, context, batch), group in steps.groupby(keys, sort=True):
        none = group[group["arm"] == "none"]
        none_row = none.iloc[0] if len(none) else None
        none_ms = _value(none_row, "step_ms")
        for k in sorted(set(group.loc[group["arm"] == "mtp", "k"]) & set(group.loc[group["arm"] == "wmtp", "k"])):
            mtp = group[(group["arm"] == "mtp") & (group["k"] == k)].iloc[0]
            wmtp, control = _windowed(group, int(k), int(context))
            if wmtp is None:
                continue
            pair = pd.DataFrame([mtp, wmtp])
            interval = server_ratio(pair, "mtp", "wmtp").iloc[0]
            replica_ratio, model_ratio = _replica_ratio(replica, model, int(context), int(k), int(batch))
            servers = [_value(r, "servers") for r in (none_row, mtp, wmtp)]
            clocks = {str(r["clock"]) for r in (none_row, mtp, wmtp) if r is not None and "clock" in r.index}
            rows.append(
                {
                    "model": model,
                    "engine": f"vLLM {version}",
                    "context": context_label(context),
                    "tokens": int(context),
                    "k": int(k),
                    "batch": int(batch),
                    "clock": "/".join(sorted(clocks)) or "client",
                    "none (ms)": round(none_ms, 2),
                    "mtp (ms)": round(float(mtp["step_ms"]), 2),
                    "wmtp (ms)": round(float(wmtp["step_ms"]), 2),
                    "wmtp, window off (ms)": round(_value(control, "step_ms"), 2),
                    "servers none/mtp/wmtp": "/".join("–" if math.isnan(v) else str(int(v)) for v in servers),
                    "n none/mtp/wmtp": "/".join(
                        str(int(_value(r, "n") or 0)) if r is not None else "0" for r in (none_row, mtp, wmtp)
                    ),
                    "engine mtp / wmtp": float(interval["ratio"]),
                    "ratio_lo": float(interval["ratio_lo"]),
                    "ratio_hi": float(interval["ratio_hi"]),
                    "mtp / wmtp [range over servers]": _interval_text(
                        float(interval["ratio"]), float(interval["ratio_lo"]), float(interval["ratio_hi"])
                    ),
                    "replica": round(replica_ratio, 3),
                    "cost model": round(model_ratio, 3),
                    "ceiling 1 + k/L_full": round(ceiling_ratio(model, int(k)), 3),
                    "× floor none/mtp/wmtp": "/".join(
                        "–" if math.isnan(_value(r, "over_floor")) else f"{_value(r, 'over_floor'):.1f}"
                        for r in (none_row, mtp, wmtp)
                    ),
                    "break-even tokens/cycle, mtp": round(break_even_tokens(float(mtp["step_ms"]), none_ms), 2),
                    "break-even tokens/cycle, wmtp": round(break_even_tokens(float(wmtp["step_ms"]), none_ms), 2),
                    # The plugin's count over the wmtp cell's whole server, all of its rungs.
                    "windowed draft forwards (server)": _value(wmtp, "windowed_forwards"),
                }
            )
    return Section(pd.DataFrame(rows))
