"""The measured step file (wmtp.analyze.steps): one row per shape, from a small synthetic tidy table."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from wmtp.analyze.steps import COLUMNS, request_step_ms, step_table


def _request(cell_id, arm, k, rung, decode_s, completion_tokens=129, ttft_s=10.0, excluded=False, **extra):
    windowed = arm == "wmtp"
    return {
        "cell_id": cell_id,
        "arm": arm,
        "k": k,
        "sink": 16 if windowed else None,
        "window": 4096 if windowed else None,
        "concurrency": 1,
        "workload": "code",
        "rung": rung,
        "decode_s": decode_s,
        "completion_tokens": completion_tokens,
        "ttft_s": ttft_s,
        "excluded": excluded,
        "cell_windowed_forwards": 384.0 if windowed else math.nan,
        "read_sink_tokens": 560.0 if windowed else math.nan,
        "kv_cache_tokens": 2_690_000,
        **extra,
    }


@pytest.fixture
def tidy():
    requests = pd.DataFrame(
        [
            _request("none", "none", 0, 131072, 1.28, ttft_s=9.0),
            _request("none", "none", 0, 131072, 1.36, ttft_s=11.0),
            _request("none", "none", 0, 131072, 0.01, excluded=True),  # screened out: a buffered burst
            _request("mtp3", "mtp", 3, 131072, 2.56),
            _request("mtp3", "mtp", 3, 1048576, 5.12, ttft_s=200.0),
            _request("wmtp3", "wmtp", 3, 131072, 2.048),
        ]
    )
    rungs = pd.DataFrame(
        [
            {"cell_id": "none", "workload": "code", "rung": 131072, "tok_per_verify": 1.0},
            {"cell_id": "mtp3", "workload": "code", "rung": 131072, "tok_per_verify": 1.0},
            {"cell_id": "mtp3", "workload": "code", "rung": 1048576, "tok_per_verify": 1.25},
            {"cell_id": "wmtp3", "workload": "code", "rung": 131072, "tok_per_verify": 1.0},
        ]
    )
    return requests, rungs


def test_one_row_per_shape_with_the_cycle_time_its_spread_and_n(tidy):
    table = step_table(*tidy, engine_version="0.24.0")
    assert list(table.columns) == COLUMNS
    assert list(zip(table["arm"], table["k"], table["context"], strict=True)) == [
        ("none", 0, 131072),
        ("mtp", 3, 131072),
        ("mtp", 3, 1048576),
        ("wmtp", 3, 131072),
    ]
    none = table.iloc[0]
    # 128 decoded tokens after the first, one per cycle: 1.28 s and 1.36 s → 10 ms and 10.625 ms.
    assert none["n"] == 2 and none["step_ms"] == pytest.approx(10.3125)
    assert (none["step_ms_min"], none["step_ms_max"]) == pytest.approx((10.0, 10.625))
    assert none["ttft_s"] == pytest.approx(10.0) and (none["ttft_s_min"], none["ttft_s_max"]) == (9.0, 11.0)
    assert pd.isna(none["S"]) and math.isnan(none["windowed_forwards"])
    # 1.25 tokens per cycle: 128 tokens took 102.4 cycles of 50 ms.
    assert table.iloc[2]["step_ms"] == pytest.approx(50.0) and table.iloc[2]["tokens_per_cycle"] == 1.25
    wmtp = table.iloc[3]
    assert (wmtp["S"], wmtp["W"], wmtp["windowed_forwards"], wmtp["read_sink_tokens"]) == (16, 4096, 384, 560)
    assert set(table["engine_version"]) == {"0.24.0"} and set(table["batch"]) == {1}


def test_a_request_without_a_decoded_token_has_no_step():
    assert math.isnan(request_step_ms(1.0, 1, 1.0))
    assert math.isnan(request_step_ms(0.0, 10, 1.0))
    assert request_step_ms(0.9, 10, 1.0) == pytest.approx(100.0)


def test_the_cli_writes_the_csv_from_tidy_folders(tidy, tmp_path):
    from wmtp.cli import main

    requests, rungs = tidy
    for rung in (131072, 1048576):
        folder = tmp_path / f"rung~{rung}"
        folder.mkdir()
        requests[requests["rung"] == rung].to_parquet(folder / "requests.parquet")
        rungs[rungs["rung"] == rung].to_parquet(folder / "rungs.parquet")
    out = tmp_path / "out" / "vllm_qwen3.6-35b-a3b.csv"
    folders = [str(tmp_path / f"rung~{r}") for r in (131072, 1048576)]
    assert main(["step-table", "--tidy", *folders, "--engine-version", "0.24.0", "--out", str(out)]) == 0
    written = pd.read_csv(out)
    assert len(written) == 4 and list(written.columns) == COLUMNS


def test_a_cell_study_narrowed_to_one_rung_keeps_that_rungs_repeats(repo, capsys):
    from wmtp.cli import main

    cell = "model~qwen3.6-35b-a3b/engine~vllm/arm~wmtp/k~3/s~16/w~4096/c~1/server~2"
    config = str(repo / "config" / "studies" / "h200-vllm.yaml")
    assert main(["cell-study", "--config", config, "--cell", cell, "--rungs", "1048576"]) == 0
    raw = json.loads(capsys.readouterr().out)
    assert raw["protocol"]["rungs"] == [1048576] and raw["protocol"]["repeats"] == [1]
    assert main(["cell-study", "--config", config, "--cell", cell, "--rungs", "1048576", "131072"]) == 0
    raw = json.loads(capsys.readouterr().out)
    assert raw["protocol"]["rungs"] == [131072, 1048576] and raw["protocol"]["repeats"] == [3, 1]
    assert raw["protocol"]["servers"] == 3
    assert raw["arms"] == [{"name": "wmtp", "k": [3], "sink": [16], "window": [4096]}]
    assert main(["cell-study", "--config", config, "--cell", cell, "--rungs", "4096"]) == 2


def test_real_raw_cells_give_a_row_per_arm_and_rung(tmp_path):
    """Raw files of a real CPU run → wmtp.analyze.tidy.collect → the step file: every shape has its cycle time."""
    from wmtp.analyze.tidy import collect

    raw = Path(__file__).parent / "fixtures" / "embedded-trained-run" / "raw"
    cells = sorted(m.parent for m in raw.rglob("manifest.json"))
    collect(cells, tmp_path / "tidy", [], None)
    requests, rungs = (pd.read_parquet(tmp_path / "tidy" / f"{name}.parquet") for name in ("requests", "rungs"))
    table = step_table(requests, rungs, engine_version="0.32.0")
    # The fixture's study also ran the copy task; the step file is of the code workload's rungs.
    assert len(table) == (rungs["workload"] == "code").sum()
    assert table["step_ms"].notna().all() and (table["n"] > 0).all()
    drafting = table[table["arm"] != "none"]
    assert (drafting["tokens_per_cycle"] > 1).all()  # a trained head accepts: cycles are fewer than tokens
    assert set(table.loc[table["arm"] == "wmtp", "W"]) == {256, 1024}
    assert table.loc[table["arm"] == "none", "S"].isna().all()


def test_cycles_come_from_the_chunks_gaps_over_the_cycles_their_tokens_took():
    """One long request gives a median and a spread of its cycles, where its decode window gives one number."""
    requests = pd.DataFrame(
        [
            # 1M: four chunks of one token each, at one token a cycle
            _request(
                "mtp3",
                "mtp",
                3,
                1048576,
                1.3,
                completion_tokens=5,
                chunk_gaps_ms=[300.0, 320.0, 340.0, 340.0],
                chunk_new_tokens=[1, 1, 1, 1],
            ),
            # 128K: the server merged two steps into the second chunk (a gap of 2 cycles of 10 ms), and a request
            # that recorded no token counts (its gaps count only as chunks)
            _request(
                "mtp3",
                "mtp",
                3,
                131072,
                0.04,
                completion_tokens=5,
                chunk_gaps_ms=[10.0, 20.0, 12.0],
                chunk_new_tokens=[1, 2, 1],
            ),
            _request("mtp3", "mtp", 3, 131072, 0.04, completion_tokens=3, chunk_gaps_ms=[12.0, 8.0]),
            # 262K, a head that accepts (2 tokens a cycle): a chunk's tokens then tell acceptance, not merged steps
            _request(
                "mtp3",
                "mtp",
                3,
                262144,
                0.04,
                completion_tokens=5,
                chunk_gaps_ms=[10.0, 10.0],
                chunk_new_tokens=[1, 3],
            ),
            _request("wmtp3", "wmtp", 3, 131072, 0.04, completion_tokens=5, cell_hook_host_us_per_build=87.5),
        ]
    )
    rungs = pd.DataFrame(
        [
            {"cell_id": c, "workload": "code", "rung": r, "tok_per_verify": t}
            for c, r, t in [
                ("mtp3", 1048576, 1.0),
                ("mtp3", 131072, 1.0),
                ("mtp3", 262144, 2.0),
                ("wmtp3", 131072, 1.0),
            ]
        ]
    )
    table = step_table(requests, rungs, "0.24.0").set_index(["arm", "context"])
    long = table.loc[("mtp", 1048576)]
    assert (long["n"], long["cycles"], long["cycle_ms"], long["tokens_per_chunk"]) == (1, 4, 330.0, 1.0)
    assert long["cycle_ms_p10"] == pytest.approx(306.0) and long["cycle_ms_p90"] == pytest.approx(340.0)
    short = table.loc[("mtp", 131072)]
    assert (short["cycles"], short["cycle_ms"]) == (3, 10.0)  # 10/1, 20/2 and 12/1 ms a cycle
    assert short["chunk_ms"] == 12.0 and short["tokens_per_chunk"] == pytest.approx((4 + 2) / 5)
    accepting = table.loc[("mtp", 262144)]
    assert accepting["cycles"] == 0 and accepting["chunk_ms"] == 10.0 and accepting["tokens_per_chunk"] == 2.0
    # Requests that recorded no chunks (older raw files) leave the cycle columns empty, not zero.
    windowed = table.loc[("wmtp", 131072)]
    assert windowed["cycles"] == 0 and math.isnan(windowed["cycle_ms"]) and math.isnan(windowed["chunk_ms"])
    assert windowed["hook_host_us_per_build"] == 87.5 and math.isnan(long["hook_host_us_per_build"])


def test_plugins_that_set_the_window_per_forward_and_per_cycle_are_two_rows():
    """A server whose plugin kept a cycle's window is not pooled with one whose plugin set it per forward."""
    requests = pd.DataFrame(
        [
            _request("wmtp-old", "wmtp", 3, 131072, 2.56, cell_window_anchor="forward"),
            _request("wmtp-new", "wmtp", 3, 131072, 1.28, cell_window_anchor="cycle"),
            _request("wmtp-older", "wmtp", 3, 131072, 2.56),  # counters from before the plugin said it
            _request("mtp", "mtp", 3, 131072, 2.56),
        ]
    )
    rungs = pd.DataFrame(
        [{"cell_id": c, "workload": "code", "rung": 131072, "tok_per_verify": 1.0} for c in requests["cell_id"]]
    )
    table = step_table(requests, rungs, engine_version="0.24.0").fillna({"window_anchor": ""})
    rows = {
        (a, anchor): (n, step) for a, anchor, n, step in table[["arm", "window_anchor", "servers", "step_ms"]].values
    }
    assert rows == {("mtp", ""): (1, 20.0), ("wmtp", "cycle"): (1, 10.0), ("wmtp", "forward"): (2, 20.0)}
    # Counters from before the plugin said which kernels set the window: PyTorch's, the only path there was.
    assert set(table.loc[table["arm"] == "wmtp", "window_kernels"]) == {"torch"}


