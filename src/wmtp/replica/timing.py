"""Timing on CUDA: pieces captured in CUDA graphs and replayed, each replay timed with CUDA events.

On CPU (the test path) pieces run eagerly and are timed with the host clock.  An optional L2
scrub before each replay keeps a piece from reading what the previous replay left in cache.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from wmtp.replica.kernels import torch


@dataclass
class Timings:
    """Per-replay times (ms) of one piece."""

    name: str
    ms: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.ms)

    def q(self, f: float) -> float:
        s = sorted(self.ms)
        return s[min(len(s) - 1, max(0, round(f * (len(s) - 1))))]


def is_cuda(device: str) -> bool:
    """Whether ``device`` names a CUDA device."""
    return torch.device(device).type == "cuda"


def sync(device: str) -> None:
    if is_cuda(device):
        torch.cuda.synchronize()


def sm_count(device: str) -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if is_cuda(device) else 132


def free_bytes(device: str) -> int:
    return torch.cuda.mem_get_info()[0] if is_cuda(device) else 1 << 40


def empty_cache(device: str) -> None:
    if is_cuda(device):
        torch.cuda.empty_cache()


class GraphTimer:
    """Capture a callable in a CUDA graph (or run eagerly) and time replays with CUDA events.

    On CPU (the test path) it runs eagerly and times with the host clock.
    """

    def __init__(self, use_graphs: bool = True, scrub_bytes: int = 256 << 20, device: str = "cuda"):
        self.device = device
        self.cuda = is_cuda(device)
        self.use_graphs = use_graphs and self.cuda
        self.scrub = torch.empty((scrub_bytes if self.cuda else 1 << 20) // 4, device=device, dtype=torch.float32)

    def _scrub(self) -> None:
        self.scrub.fill_(1.0)

    def time(self, fn: Callable[[], Any], reps: int, warmup: int = 3, scrub: bool = False) -> list[float]:
        def body() -> None:
            if scrub:
                self._scrub()
            fn()

        if not self.cuda:
            body()
            out = []
            for _ in range(reps):
                t = time.perf_counter()
                body()
                out.append((time.perf_counter() - t) * 1e3)
            return out
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                body()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        run: Callable[[], Any]
        graph = None
        if self.use_graphs:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                body()
            run = graph.replay
        else:
            run = body
        for _ in range(warmup):
            run()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for i in range(reps):
            starts[i].record()
            run()
            ends[i].record()
        torch.cuda.synchronize()
        out = [a.elapsed_time(b) for a, b in zip(starts, ends, strict=True)]
        del graph
        return out


def copy_bandwidth(n_bytes: int = 4 << 30, reps: int = 20, device: str = "cuda") -> dict[str, float]:
    """Device-to-device copy: (read + write bytes) / time, median of reps."""
    if not is_cuda(device):
        n_bytes = min(n_bytes, 64 << 20)
    src = torch.empty(n_bytes // 2, device=device, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    timer = GraphTimer(use_graphs=False, device=device)
    ms = timer.time(partial(dst.copy_, src), reps)
    med = statistics.median(ms)
    del src, dst
    empty_cache(device)
    return {"bytes": 2.0 * n_bytes, "median_ms": med, "bandwidth": 2.0 * n_bytes / (med * 1e-3), "reps": reps}


def stats(name: str, ms: list[float]) -> dict[str, float]:
    """Median, 10 % and 90 % quantiles and count of per-replay times."""
    t = Timings(name, ms)
    return {"median_ms": t.median, "p10_ms": t.q(0.1), "p90_ms": t.q(0.9), "reps": len(ms)}


def noop() -> None:
    return None
