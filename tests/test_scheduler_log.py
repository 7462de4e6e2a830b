# ruff: noqa: E501  (log lines as the engines write them, whole)
"""The paper's iteration statistic from scheduler log lines, in the formats vLLM 0.24 and SGLang write them."""

import json

import pytest

from wmtp.analyze.scheduler_log import iteration_statistic, segments, sglang_lines, vllm_lines
from wmtp.cli import main

VLLM_LOG = """\
(APIServer pid=1117) INFO 12-03 16:33:43 [loggers.py:273] Engine 000: Avg prompt throughput: 10.4 tokens/s, Avg generation throughput: 2.6 tokens/s, Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: 3.7%, Prefix cache hit rate: 0.0%
(APIServer pid=1117) INFO 12-03 16:33:43 [metrics.py:120] SpecDecoding metrics: Mean acceptance length: 1.00, Accepted throughput: 0.00 tokens/s, Drafted throughput: 7.33 tokens/s, Accepted: 0 tokens, Drafted: 90 tokens, Per-position acceptance rate: 0.000, 0.000, 0.000, Avg Draft acceptance rate: 0.0%
(APIServer pid=1117) INFO 12-03 16:33:53 [loggers.py:273] Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 100.0 tokens/s, Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: 9.4%, Prefix cache hit rate: 0.0%
(APIServer pid=1117) INFO 12-03 16:33:53 [metrics.py:120] SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 60.00 tokens/s, Drafted throughput: 120.0 tokens/s, Accepted: 600 tokens, Drafted: 1200 tokens, Per-position acceptance rate: 0.700, 0.500, 0.300, Avg Draft acceptance rate: 50.0%
(APIServer pid=1117) INFO 12-03 16:34:03 [loggers.py:273] Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 200.0 tokens/s, Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: 9.4%, Prefix cache hit rate: 0.0%
(APIServer pid=1117) INFO 12-03 16:34:03 [metrics.py:120] SpecDecoding metrics: Mean acceptance length: 4.00, Accepted throughput: 150.00 tokens/s, Drafted throughput: 150.0 tokens/s, Accepted: 1500 tokens, Drafted: 1500 tokens, Per-position acceptance rate: 1.000, 1.000, 1.000, Avg Draft acceptance rate: 100.0%
(APIServer pid=1117) INFO 12-03 16:34:13 [loggers.py:273] Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 50.0 tokens/s, Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: 9.4%, Prefix cache hit rate: 0.0%
(APIServer pid=1117) INFO 12-03 16:34:23 [loggers.py:273] Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 90.0 tokens/s, Running: 2 reqs, Waiting: 1 reqs, GPU KV cache usage: 9.4%, Prefix cache hit rate: 0.0%
"""

SGLANG_LOG = """\
[2026-12-03 16:00:01] Prefill batch, #new-seq: 1, #new-token: 16384, #cached-token: 0, token usage: 0.01, #running-req: 0, #queue-req: 0,
[2026-12-03 16:00:09] Decode batch, #running-req: 1, #token: 1040100, token usage: 0.40, accept len: 4.49, accept rate: 0.75, cuda graph: True, gen throughput (token/s): 168.16, #queue-req: 0,
[2026-12-03 16:00:10] Decode batch, #running-req: 1, #token: 1040300, token usage: 0.40, accept len: 4.74, accept rate: 0.79, cuda graph: True, gen throughput (token/s): 257.61, #queue-req: 0,
[2026-12-03 16:00:11] Decode batch, #running-req: 1, #token: 1040500, token usage: 0.40, cuda graph: True, gen throughput (token/s): 37.45, #queue-req: 0,
"""