def test_the_plugins_own_kernels_make_a_row_of_their_own():
    requests = pd.DataFrame(
        [
            _request("wmtp-torch", "wmtp", 3, 131072, 2.56, cell_window_anchor="cycle", cell_window_kernels="torch"),
            _request("wmtp-triton", "wmtp", 3, 131072, 1.28, cell_window_anchor="cycle", cell_window_kernels="triton"),
        ]
    )
    rungs = pd.DataFrame(
        [{"cell_id": c, "workload": "code", "rung": 131072, "tok_per_verify": 1.0} for c in requests["cell_id"]]
    )
    table = step_table(requests, rungs, engine_version="0.24.0")
    assert dict(zip(table["window_kernels"], table["step_ms"], strict=True)) == {"torch": 20.0, "triton": 10.0}


def test_servers_of_another_attention_setting_are_rows_of_their_own_and_grow_among_themselves():
    """An engine with its split cap raised is another engine: never pooled with the default one, and its growth
    between contexts taken within its own servers."""
    tuned = "flash_attn_max_num_splits_for_cuda_graph=128"
    requests = pd.DataFrame(
        [
            _request("none", "none", 0, 131072, 1.28),
            _request("none", "none", 0, 1048576, 2.56),
            _request("none-tuned", "none", 0, 131072, 1.152, attention_config=tuned),
            _request("none-tuned", "none", 0, 1048576, 1.92, attention_config=tuned),
        ]
    )
    rungs = pd.DataFrame(
        [
            {"cell_id": c, "workload": "code", "rung": r, "tok_per_verify": 1.0}
            for c in ("none", "none-tuned")
            for r in (131072, 1048576)
        ]
    )
    table = step_table(requests, rungs, engine_version="0.24.0").fillna({"attention_config": ""})
    rows = {(cfg, ctx): (servers, step, growth) for cfg, ctx, servers, step, growth in
            table[["attention_config", "context", "servers", "step_ms", "growth_ms"]].values}  # fmt: skip
    assert rows[("", 131072)][:2] == (1, 10.0) and rows[(tuned, 131072)][:2] == (1, 9.0)
    assert rows[("", 1048576)][2] == pytest.approx(10.0) and rows[(tuned, 1048576)][2] == pytest.approx(6.0)
