"""Where a traced decode cycle's time goes: one row per (traced request, component), from vLLM's torch-profiler
traces (a profiling study's cells keep them in their ``profile/`` folders, each request's names in ``profile_traces``).

vLLM annotates each engine step it traces (``execute_context_C(c)_generation_G(g)``: C prefill requests of c tokens,
G decoding requests of g tokens); the device's own activity is the trace's kernels, copies and sets. A cycle's wall
time is the traced span, from the first step's start on the host to the last device event's end, over the steps:
with asynchronous scheduling a step's kernels run while the host prepares the next, so a span, not a step's host
range, is what a cycle costs. Within it the device is busy for the union of its events, idle for the rest (the
host-bound part of a cycle).

Each device event is counted under a component by the call that enqueued it (the trace links the two by a
correlation id) and by its name. The target's forward is the step's first CUDA-graph launch (a full graph in vLLM's
decode); the drafter's forwards come after it, each in piecewise graphs with its attention launched between them.
So: the first graph's kernels are the target's (attention, Gated DeltaNet, MoE, the rest); a GEMM launched outside
any graph after it is an lm_head (the target's and each draft forward's); attention after it is the draft's; what
runs between the target's graph and the drafter's first is sampling (the rejection sampler, the drafter's inputs,
a windowed draft's first metadata build); the rest after that is the draft's; what the step launched before the
target's graph prepares its inputs. A step with no graph launch (an eager engine) is split by kernel name alone. A
trace without device events (the CPU build) gives the wall time and no components.
"""

from __future__ import annotations

import bisect
import gzip
import json
import logging
import math
import re
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

from wmtp.layout import MANIFEST_FILE, REQUESTS_FILE

