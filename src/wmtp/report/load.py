"""The report's inputs: the tidy tables (:class:`Tidy`), the published numbers, the GPU replica's table, and
the :class:`Section` every ``*_section`` function returns: a frame (possibly empty) and, when something is
missing, a note that says so in words ("not measured: no NVML on this machine"), so the notebook never plots
zeros or NaN.

Published numbers (``config/published/*.csv``) are one number per row with the exact sentence they
come from: ``study, quantity, arm, k, rung, rung_from, position, value, pm, lo, hi, unit, primary,
source, source_quote, model, workload``. ``source`` labels which text the quote is from (docs/design.md,
"Published numbers": ``seed 000`` is the Spark study's write-up, ``seed 001``/``seed 003`` texts on the
Windowed-MTP paper, ``artifact README`` the reference results of the paper's public artifact). ``rung`` is the
context the text names (its server-counted prompt tokens where it gives them, 1,048,576 for the paper's "1M",
the rung the studies measure); ``primary`` is false for a rounded restatement of a number stated more precisely
elsewhere, and for what a text says a change *would* do. ``model`` and ``workload`` name the study's model and
workload a number is of; empty, any model, and the plain code prompts. Percentages are stored as the text
writes them (78.7, unit %).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from wmtp.analyze import analysis as an
from wmtp.layout import DERIVED_DIR, REPO_ROOT, TIDY_TABLES

PUBLISHED_DIR = REPO_ROOT / "config" / "published"


@dataclass(frozen=True)
class Tidy:
    """The tidy tables of a study (empty frames where a table is absent)."""

    requests: pd.DataFrame
    rungs: pd.DataFrame
    positions: pd.DataFrame
    # <study>/derived beside the tidy folder, where the derive stage writes what the report shows.
    derived_dir: Path | None = None
    # The ring's admission proofs: one row per (model, engine, arm); empty when the study has no wmtp-ring.
    admission: pd.DataFrame = field(default_factory=pd.DataFrame)

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
        [
            pd.read_csv(f, dtype={"study": str, "quantity": str, "arm": str, "model": str, "workload": str})
            for f in files
        ],
        ignore_index=True,
    )
    for col in ("arm", "model", "workload"):
        frame[col] = frame[col].fillna("") if col in frame.columns else ""
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


def load_replica_table(path: Path | str | None) -> pd.DataFrame | None:
    """The GPU replica's tidy table as written (one row per model, context, k, batch and arm), or None."""
    if not path or not Path(path).exists():
        return None
    frame = pd.read_parquet(path)
    return frame if not frame.empty else None


def load_replica(path: Path | str | None) -> pd.DataFrame | None:
    """The GPU replica's windowed rows at one request per step, normalised for the wedge, or None."""
    table = load_replica_table(path)
    if table is None:
        return None
    frame = normalise_replica(table)
    return frame if not frame.empty else None


def normalise_replica(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, context, k, sink, window[, backend]) with ``ratio`` and ``predicted_ratio``.

    Accepts the summary shape (step_nat_ms, step_win_ms, ratio, predicted_ratio) and the long
    per-arm shape of ``wmtp.replica.replica.tidy`` (arm, measured_ms, measured_ratio, predicted_ratio).
    """
    if frame.empty:
        return frame
    out = frame.copy()
    if "batch" in out.columns:  # the wedge compares one request per step; the batch sweep has its own table
        out = out[pd.to_numeric(out["batch"], errors="coerce").fillna(1) == 1]
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
