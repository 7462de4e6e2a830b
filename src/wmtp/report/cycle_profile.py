"""Where a real engine's decode cycle goes: a profiling study's trace table (``wmtp trace-table``) per arm and context,
each component's device time beside its byte floor, and the device's idle time (the host-bound part of a cycle).

A traced cycle runs slower than an untraced one (the profiler records every host call), so these tables say where a
cycle's time goes; the engine's step files say how long a cycle takes.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from wmtp.analyze.traces import STEP_COMPONENTS
from wmtp.layout import parse_cell_id
from wmtp.report.load import Section

#: The figure's and the table's order: the target's forward, the lm_heads, the draft, then what has no bytes.
COMPONENT_ORDER = (
    "target_attn", "target_gdn", "target_moe", "target_other", "lm_head", "draft_attn", "draft_other", "sampling",
    "step_prep", "unattributed", "device_idle",
)  # fmt: skip
COMPONENT_LABELS = {
    "target_attn": "target attention",
    "target_gdn": "target recurrent (Gated DeltaNet)",
    "target_moe": "target routed experts",
    "target_other": "target dense GEMMs and the rest",
    "lm_head": "lm_head (target and drafts)",
    "draft_attn": "draft attention",
    "draft_other": "rest of the draft",
    "sampling": "sampling and the draft's inputs",
    "step_prep": "the step's inputs",
    "unattributed": "unattributed",
    "device_idle": "device idle (host-bound)",
}
KEYS = ["gpu", "model", "engine", "arm", "k", "context"]


def load_traces(paths: Iterable[Path | str]) -> pd.DataFrame | None:
    """The trace tables, stacked; None when none is named. A missing file is an error: the study names it."""
    frames = [pd.read_csv(path) for path in paths]
    return pd.concat(frames, ignore_index=True) if frames else None


def _cell_fields(cell_ids: pd.Series) -> pd.DataFrame:
    keys = [parse_cell_id(cell_id) for cell_id in cell_ids]
    return pd.DataFrame(
        {"model": [c.model for c in keys], "engine": [c.engine for c in keys], "arm": [c.arm for c in keys],
         "k": [c.k for c in keys]},
        index=cell_ids.index,
    )  # fmt: skip


def cycle_profile_table(traces: pd.DataFrame) -> pd.DataFrame:
    """One row per (GPU, model, engine, arm, k, context, component): the median over the traced requests of the
    component's device time a cycle (µs), its byte floor (µs) and the time over the floor; the device's idle time
    a cycle as its own component, and each shape's traced wall time, traced requests and cycles beside every row."""
    if traces is None or traces.empty:
        return pd.DataFrame()
    frame = pd.concat([traces.reset_index(drop=True), _cell_fields(traces["cell_id"])], axis=1)
    frame = frame.rename(columns={"rung": "context"})
    frame["gpu"] = frame["gpu"].fillna("")
    parts = frame.groupby([*KEYS, "component"], as_index=False).agg(us=("us", "median"), floor_us=("floor_us", "first"))
    # One row a traced request: its steps count once, not once a component.
    shapes = (
        frame.drop_duplicates([*KEYS, "trace"])
        .groupby(KEYS, as_index=False)
        .agg(
            wall_us=("wall_us", "median"),
            device_busy_us=("device_busy_us", "median"),
            device_idle_us=("device_idle_us", "median"),
            traces=("trace", "nunique"),
            cycles=("steps", "sum"),
        )
    )
    idle = shapes[KEYS].assign(component="device_idle", us=shapes["device_idle_us"], floor_us=float("nan"))
    table = pd.concat([parts, idle], ignore_index=True).merge(shapes, on=KEYS)
    known = {name: i for i, name in enumerate(COMPONENT_ORDER)}
    unknown = sorted(set(table["component"]) - set(known) - set(STEP_COMPONENTS))
    known.update({name: len(known) + i for i, name in enumerate(unknown)})
    table["order"] = table["component"].map(known)
    table["over_floor"] = table["us"] / table["floor_us"].where(table["floor_us"] > 0)
    table = table.sort_values([*KEYS, "order"]).drop(columns="order").reset_index(drop=True)
    return table[[*KEYS, "component", "us", "floor_us", "over_floor", "wall_us", "device_busy_us", "traces", "cycles"]]


def window_gain(table: pd.DataFrame) -> pd.DataFrame:
    """Per (GPU, model, engine, k, context) where both drafting arms were traced: what the window saved on the
    device, component by component (native's time less the windowed arm's, µs a cycle), beside what its bytes
    allow (the floors' difference), and the change in the device's idle time."""
    if table.empty:
        return pd.DataFrame()
    keys = [key for key in KEYS if key != "arm"]
    wide = table[table["arm"].isin(["mtp", "wmtp"])].pivot_table(
        index=[*keys, "component"], columns="arm", values=["us", "floor_us"], aggfunc="first"
    )
    if ("us", "mtp") not in wide.columns or ("us", "wmtp") not in wide.columns:
        return pd.DataFrame()
    out = pd.DataFrame(
        {
            "saved_us": wide[("us", "mtp")] - wide[("us", "wmtp")],
            "saved_by_bytes_us": wide[("floor_us", "mtp")] - wide[("floor_us", "wmtp")],
        }
    ).dropna(subset=["saved_us"])
    return out.reset_index()


def cycle_profile_section(traces: pd.DataFrame | None) -> Section:
    if traces is None or traces.empty:
        return Section(notes=("no profiling study's trace table is named (replica.traces)",))
    return Section(cycle_profile_table(traces))
