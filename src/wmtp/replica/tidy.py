"""Tidy: the sweep's raw CSVs next to the floor (the cost model, batch-aware) -> one parquet (no torch)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from wmtp.analyze import costmodel as cm
from wmtp.analyze import floor as fl
from wmtp.analyze.analysis import cost_side_ratio

if TYPE_CHECKING:
    import pandas as pd


def _cost_side_ratios(nat: pd.DataFrame, win: pd.DataFrame, column: str) -> pd.Series:
    """Native over windowed step time, row by row on the native rows' index."""
    import pandas as pd

    windowed = win[column].reindex(nat.index)
    return pd.Series([cost_side_ratio(n, w) for n, w in zip(nat[column], windowed, strict=True)], index=nat.index)


def tidy(raw: Path, models_dir: Path, out: Path, bandwidth: float | None = None) -> int:
    """Measured steps next to the cost model; one row per (model, context, k, batch, arm), batch 1 first.

    ``predicted_ms`` is the pure roofline (bytes / bandwidth).  ``anchored_ms`` adds to the step
    measured at the smallest context the model's *growth* in bytes from there: it tests the
    context-dependent part of the model without the replica's fixed kernel overheads.
    """
    import pandas as pd

    steps = pd.read_csv(raw / "replica_steps.csv")
    if "batch" not in steps.columns:  # tables from before the batch sweep
        steps["batch"] = 1
    bw = bandwidth
    if bw is None:
        bw = float(pd.read_csv(raw / "replica_bandwidth.csv")["bandwidth"].iloc[-1])
    by_name = {cm.load_model(p).name: p for p in sorted(models_dir.glob("*.json"))}
    rows = []
    for r in steps.itertuples(index=False):
        spec_path = by_name.get(r.model)
        if spec_path is None:
            raise ValueError(f"tidy: no config/models/*.json has name {r.model!r} (have {sorted(by_name)})")
        k, n, nb = int(r.k), int(r.context), int(r.batch)
        spec = cm.load_model(spec_path)
        kw = {"batch": nb, "sink": int(r.sink), "window": int(r.window)}
        floor_ms = fl.step_floor_ms(spec, n, k, r.arm, bw, **kw)["step"]
        rows.append(
            {
                "model": r.model,
                "context": n,
                "k": k,
                "batch": nb,
                "arm": r.arm,
                "sink": int(r.sink),
                "window": int(r.window),
                "measured_ms": float(r.median_ms),
                "measured_p10_ms": float(r.p10_ms),
                "measured_p90_ms": float(r.p90_ms),
                "predicted_ms": floor_ms,
                "predicted_bytes": sum(fl.step_bytes(spec, n, k, r.arm, **kw).values()),
                "bandwidth": bw,
            }
        )
    df = pd.DataFrame(rows)
    anchor = df.loc[df.groupby(["model", "k", "batch", "arm"])["context"].idxmin()].set_index(
        ["model", "k", "batch", "arm"]
    )
    key = pd.MultiIndex.from_frame(df[["model", "k", "batch", "arm"]])
    df["anchored_ms"] = (
        anchor["measured_ms"].reindex(key).to_numpy()
        + df["predicted_ms"].to_numpy()
        - anchor["predicted_ms"].reindex(key).to_numpy()
    )
    nat = df[df.arm == "mtp"].set_index(["model", "context", "k", "batch"])
    win = df[df.arm == "wmtp"].set_index(["model", "context", "k", "batch"])
    ratios = pd.concat(
        [
            _cost_side_ratios(nat, win, "measured_ms").rename("measured_ratio"),
            _cost_side_ratios(nat, win, "predicted_ms").rename("predicted_ratio"),
            _cost_side_ratios(nat, win, "anchored_ms").rename("anchored_ratio"),
        ],
        axis=1,
    )
    df = df.join(ratios, on=["model", "context", "k", "batch"])
    df["step_over_floor"] = df["measured_ms"] / df["predicted_ms"]
    df = df.sort_values(["batch", "model", "context", "k", "arm"], kind="stable").reset_index(drop=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_parquet(out, index=False)
    return 0


# ============================================================================================
# CLI
# ============================================================================================
