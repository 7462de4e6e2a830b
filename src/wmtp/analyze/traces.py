"""Where a traced decode cycle's time goes: one row per (traced request, component), from vLLM's torch-profiler
traces (a profiling study's cells keep them in their ``profile/`` folders, each request's names in ``profile_traces``).

vLLM annotates each engine step it traces (``execute_context_C(c)_generation_G(g)``: C prefill requests of c tokens,
G decoding requests of g tokens); the device's own activity is the trace's kernels, copies and sets. A cycle's wall
time is the traced span, from the first step's start on the host to the last device event's end, over the steps:
with asynchronous scheduling a step's kernels run while the host prepares the next, so a span, not a step's host
range, is what a cycle costs. Within it the device is busy for the union of its events, idle for the rest (the
host-bound part of a cycle), and each component is the time of the kernels its name pattern claims, first match
first. A trace without device events (the CPU build) gives the wall time and no components.
"""

from __future__ import annotations

import gzip
import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from wmtp.layout import REQUESTS_FILE

STEP = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
HOST_ANNOTATION = "user_annotation"
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
# A kernel's component by its name, first match first: FlashAttention and FlashInfer for full attention, the
# Gated DeltaNet's recurrent and convolution kernels, the fused MoE's experts and routing, the dense GEMMs
# (projections and the lm_head). What none claims is "other" (norms, activations, sampling, the plugin's kernels).
COMPONENTS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("attention", re.compile(r"flash|fmha|attn|attention", re.I)),
    ("gated deltanet", re.compile(r"delta_rule|gated_delta|recurrent|causal_conv|conv1d|gdn", re.I)),
    ("moe", re.compile(r"moe|expert|topk|align_block", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|matmul", re.I)),
    ("memory", re.compile(r"memcpy|memset", re.I)),
)
OTHER = "other"
log = logging.getLogger(__name__)
COLUMNS = ["trace", "steps", "tokens_per_step", "wall_us", "device_busy_us", "device_idle_us", "component", "us"]


class TraceError(ValueError):
    pass


def component_of(kernel: str) -> str:
    """The component a kernel's time is counted under."""
    return next((name for name, pattern in COMPONENTS if pattern.search(kernel)), OTHER)


def union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: overlapping streams count once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def decode_steps(events: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The trace's engine steps, in time order; a step that prefills is refused (the trace was meant to hold decode)."""
    # On a GPU the annotation is also recorded on the device's timeline (gpu_user_annotation): the host's is the step.
    steps = sorted(
        (e for e in events if e.get("cat") == HOST_ANNOTATION and STEP.fullmatch(str(e.get("name", "")))),
        key=lambda e: float(e["ts"]),
    )
    for step in steps:
        prefills = int(STEP.fullmatch(str(step["name"])).group(1))  # type: ignore[union-attr]
        if prefills:
            raise TraceError(f"step {step['name']!r} prefills: the profiler started before the prefill ended")
    return steps


def cycle_breakdown(events: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One traced decode: its steps, tokens per step, wall, device busy and idle time per step (µs), and each
    component's device time per step."""
    steps = decode_steps(events)
    if not steps:
        raise TraceError("the trace holds no engine step")
    start = float(steps[0]["ts"])
    # A kernel the untraced step before launched can still run when the trace starts: only its part inside counts.
    device = [
        (str(e.get("name", "")), max(float(e["ts"]), start), float(e["ts"]) + float(e["dur"]))
        for e in events
        if e.get("cat") in DEVICE_CATEGORIES and "dur" in e and float(e["ts"]) + float(e["dur"]) > start
    ]
    end = max([float(s["ts"]) + float(s["dur"]) for s in steps] + [stop for _, _, stop in device])
    n = len(steps)
    tokens = [int(STEP.fullmatch(str(s["name"])).group(4)) for s in steps]  # type: ignore[union-attr]
    busy = union_us((begin, stop) for _, begin, stop in device)
    components: dict[str, float] = {}
    for kernel, begin, stop in device:
        name = component_of(kernel)
        components[name] = components.get(name, 0.0) + (stop - begin) / n
    return {
        "steps": n,
        "tokens_per_step": sum(tokens) / n,
        "wall_us": (end - start) / n,
        "device_busy_us": busy / n,
        "device_idle_us": (end - start - busy) / n,
        "components": dict(sorted(components.items())),
    }


def read_trace(path: Path) -> list[Mapping[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return json.load(handle)["traceEvents"]


def trace_rows(name: str, breakdown: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Tidy rows of one trace: one per component (one row "none" where the trace has no device events)."""
    common = {key: breakdown[key] for key in COLUMNS[1:6]}
    components = breakdown["components"] or {"none": 0.0}
    return [{"trace": name, **common, "component": c, "us": us} for c, us in components.items()]


def cell_trace_table(cell_dirs: Iterable[Path]) -> list[dict[str, Any]]:
    """Every measured request's traces in these raw cell folders, as tidy rows with the cell id and rung."""
    import pandas as pd

    rows: list[dict[str, Any]] = []
    for cell_dir in cell_dirs:
        requests = pd.read_parquet(cell_dir / REQUESTS_FILE)
        if "profile_traces" not in requests:
            raise TraceError(f"{cell_dir}: its requests were not profiled (no profile_traces column)")
        for request in requests[~requests["warmup"]].itertuples():
            names = list(request.profile_traces) if request.profile_traces is not None else []
            if not names:
                log.warning(
                    "%s: a request at rung %d left no trace (it ended before the engine's skipped and traced steps)",
                    cell_dir, request.rung,
                )  # fmt: skip
            for name in names:
                breakdown = cycle_breakdown(read_trace(cell_dir / name))
                for row in trace_rows(str(name), breakdown):
                    rows.append({"cell_id": request.cell_id, "rung": request.rung, **row})
    return rows
