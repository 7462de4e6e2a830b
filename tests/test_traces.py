"""A traced decode cycle split into device time per component, host-bound idle time and wall time per step."""

from __future__ import annotations

import pytest

from wmtp.analyze.traces import TraceError, component_of, cycle_breakdown, host_device_summary, trace_rows, union_us


def _step(ts: float, dur: float, tokens: int = 4, prefills: int = 0) -> dict:
    name = f"execute_context_{prefills}({prefills * 100})_generation_1({tokens})"
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur}


def _kernel(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_kernels_are_counted_under_the_component_their_name_says():
    assert component_of("void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<256, 64>>") == "attention"
    assert component_of("fused_recurrent_gated_delta_rule_fwd_kernel") == "gated deltanet"
    assert component_of("_causal_conv1d_update_kernel") == "gated deltanet"
    assert component_of("fused_moe_kernel") == "moe"
    assert component_of("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT") == "gemm"
    assert component_of("Memcpy DtoD (Device -> Device)") == "memory"
    assert component_of("triton_red_fused_rms_norm_0") == "other"


def test_overlapping_device_events_count_once():
    assert union_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert union_us([]) == 0


def test_a_cycle_splits_into_components_busy_and_idle_per_step():
    # Two steps on the host, 0-100 and 100-200; the second step's kernels run until 260 (the device lags the host).
    events = [
        _step(0, 100),
        _step(100, 100),
        _kernel("flash_fwd_kernel", 10, 40),
        _kernel("fused_moe_kernel", 40, 30),  # overlaps the attention kernel by 10 µs (another stream)
        _kernel("flash_fwd_kernel", 150, 60),
        _kernel("nvjet_gemm", 230, 30),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 5, "dur": 50},  # host work: not device time
        # Launched before the trace: 5 of its 15 µs fall inside it, the rest is the untraced step's.
        _kernel("fused_moe_kernel", -10, 15),
        # The same annotation on the device's timeline, as a GPU trace records it: not a step of its own.
        {**_step(12, 60), "cat": "gpu_user_annotation"},
    ]
    out = cycle_breakdown(events)
    assert out["steps"] == 2 and out["tokens_per_step"] == 4
    assert out["wall_us"] == 130  # (260 - 0) / 2
    assert out["device_busy_us"] == (5 + 60 + 60 + 30) / 2
    assert out["device_idle_us"] == (260 - 155) / 2
    assert out["components"] == {"attention": 50.0, "gemm": 15.0, "moe": 17.5}
    rows = trace_rows("t.json", out)
    assert [r["component"] for r in rows] == ["attention", "gemm", "moe"] and rows[0]["wall_us"] == 130


def test_a_trace_that_caught_a_prefill_or_no_step_is_refused():
    with pytest.raises(TraceError, match="prefills: the profiler started before the prefill ended"):
        cycle_breakdown([_step(0, 100, prefills=1), _step(100, 50)])
    with pytest.raises(TraceError, match="no engine step"):
        cycle_breakdown([_kernel("flash_fwd_kernel", 0, 10)])


def _launch(name: str, ts: float, correlation: int) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": 1, "args": {"correlation": correlation}}


def _launched(name: str, ts: float, dur: float, correlation: int) -> dict:
    return {**_kernel(name, ts, dur), "args": {"correlation": correlation}}


