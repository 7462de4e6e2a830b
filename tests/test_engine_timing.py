"""Timing by the engine's clock, the byte-floor screen, and the step file over several servers (pure functions)."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from wmtp.analyze import costmodel
from wmtp.analyze.steps import server_ratio, step_table
from wmtp.analyze.tidy import apply_engine_clock, byte_floor_ms, screen_requests
from wmtp.layout import TRAINED_CHECKPOINT
from wmtp.measure import cell


def _clocked(**overrides) -> dict:
    row = {
        "ttft_s": 9.0,  # the client's: its first chunk came late
        "decode_s": 0.5,
        "completion_tokens": 101,
        "d_clock_requests": 1.0,
        "d_clock_decode_s": 1.0,
        "d_clock_prefill_s": 4.0,
        "d_clock_queue_s": 0.01,
        "d_clock_generation_tokens": 101.0,
    }
    return {**row, **overrides}


def test_the_engine_clock_replaces_the_clients_where_it_counted_exactly_that_request():
    frame = pd.DataFrame([_clocked(), _clocked(d_clock_requests=2.0), _clocked(d_clock_generation_tokens=50.0)])
    apply_engine_clock(frame)
    assert list(frame["clock"]) == ["engine", "client", "client"]
    assert frame.loc[0, "decode_s"] == 1.0 and frame.loc[0, "ttft_s"] == pytest.approx(4.01)
    assert frame.loc[0, "clock_disagreement"] == pytest.approx(-0.5)
    # two requests counted, or other tokens: not this request's figures, so the client's stand
    assert list(frame.loc[1:, "decode_s"]) == [0.5, 0.5] and list(frame.loc[1:, "ttft_s"]) == [9.0, 9.0]
    assert list(frame["client_decode_s"]) == [0.5] * 3


def test_without_clock_columns_every_row_is_the_clients():
    frame = pd.DataFrame([{"ttft_s": 1.0, "decode_s": 2.0, "completion_tokens": 10}])
    apply_engine_clock(frame)
    assert frame.loc[0, "clock"] == "client" and frame.loc[0, "decode_s"] == 2.0
    assert math.isnan(frame.loc[0, "clock_disagreement"])


def _manifest(gpu: str | None, arm: str = "none") -> dict:
    config = json.loads((TRAINED_CHECKPOINT / "config.json").read_text())
    return {
        "cell": {"arm": arm, "k": 3, "sink": 16, "window": 256},
        "model_config": config,
        "gpu_at_start": {"gpu_name": gpu},
    }


def test_a_cycles_byte_floor_needs_a_device_of_known_bandwidth():
    floor, bandwidth = byte_floor_ms(_manifest("NVIDIA H200"), 4096)
    assert bandwidth == costmodel.MEASURED_READ_BANDWIDTH["H200"] and 0 < floor < 1
    # more context, more KV to read; a native draft reads more than a windowed one
    assert byte_floor_ms(_manifest("NVIDIA H200"), 16384)[0] > floor
    assert (
        byte_floor_ms(_manifest("NVIDIA H200", "mtp"), 16384)[0]
        > byte_floor_ms(_manifest("NVIDIA H200", "wmtp"), 16384)[0]
    )
    assert all(math.isnan(v) for v in byte_floor_ms(_manifest(None), 4096))
    assert all(math.isnan(v) for v in byte_floor_ms(_manifest("AMD EPYC 9V45"), 4096))


def test_a_cycle_below_its_byte_floor_is_screened_and_named():
    base = {"rung": 1048576, "k": 0, "arm": "none", "completion_tokens": 128, "floor_ms": 6.35}
    frame = pd.DataFrame(
        [
            {**base, "decode_s": 127 * 11.3e-3, "ttft_s": 150.0},  # the engine's clock: above the floor
            {**base, "decode_s": 127 * 6.22e-3, "ttft_s": 150.0},  # a late first chunk: below it
        ]
    )
    screened = screen_requests(frame)
    assert list(screened["excluded"]) == [False, True]
    assert screened.loc[1, "exclusion"] == "cycle 6.22 ms below its byte floor 6.35 ms"
    assert screened.loc[0, "over_floor"] == pytest.approx(11.3 / 6.35)
    assert math.isnan(screened.loc[1, "ttft_s"])


def test_a_drafting_request_its_cell_did_not_count_is_timed_at_its_rungs_tokens_per_cycle():
    """Two requests at once share the counters: each is timed at its rung's pooled count. A token every 3 ms at 3
    tokens a cycle is a 9 ms cycle, above its 6 ms floor; timed at one token a cycle it would read 3 ms and be
    screened out. At 1.5 tokens a cycle the same rate is a 4.5 ms cycle, below it."""
    base = {"rung": 131072, "k": 3, "arm": "mtp", "completion_tokens": 128, "floor_ms": 6.0, "ttft_s": 20.0}
    frame = pd.DataFrame([{**base, "decode_s": 127 * 3e-3}, {**base, "decode_s": 127 * 3e-3}])
    screened = screen_requests(frame, pd.Series([3.0, 1.5]))
    assert list(screened["request_cycle_ms"]) == pytest.approx([9.0, 4.5])
    assert list(screened["excluded"]) == [False, True]
    assert screened.loc[1, "exclusion"] == "cycle 4.5 ms below its byte floor 6 ms"
    # without the rung's count a drafting request has no cycle to set against its floor
    assert not screen_requests(frame)["excluded"].any()


def _request(server: int, arm: str, rung: int, step_ms: float, floor_ms: float, started: str = "") -> dict:
    windowed = arm == "wmtp"
    cell_id = f"m/{arm}/server~{server}"
    return {
        "cell_id": cell_id,
        "server_started_at": started,
        "arm": arm,
        "k": 0 if arm == "none" else 3,
        "sink": 16 if windowed else None,
        "window": 4096 if windowed else None,
        "concurrency": 1,
        "workload": "code",
        "rung": rung,
        "decode_s": 100 * step_ms / 1e3,
        "client_decode_s": 90 * step_ms / 1e3,
        "completion_tokens": 101,
        "ttft_s": 4.0,
        "excluded": False,
        "clock": "engine",
        "floor_ms": floor_ms,
        "gpu_name": "NVIDIA H200",
        "wmtp_revision": "abc (told)",
        "plugin_sha256": "0123",
    }


def test_the_step_file_takes_the_median_of_server_medians_with_their_spread_and_the_ratio_its_range():
    rows = []
    for server, (mtp, wmtp) in enumerate([(10.0, 9.0), (11.0, 10.0), (12.0, 9.5)], start=1):
        rows += [_request(server, "mtp", 131072, mtp, 4.3), _request(server, "wmtp", 131072, wmtp, 4.2)]
    rows += [_request(1, "mtp", 1048576, 17.0, 10.0), _request(1, "wmtp", 1048576, 15.0, 8.5)]
    requests = pd.DataFrame(rows)
    rungs = requests[["cell_id", "workload", "rung"]].drop_duplicates().assign(tok_per_verify=1.0)
    table = step_table(requests, rungs, "0.24.0")
    mtp = table[(table["arm"] == "mtp") & (table["context"] == 131072)].iloc[0]
    assert mtp["servers"] == 3 and mtp["n"] == 3 and mtp["server_step_ms"] == "10.000;11.000;12.000"
    assert mtp["step_ms"] == pytest.approx(11.0) and mtp["server_spread"] == pytest.approx(0.2)
    # the client saw 90 % of each decode window: its cycle beside the engine's
    assert mtp["client_step_ms"] == pytest.approx(9.9) and mtp["clock"] == "engine"
    assert mtp["over_floor"] == pytest.approx(11.0 / 4.3)
    assert (mtp["wmtp_revision"], mtp["plugin_sha256"]) == ("abc (told)", "0123")
    # growth between contexts within the one server that measured both (17 - 10, not the medians' 17 - 11), beside
    # the least its extra bytes allow at the peak bandwidth
    longer = table[(table["arm"] == "mtp") & (table["context"] == 1048576)].iloc[0]
    assert longer["growth_ms"] == pytest.approx(7.0) and longer["growth_servers"] == 1
    assert longer["growth_floor_ms"] == pytest.approx((10.0 - 4.3) * 4.33 / 4.8)
    ratio = server_ratio(table, "mtp", "wmtp", k=3)
    at_128k = ratio[ratio["context"] == 131072].iloc[0]
    assert at_128k["ratio"] == pytest.approx(11.0 / 9.5)
    assert (at_128k["ratio_lo"], at_128k["ratio_hi"]) == pytest.approx((10.0 / 10.0, 12.0 / 9.0))
    assert not at_128k["resolved"] and at_128k["servers"] == "3/3"
    at_1m = ratio[ratio["context"] == 1048576].iloc[0]
    assert at_1m["ratio_lo"] == at_1m["ratio_hi"] == pytest.approx(17.0 / 15.0) and at_1m["resolved"]


def test_servers_on_one_gpu_give_the_ratio_without_the_machines_spread():
    """Two GPUs: the first slower for mtp than the second. Over every pairing the ratio's range holds 1; over the
    pairings on one GPU (mtp and wmtp side by side) it does not."""
    gpus = {1: "GPU-18254e42-c8c8", 2: "GPU-18254e42-c8c8", 3: "GPU-cf466104-12f8"}
    cycles = {1: (11.7, None), 2: (10.5, None), 3: (9.1, 8.9)}
    rows = [
        {**_request(server, arm, 131072, ms, 4.3), "gpu_uuid": gpus[server]}
        for server, pair in cycles.items()
        for arm, ms in zip(("mtp", "wmtp"), pair, strict=True)
        if ms is not None
    ]
    rows.append({**_request(4, "wmtp", 131072, 11.0, 4.3), "gpu_uuid": gpus[1]})
    requests = pd.DataFrame(rows)
    rungs = requests[["cell_id", "workload", "rung"]].drop_duplicates().assign(tok_per_verify=1.0)
    table = step_table(requests, rungs, "0.24.0")
    mtp = table[table["arm"] == "mtp"].iloc[0]
    assert mtp["server_gpus"] == "18254e42;18254e42;cf466104" and mtp["gpus"] == 2
    ratio = server_ratio(table, "mtp", "wmtp").iloc[0]
    assert ratio["ratio_lo"] < 1 < ratio["ratio_hi"]
    # one GPU: 11.7 / 11.0 and 10.5 / 11.0 on the first, 9.1 / 8.9 on the second
    assert ratio["same_gpu_pairs"] == 3 and ratio["same_gpu_servers"] == "3/2"
    assert (ratio["same_gpu_lo"], ratio["same_gpu_hi"]) == pytest.approx((10.5 / 11.0, 11.7 / 11.0))
    assert ratio["same_gpu"] == pytest.approx(9.1 / 8.9)


def test_a_step_file_without_gpus_has_no_same_gpu_ratio():
    rows = [_request(1, "mtp", 131072, 10.0, 4.3), _request(1, "wmtp", 131072, 9.0, 4.3)]
    requests = pd.DataFrame(rows)
    rungs = requests[["cell_id", "workload", "rung"]].drop_duplicates().assign(tok_per_verify=1.0)
    table = step_table(requests, rungs, "0.24.0")
    assert set(table["gpus"]) == {0}
    ratio = server_ratio(table, "mtp", "wmtp").iloc[0]
    assert ratio["same_gpu_pairs"] == 0 and math.isnan(ratio["same_gpu"])


def test_a_revision_told_wins_over_a_copys_git(monkeypatch):
    monkeypatch.setenv(cell.REVISION_ENV, "a6ac412")
    assert cell.git_revision() == "a6ac412 (told)"
    monkeypatch.delenv(cell.REVISION_ENV)
    assert cell.git_revision() != "a6ac412 (told)"


def test_growth_between_contexts_where_no_server_lifetime_measured_both_is_between_medians_and_says_so():
    rows = [_request(server, "mtp", 131072, step, 4.3) for server, step in ((1, 10.0), (2, 12.0), (3, 11.0))]
    # server 3 again, started later: the same cell id, another server lifetime
    rows = [{**row, "server_started_at": "13:58" if row["cell_id"].endswith("~3") else ""} for row in rows]
    rows += [_request(s, "mtp", 524288, step, 6.8, "16:42") for s, step in ((3, 12.5), (4, 12.7), (5, 13.0))]
    rows += [_request(s, "mtp", 1048576, step, 10.0, "16:42") for s, step in ((3, 16.9), (4, 15.5), (5, 17.0))]
    requests = pd.DataFrame(rows)
    rungs = requests[["cell_id", "workload", "rung"]].drop_duplicates().assign(tok_per_verify=1.0)
    table = step_table(requests, rungs, "0.24.0").set_index("context")
    assert table.loc[524288, "growth_ms"] == pytest.approx(12.7 - 11.0) and table.loc[524288, "growth_servers"] == 0
    # servers 3, 4 and 5 grew by 4.4, 2.8 and 4.0 ms: their median, not the medians' difference (16.9 - 12.7)
    assert table.loc[1048576, "growth_ms"] == pytest.approx(4.0) and table.loc[1048576, "growth_servers"] == 3


def test_one_cell_served_twice_at_one_context_is_two_servers_each_with_its_own_tokens_per_cycle():
    rows = [_request(1, "mtp", 131072, 10.0, 4.3, "13:54"), _request(1, "mtp", 131072, 12.0, 4.3, "16:29")]
    requests = pd.DataFrame(rows)
    rungs = requests[["cell_id", "workload", "rung", "server_started_at"]].assign(tok_per_verify=[1.0, 2.0])
    row = step_table(requests, rungs, "0.24.0").iloc[0]
    # the later server decoded two tokens a cycle: its 12 ms a token is a 24 ms cycle
    assert row["servers"] == 2 and row["server_step_ms"] == "10.000;24.000"