STEP = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
HOST_ANNOTATION = "user_annotation"
DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
# A kernel's kind by its name, first match first: FlashAttention and FlashInfer for full attention, the Gated
# DeltaNet's recurrent and convolution kernels, the fused MoE's experts and routing, the dense GEMMs (projections and
# the lm_head). What none claims is "other" (norms, activations, sampling, the plugin's kernels).
COMPONENTS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("attention", re.compile(r"flash|fmha|attn|attention", re.I)),
    ("gated deltanet", re.compile(r"delta_rule|gated_delta|recurrent|causal_conv|conv1d|gdn", re.I)),
    ("moe", re.compile(r"moe|expert|topk|align_block", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|matmul", re.I)),
    ("memory", re.compile(r"memcpy|memset", re.I)),
)
OTHER = "other"
# The components of a step whose target and drafter run in CUDA graphs, in the order of a cycle.
TARGET_PARTS = {"attention": "target_attn", "gated deltanet": "target_gdn", "moe": "target_moe"}
STEP_COMPONENTS = (
    "step_prep", "target_attn", "target_gdn", "target_moe", "target_other", "lm_head", "sampling", "draft_attn",
    "draft_other", "unattributed",
)  # fmt: skip
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
log = logging.getLogger(__name__)
COLUMNS = ["trace", "steps", "tokens_per_step", "wall_us", "device_busy_us", "device_idle_us", "component", "us"]
# What a traced request's rows also carry: its cell, context and GPU, and each component's byte floor.
TABLE_COLUMNS = ["cell_id", "rung", "gpu", *COLUMNS, "floor_us"]


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


@dataclass(frozen=True)
class _Launch:
    step: int  # the engine step whose host work enqueued it (-1: before the first traced step)
    at: float  # host time of the call
    graph: bool  # a CUDA-graph launch


def _launches(events: Sequence[Mapping[str, Any]], step_starts: Sequence[float]) -> dict[Any, _Launch]:
    """Each launch call by its correlation id, with the step it belongs to: the last step started before it (the
    drafter's forwards run after the step's own annotation ends, before the next one starts)."""
    launches = {}
    for e in events:
        correlation = (e.get("args") or {}).get("correlation")
        if e.get("cat") in LAUNCH_CATEGORIES and correlation is not None:
            at = float(e["ts"])
            step = bisect.bisect_right(step_starts, at) - 1
            launches[correlation] = _Launch(step, at, "GraphLaunch" in str(e.get("name", "")))
    return launches


def component_in_step(kernel: str, launch: _Launch | None, graph_launches: Sequence[float]) -> str:
    """The step component a device event is counted under, from the call that enqueued it and the times of its step's
    graph launches (in order); by name alone where the step launched no graph."""
    kind = component_of(kernel)
    if launch is None or launch.step < 0:
        return "unattributed"
    if not graph_launches:
        return kind
    target = graph_launches[0]
    if launch.at < target:
        return "step_prep"
    if launch.graph and launch.at == target:
        return TARGET_PARTS.get(kind, "target_other")
    if kind == "attention":
        return "draft_attn"
    if kind == "gemm" and not launch.graph:
        return "lm_head"
    if len(graph_launches) < 2 or launch.at < graph_launches[1]:
        return "sampling"
    return "draft_other"


def cycle_breakdown(events: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One traced decode: its steps, tokens per step, wall, device busy and idle time per step (µs), and each
    component's device time per step."""
    steps = decode_steps(events)
    if not steps:
        raise TraceError("the trace holds no engine step")
    start = float(steps[0]["ts"])
    step_starts = [float(s["ts"]) for s in steps]
    launches = _launches(events, step_starts)
    graph_launches: dict[int, list[float]] = {}
    for launch in sorted(launches.values(), key=lambda item: item.at):
        if launch.graph:
            graph_launches.setdefault(launch.step, []).append(launch.at)
    # A kernel the untraced step before launched can still run when the trace starts: only its part inside counts.
    device = [
        (str(e.get("name", "")), (e.get("args") or {}).get("correlation"), max(float(e["ts"]), start),
         float(e["ts"]) + float(e["dur"]))
        for e in events
        if e.get("cat") in DEVICE_CATEGORIES and "dur" in e and float(e["ts"]) + float(e["dur"]) > start
    ]  # fmt: skip
    end = max([float(s["ts"]) + float(s["dur"]) for s in steps] + [stop for *_, stop in device])
    n = len(steps)
    tokens = [int(STEP.fullmatch(str(s["name"])).group(4)) for s in steps]  # type: ignore[union-attr]
    busy = union_us((begin, stop) for *_, begin, stop in device)
    components: dict[str, float] = {}
    for kernel, correlation, begin, stop in device:
        launch = launches.get(correlation) if correlation is not None else None
        # A trace without correlation ids (no launch calls recorded) is split by name alone.
        if not launches:
            name = component_of(kernel)
        else:
            name = component_in_step(kernel, launch, graph_launches.get(launch.step, []) if launch else [])
        components[name] = components.get(name, 0.0) + (stop - begin) / n
    return {
        "steps": n,
        "tokens_per_step": sum(tokens) / n,
        "wall_us": (end - start) / n,
        "device_busy_us": busy / n,
        "device_idle_us": (end - start - busy) / n,
        "components": dict(sorted(components.items())),
    }


# Host calls that wait for the device, and the calls that start device work, by their CUDA runtime or driver names.
WAITS = frozenset(
    {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cuStreamSynchronize"}
)
LAUNCHES = frozenset(
    {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch"}
)


def host_device_summary(events: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What a trace of whole requests holds, engine-agnostic: its device span and busy time, how many kernels ran and
    how many launches, graph replays and host waits the host made and how long they took, the host's PyTorch
    operations by name (how many, and their time), and its annotated ranges (``annotation_times``). Two arms that
    answer the same tokens compare directly: what one adds shows here."""
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e]
    if not device:
        raise TraceError("the trace holds no device events (was the GPU activity recorded?)")
    intervals = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in device]
    span = max(end for _, end in intervals) - min(start for start, _ in intervals)
    runtime = [e for e in events if e.get("cat") in LAUNCH_CATEGORIES]
    ops, op_us = Counter(), Counter()
    for e in events:
        if e.get("cat") == "cpu_op":
            ops[str(e.get("name", ""))] += 1
            op_us[str(e.get("name", ""))] += float(e.get("dur", 0.0))
    return {
        "device_span_us": span,
        "device_busy_us": union_us(intervals),
        "kernels": sum(1 for e in device if e.get("cat") == "kernel"),
        "launches": sum(1 for e in runtime if e.get("name") in LAUNCHES),
        "launch_us": sum(float(e.get("dur", 0.0)) for e in runtime if e.get("name") in LAUNCHES),
        "graph_launches": sum(1 for e in runtime if e.get("name") == "cudaGraphLaunch"),
        "host_waits": sum(1 for e in runtime if e.get("name") in WAITS),
        "host_wait_us": sum(float(e.get("dur", 0.0)) for e in runtime if e.get("name") in WAITS),
        "cpu_ops": dict(sorted(ops.items(), key=lambda item: (-item[1], item[0]))),
        "cpu_op_us": dict(sorted(op_us.items(), key=lambda item: (-item[1], item[0]))),
        "annotations": annotation_times(events),
    }


def annotation_times(events: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per name of the host's annotated ranges (an engine's own ``record_function`` spans: a step, a draft, a
    verify): how many, their median and total length, and the median time from one's start to the next's, the
    period at which the engine repeats it (None for a range entered once). A range the engine enters once a cycle has
    the cycle as its period, on the process's own clock."""
    starts: dict[str, list[float]] = {}
    lengths: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") != HOST_ANNOTATION or "dur" not in e:
            continue
        name = str(e.get("name", ""))
        starts.setdefault(name, []).append(float(e["ts"]))
        lengths.setdefault(name, []).append(float(e["dur"]))
    out: dict[str, dict[str, float | None]] = {}
    for name in sorted(starts):
        ordered = sorted(starts[name])
        gaps = [later - earlier for earlier, later in pairwise(ordered)]
        out[name] = {
            "n": len(ordered),
            "median_us": statistics.median(lengths[name]),
            "total_us": sum(lengths[name]),
            "median_period_us": statistics.median(gaps) if gaps else None,
        }
    return out


def read_trace(path: Path) -> list[Mapping[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return json.load(handle)["traceEvents"]


def trace_rows(name: str, breakdown: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Tidy rows of one trace: one per component (one row "none" where the trace has no device events)."""
    common = {key: breakdown[key] for key in COLUMNS[1:6]}
    components = breakdown["components"] or {"none": 0.0}
    return [{"trace": name, **common, "component": c, "us": us} for c, us in components.items()]


def component_floors_us(manifest: Mapping[str, Any], context: int) -> dict[str, float]:
    """Each component's byte floor (µs) for one request of the cell at ``context`` tokens: the cost model's bytes
    for the cell's checkpoint at the GPU's measured bandwidth; empty where either is unknown (a CPU)."""
    from wmtp.analyze.floor import cycle_component_bytes
    from wmtp.analyze.tidy import cell_cost

    cost = cell_cost(dict(manifest))
    if cost is None or cost.spec is None:
        return {}
    parts = cycle_component_bytes(cost.spec, context, cost.k, cost.arm, sink=cost.sink, window=cost.window)
    return {name: 1e6 * value / cost.bandwidth for name, value in parts.items()}


def cell_trace_table(cell_dirs: Iterable[Path]) -> list[dict[str, Any]]:
    """Every measured request's traces in these raw cell folders, as tidy rows (``TABLE_COLUMNS``)."""
    import pandas as pd

    rows: list[dict[str, Any]] = []
    for cell_dir in cell_dirs:
        requests = pd.read_parquet(cell_dir / REQUESTS_FILE)
        if "profile_traces" not in requests:
            raise TraceError(f"{cell_dir}: its requests were not profiled (no profile_traces column)")
        manifest = json.loads((cell_dir / MANIFEST_FILE).read_text())
        gpu = (manifest.get("gpu_at_start") or {}).get("gpu_name")
        for request in requests[~requests["warmup"]].itertuples():
            names = list(request.profile_traces) if request.profile_traces is not None else []
            if not names:
                log.warning(
                    "%s: a request at rung %d left no trace (it ended before the engine's skipped and traced steps)",
                    cell_dir, request.rung,
                )  # fmt: skip
            floors = component_floors_us(manifest, int(request.rung))
            for name in names:
                breakdown = cycle_breakdown(read_trace(cell_dir / name))
                for row in trace_rows(str(name), breakdown):
                    floor = floors.get(row["component"], math.nan)
                    where = {"cell_id": request.cell_id, "rung": request.rung, "gpu": gpu}
                    rows.append({**where, **row, "floor_us": floor})
    return rows