def test_kernels_are_counted_by_the_launch_that_enqueued_them():
    # One traced step as vLLM runs a drafting arm: inputs copied, the target's full graph, its lm_head and the
    # sampler, then the drafter's forwards, each a piecewise graph with its attention launched outside it.
    events = [
        _step(0, 50),
        _launch("cudaMemcpyAsync", 5, 1),
        _launch("cudaGraphLaunch", 10, 2),
        _launch("cuLaunchKernelEx", 20, 3),
        _launch("cudaLaunchKernel", 22, 4),
        _launch("cudaGraphLaunch", 30, 5),
        _launch("cudaLaunchKernelExC", 32, 6),
        _launch("cudaGraphLaunch", 34, 7),
        _launch("cuLaunchKernelEx", 36, 8),
        _launch("cudaLaunchKernel", 38, 9),
        _launched("Memcpy HtoD (Pinned -> Device)", 6, 1, 1),
        # The target's graph: its attention, recurrent, MoE and dense kernels.
        _launched("flash_fwd_splitkv_kernel", 12, 40, 2),
        _launched("fused_sigmoid_gating_delta_rule_update_kernel", 52, 3, 2),
        _launched("fused_moe_kernel", 55, 20, 2),
        _launched("nvjet_sm90_tst_64x8", 75, 10, 2),
        _launched("nvjet_sm90_tst_512x8", 85, 8, 3),  # the target's lm_head, outside the graph
        _launched("rejection_greedy_sample_kernel", 93, 2, 4),
        _launched("nvjet_sm90_tst_64x8", 95, 4, 5),  # the draft's projections, in its piecewise graph
        _launched("flash_fwd_splitkv_kernel", 99, 6, 6),
        _launched("fused_moe_kernel", 105, 5, 7),
        _launched("nvjet_sm90_tst_512x8", 110, 8, 8),  # the draft's lm_head
        _launched("reduce_kernel", 118, 1, 9),  # its argmax
        _kernel("flash_fwd_kernel", 120, 2),  # no launch recorded for it
    ]
    out = cycle_breakdown(events)
    assert out["components"] == {
        "draft_attn": 6.0,
        "draft_other": 10.0,  # the draft's graphs' kernels and its argmax
        "lm_head": 16.0,
        "sampling": 2.0,
        "step_prep": 1.0,
        "target_attn": 40.0,
        "target_gdn": 3.0,
        "target_moe": 20.0,
        "target_other": 10.0,
        "unattributed": 2.0,
    }


def test_a_step_without_a_graph_launch_is_split_by_kernel_name():
    events = [
        _step(0, 50),
        _launch("cudaLaunchKernel", 5, 1),
        _launch("cudaLaunchKernel", 6, 2),
        _launched("flash_fwd_kernel", 10, 5, 1),
        _launched("fused_moe_kernel", 15, 5, 2),
    ]
    assert cycle_breakdown(events)["components"] == {"attention": 5.0, "moe": 5.0}


def test_a_failing_trace_table_says_why_in_its_rules_log(tmp_path):
    """Every rule's log is where its job says why it failed: an unexpected error's traceback lands there too."""
    from wmtp.cli import main

    cell = tmp_path / "cell"
    cell.mkdir()  # a cell folder without its requests
    log_file = tmp_path / "traces.log"
    with pytest.raises(FileNotFoundError):
        main(["--log", str(log_file), "trace-table", str(cell), "--out", str(tmp_path / "traces.csv")])
    text = log_file.read_text()
    assert "wmtp trace-table failed" in text and "Traceback" in text and "requests.parquet" in text
    assert not (tmp_path / "traces.csv").exists()


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
    assert summary["cpu_op_us"] == {"aten::sub": 2.0, "aten::gather": 1.0}
    assert (summary["launch_us"], summary["host_wait_us"]) == (2.0, 9.0)  # cudaMemcpyAsync neither launches nor waits
    with pytest.raises(TraceError, match="no device events"):
        host_device_summary([e for e in events if e["cat"] != "kernel" and e["cat"] != "gpu_memcpy"])


def test_annotated_ranges_give_their_lengths_and_the_period_at_which_the_engine_repeats_them():
    # A "draft" range every 7 ms, the last one 2 ms late; a "verify" once; the device's own annotations are not the
    # host's.
    ranges = [("draft", 23_000.0, 3_000.0), ("draft", 0.0, 1_000.0), ("draft", 7_000.0, 2_000.0)]
    ranges += [("draft", 14_000.0, 1_000.0), ("verify", 1_000.0, 500.0)]
    events = [{"cat": "user_annotation", "name": name, "ts": ts, "dur": dur} for name, ts, dur in ranges]
    events += [{"cat": "gpu_user_annotation", "name": "draft", "ts": 3.0, "dur": 99_999.0}]
    events += [{"cat": "kernel", "name": "k", "ts": 0.0, "dur": 1.0}]
    times = host_device_summary(events)["annotations"]
    assert times["draft"] == {"n": 4, "median_us": 1_500.0, "total_us": 7_000.0, "median_period_us": 7_000.0}
    assert times["verify"] == {"n": 1, "median_us": 500.0, "total_us": 500.0, "median_period_us": None}
    assert set(times) == {"draft", "verify"}
