"""A profiler trace of whole requests summed up without knowing the engine: what SGLang's arms are compared by."""

from __future__ import annotations

import pytest

from wmtp.analyze.traces import TraceError, host_device_summary


def test_a_trace_summary_counts_device_time_once_and_every_launch_wait_and_operation():
    events = [
        {"cat": "kernel", "name": "a", "ts": 0.0, "dur": 10.0},
        {"cat": "kernel", "name": "b", "ts": 5.0, "dur": 10.0},  # overlaps a: busy 15, not 20
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 30.0, "dur": 2.0},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0.0, "dur": 1.0},
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 1.0, "dur": 1.0},
        {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 2.0, "dur": 9.0},
        {"cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 3.0, "dur": 1.0},
        {"cat": "cpu_op", "name": "aten::gather", "ts": 0.0, "dur": 1.0},
        {"cat": "cpu_op", "name": "aten::sub", "ts": 1.0, "dur": 1.0},
        {"cat": "cpu_op", "name": "aten::sub", "ts": 2.0, "dur": 1.0},
    ]
    summary = host_device_summary(events)
    assert summary["device_span_us"] == 32.0 and summary["device_busy_us"] == 17.0
    assert (summary["kernels"], summary["launches"], summary["graph_launches"], summary["host_waits"]) == (2, 2, 1, 1)
    assert list(summary["cpu_ops"].items()) == [("aten::sub", 2), ("aten::gather", 1)]
    with pytest.raises(TraceError, match="no device events"):
        host_device_summary([e for e in events if e["cat"] != "kernel" and e["cat"] != "gpu_memcpy"])
