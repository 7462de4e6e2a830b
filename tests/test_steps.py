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

    cell = "model~qwen3.6-35b-a3b/engine~vllm/arm~wmtp/k~3/s~16/w~4096/c~1"
    config = str(repo / "config" / "studies" / "h200-vllm.yaml")
    assert main(["cell-study", "--config", config, "--cell", cell, "--rungs", "1048576"]) == 0
    raw = json.loads(capsys.readouterr().out)
    assert raw["protocol"]["rungs"] == [1048576] and raw["protocol"]["repeats"] == [2]
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
