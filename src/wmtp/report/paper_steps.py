"""The paper's own steps beside what bounds them: per model of its artifact, the native and windowed step it
published on a B200, each step's byte floor there, and this project's real-engine step at the same shape on an
H200 where one was measured.

A published step far above its floor, or a windowed step shorter than the bytes the window removes allow, says that
the gain is in kernels, not in bytes: the floor counts what a step must read (weights at the checkpoint's NVFP4,
the KV, the recurrent state) at the GPU's bandwidth, nothing else.
"""

from __future__ import annotations

import math

import pandas as pd

from wmtp.analyze import costmodel
from wmtp.analyze.floor import step_floor_ms
from wmtp.config import PAPER_SINK, PAPER_WINDOW
from wmtp.report.compare import canonical_model, model_file
from wmtp.report.engine_steps import cell_number, newest_plugin_first
from wmtp.report.labels import context_label
from wmtp.report.load import Section

#: The artifact's published steps (config/published/paper-1m.csv).
ARTIFACT_STUDY = "paper-1m"
#: Bandwidths the floors are taken at: the B200's datasheet peak (no B200 was measured here) and the H200's
#: measured read bandwidth, as the step files' floors.
B200_BANDWIDTH = costmodel.PEAK_BANDWIDTH["B200"]
H200_BANDWIDTH = costmodel.MEASURED_READ_BANDWIDTH["H200"]
#: The artifact's checkpoints are NVFP4.
ARTIFACT_QUANTIZATION = "nvfp4"


def _facts(model: str) -> costmodel.ModelSpec | None:
    """The facts file of a published model name ("qwen3.6-35b-a3b-nvfp4" → qwen3.6-35b-a3b), at NVFP4."""
    path = model_file(model.lower())
    if path is None:
        return None
    return costmodel.with_quantization(costmodel.load_model(path), ARTIFACT_QUANTIZATION)


def _floor(spec: costmodel.ModelSpec, context: int, k: int, arm: str, bandwidth: float) -> float:
    return step_floor_ms(spec, context, k, arm, bandwidth, sink=PAPER_SINK, window=PAPER_WINDOW)["step"]


def _engine_step(steps: pd.DataFrame | None, model: str, k: int, context: int, arm: str) -> pd.Series | None:
    """The real engine's cycle at that model, k and context, batch 1, as vLLM runs by default (no attention options
    of the study's own), the windowed arm at the paper's S and W with the window set once a cycle, by the newest
    plugin that measured it; None where that was not measured."""
    if steps is None or steps.empty:
        return None
    names = steps["model"].map(canonical_model)
    rows = steps[(names == canonical_model(model)) & (steps["arm"] == arm) & (steps["k"] == k)]
    rows = rows[(rows["context"] == context) & (rows.get("batch", 1) == 1)]
    if "attention_config" in rows.columns:
        rows = rows[[not isinstance(v, str) or not v for v in rows["attention_config"]]]
    if arm == "wmtp" and {"S", "W"} <= set(rows.columns):
        rows = rows[(rows["S"] == PAPER_SINK) & (rows["W"] == PAPER_WINDOW)]
        if "window_anchor" in rows.columns:
            rows = newest_plugin_first(rows[rows["window_anchor"].fillna("forward") == "cycle"])
    return rows.iloc[0] if len(rows) else None


def _shown(row: pd.Series | None, column: str, spec: str) -> str:
    value = cell_number(row, column)
    return "–" if math.isnan(value) else format(value, spec)


def paper_steps_section(published: pd.DataFrame, steps: pd.DataFrame | None = None) -> Section:
    """One row per model of the artifact's published steps (native and windowed at the same k and context): the
    steps and their ratio, each step's byte floor on a B200 and the step over it, the milliseconds the window saved
    against what its bytes allow, and this project's H200 engine cycles at that shape (NaN where not measured)."""
    if published is None or published.empty:
        return Section()
    cycles = published[(published["study"] == ARTIFACT_STUDY) & (published["quantity"] == "cycle_ms")]
    rows = []
    for (model, k, context), group in cycles.groupby(["model", "k", "rung"], sort=False):
        by_arm = dict(zip(group["arm"], group["value"], strict=True))
        spec = _facts(str(model))
        if spec is None or not {"mtp", "wmtp"} <= set(by_arm):
            continue
        k, context = int(k), int(context)
        native, windowed = float(by_arm["mtp"]), float(by_arm["wmtp"])
        floor = {arm: _floor(spec, context, k, arm, B200_BANDWIDTH) for arm in ("mtp", "wmtp")}
        h200 = {arm: _engine_step(steps, str(model), k, context, arm) for arm in ("mtp", "wmtp")}
        h200_floor = {arm: _floor(spec, context, k, arm, H200_BANDWIDTH) for arm in ("mtp", "wmtp")}
        rows.append(
            {
                "model": model,
                "context": context_label(context),
                "k": k,
                "paper native (ms, B200)": native,
                "paper windowed (ms, B200)": windowed,
                "paper native / windowed": native / windowed,
                "floor native (ms, B200)": floor["mtp"],
                "floor windowed (ms, B200)": floor["wmtp"],
                "floor native / windowed": floor["mtp"] / floor["wmtp"],
                "native × floor": native / floor["mtp"],
                "windowed × floor": windowed / floor["wmtp"],
                "saved (ms)": native - windowed,
                "saved by bytes (ms, B200)": floor["mtp"] - floor["wmtp"],
                "H200 native (ms)": cell_number(h200["mtp"], "step_ms"),
                "H200 windowed (ms)": cell_number(h200["wmtp"], "step_ms"),
                "H200 native / windowed": cell_number(h200["mtp"], "step_ms") / cell_number(h200["wmtp"], "step_ms"),
                # How far each H200 cycle sits above its byte floor, how many servers it came from and by which clock.
                "H200 × floor native / windowed": "/".join(
                    _shown(h200[a], "over_floor", ".2f") for a in ("mtp", "wmtp")
                ),
                "H200 servers native / windowed": "/".join(_shown(h200[a], "servers", ".0f") for a in ("mtp", "wmtp")),
                "H200 clock": "/".join(
                    sorted({str(r["clock"]) for r in h200.values() if r is not None and "clock" in r})
                ),
                "floor native / windowed (H200)": h200_floor["mtp"] / h200_floor["wmtp"],
            }
        )
    return Section(pd.DataFrame(rows).round(3) if rows else pd.DataFrame())


def paper_steps_sentence(section: Section) -> str:
    """Per model, the milliseconds the window saved on the paper's B200 beside the most its bytes explain."""
    if not section.available:
        return ""
    parts = [
        f"{r['model']} {r['saved (ms)']:.1f} ms, of which the bytes it stops reading explain at most "
        f"{r['saved by bytes (ms, B200)']:.1f}"
        for _, r in section.frame.iterrows()
    ]
    beyond = (section.frame["saved (ms)"] > section.frame["saved by bytes (ms, B200)"]).all()
    verdict = " The rest is the native draft's kernels, not bytes." if beyond else ""
    return "On the paper's B200 the window saved: " + "; ".join(parts) + "." + verdict