def test_vllm_pairs_each_interval_with_its_acceptance_and_keeps_decode_alone():
    lines = vllm_lines(VLLM_LOG.splitlines())
    assert [line.accept_length for line in lines] == [1.0, 2.5, 4.0, 1.0, 1.0]
    found = iteration_statistic(lines, batch=1)
    # Steady: 2.5/100 = 25 ms, 4/200 = 20 ms, 1/50 = 20 ms; the prefill's interval and the batch of 2 are left out.
    assert found is not None and found.lines == 3
    assert found.iteration_ms == pytest.approx(20.0)
    assert found.mean_accept_length == pytest.approx(2.5)
    assert found.tpot_ms == pytest.approx(8.0)


def test_a_batch_shares_the_throughput_and_a_waiting_request_is_not_steady():
    lines = vllm_lines(VLLM_LOG.splitlines())
    assert iteration_statistic(lines, batch=2) is None
    batch_of_two = vllm_lines([VLLM_LOG.splitlines()[-1].replace("Waiting: 1", "Waiting: 0")])
    assert iteration_statistic(batch_of_two, batch=2).iteration_ms == pytest.approx(2 * 1000 / 90)


def test_sglang_decode_lines_read_with_and_without_a_draft():
    lines = sglang_lines(SGLANG_LOG.splitlines())
    assert [(line.accept_length, line.gen_tokens_per_s) for line in lines] == [
        (4.49, 168.16),
        (4.74, 257.61),
        (1.0, 37.45),
    ]
    found = iteration_statistic(lines[:2], batch=1)
    assert found.iteration_ms == pytest.approx(1000 * (4.49 / 168.16 + 4.74 / 257.61) / 2)


def test_the_command_prints_one_line_per_log(tmp_path, capsys):
    log = tmp_path / "server.log"
    log.write_text(VLLM_LOG)
    empty = tmp_path / "empty.log"
    empty.write_text("")
    assert main(["iteration-statistic", "--engine", "vllm", str(log), str(empty)]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed[0]["iteration_ms"] == pytest.approx(20.0) and printed[0]["lines"] == 3
    assert printed[1] == {"log": str(empty), "batch": 1, "lines": 0}


def _decode(accept: float, gen: float, full: int = 1040100, running: int = 1) -> str:
    return (
        f"[2026-12-03 16:00:09] Decode batch, #running-req: {running}, #full token: {full}, full token usage: 0.40, "
        f"mamba num: 2, mamba usage: 0.01, accept len: {accept:.2f}, accept rate: 0.75, cuda graph: True, "
        f"gen throughput (token/s): {gen:.2f}, #queue-req: 0,"
    )


PREFILL = SGLANG_LOG.splitlines()[0]


def test_the_artifacts_reading_a_ramp_an_empty_pool_and_outliers_are_left_out():
    # After a prefill: two ramp lines (the first reaching back over the prefill), an empty-pool line, a flush-like
    # outlier, then the decode proper at 20 ms an iteration.
    log = [
        PREFILL,
        _decode(4.0, 4.0),
        _decode(6.0, 150.0),
        _decode(1.0, 9000.0, full=0),
        _decode(4.0, 200.0),
        _decode(4.0, 1000.0),
        _decode(5.0, 250.0),
        _decode(3.0, 150.0),
    ]
    lines = sglang_lines(log)
    assert [line.full_tokens for line in lines] == [1040100, 1040100, 0, 1040100, 1040100, 1040100, 1040100]
    found = iteration_statistic(lines, batch=1, ramp=2)
    # Steady and past the ramp: 20, 4 (outside 0.4–2.5 × the median 20), 20, 20 ms; the mean accept length of the
    # three kept lines is 4.
    assert found.lines == 3 and found.iteration_ms == pytest.approx(20.0)
    assert found.mean_accept_length == pytest.approx(4.0) and found.tpot_ms == pytest.approx(5.0)
    # Without the ramp dropped, the band still leaves out the line that reaches back over the prefill (1 s), but the
    # second ramp line (40 ms) is kept and moves the mean accept length.
    unramped = iteration_statistic(lines, batch=1)
    assert unramped.lines == 4 and unramped.mean_accept_length == pytest.approx(4.5)


def test_a_log_splits_into_one_decode_a_request_and_the_command_prints_each(tmp_path, capsys):
    first = [PREFILL, PREFILL, *(_decode(4.0, 200.0) for _ in range(5))]
    second = [PREFILL, *(_decode(2.0, 200.0) for _ in range(5))]
    runs = segments([*first, *second], "sglang")
    assert [len(run) for run in runs] == [5, 5]
    log = tmp_path / "server.log"
    log.write_text("\n".join([*first, *second]) + "\n")
    assert main(["iteration-statistic", "--engine", "sglang", "--segments", str(log)]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [p["segment"] for p in printed] == [0, 1]
    assert [p["iteration_ms"] for p in printed] == pytest.approx([20.0, 10.0])
    assert [p["lines"] for p in printed] == [3, 3]  # two ramp lines dropped from each
    # vLLM: an interval with prompt throughput starts the next request's run.
    assert [len(run) for run in segments(VLLM_LOG.splitlines(), "vllm")] == [5]


def _request(rung: int, ms: float, lines: int = 6, accept: float = 1.0) -> list[str]:
    """One request's log: its prefill, a ramp line reaching back over it, then decode lines at ``ms`` a cycle."""
    ramp = [_decode(accept, 1.0, full=rung + 5)]
    return [PREFILL, *ramp, *(_decode(accept, 1000 * accept / ms, full=rung + 10 + 4 * i) for i in range(lines))]


def test_each_rungs_requests_pool_their_decode_lines_and_warm_ups_are_left_out():
    from wmtp.analyze.scheduler_log import rung_iterations, rung_of

    assert rung_of(4096 + 40, [4096, 16384], 600) == 4096 and rung_of(4000, [4096, 16384], 600) is None
    log = [*_request(64, 3.0, lines=3), *_request(4096, 10.0), *_request(4096, 12.0), *_request(16384, 20.0)]
    found = rung_iterations(log, [4096, 16384], slack=600, ramp=1)
    assert sorted(found) == [4096, 16384]
    # The two 4K requests' lines pooled (6 each once the ramp line is dropped): the median of 10 and 12 ms lines.
    assert found[4096].lines == 12 and found[4096].iteration_ms == pytest.approx(11.0, rel=1e-3)
    assert found[16384].iteration_ms == pytest.approx(20.0) and found[16384].mean_accept_length == pytest.approx(1.0)


def test_the_command_reads_each_sglang_cells_log_beside_its_manifest(tmp_path):
    import pandas as pd

    cells = []
    for engine, arm, ms in (("sglang", "mtp", 10.0), ("sglang", "none", 5.0), ("vllm", "mtp", 9.0)):
        cell_dir = tmp_path / engine / arm
        cell_dir.mkdir(parents=True)
        cell = {"model": "m", "engine": engine, "arm": arm, "k": 3, "concurrency": 1, "server": 1}
        manifest = {
            "cell_id": f"{engine}/{arm}",
            "cell": cell,
            "engine": {"kind": engine},
            "identity": {"protocol": {"rungs": [4096, 16384], "output_tokens": 64}},
        }
        (cell_dir / "manifest.json").write_text(json.dumps(manifest))
        (cell_dir / "server.log").write_text("\n".join([*_request(4096, ms), *_request(16384, 2 * ms)]) + "\n")
        cells.append(str(cell_dir / "manifest.json"))
    out = tmp_path / "scheduler_steps.csv"
    assert main(["scheduler-steps", "--out", str(out), *cells]) == 0
    table = pd.read_csv(out)
    # The vLLM cell gives none: its stats lines count no tokens.
    assert table[["cell_id", "rung"]].values.tolist() == [
        ["sglang/mtp", 4096],
        ["sglang/mtp", 16384],
        ["sglang/none", 4096],
        ["sglang/none", 16384],
    ]
    assert table["iteration_ms"].tolist() == pytest.approx([10.0, 20.0, 5.0, 10.0], rel=1e-3)
