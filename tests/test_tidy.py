"""Raw cell files → tidy tables: counters are differenced per (workload, rung), never across workloads."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from wmtp.analyze import tidy
from wmtp.analyze.tidy import attention_config
from wmtp.layout import TRAINED_CHECKPOINT

FIXTURES = Path(__file__).parent / "fixtures"


def _write_cell(cell_dir: Path, workloads: dict[str, tuple[int, int, int]], rung: int = 1024) -> Path:
    """A drafting cell measured on each workload at one rung: (drafts, draft tokens, accepted) per workload."""
    cell_dir.mkdir(parents=True)
    cell_id = "model~tiny/engine~vllm-cpu/arm~mtp/k~3/c~1"
    (cell_dir / "manifest.json").write_text(
        json.dumps(
            {
                "study": "t",
                "cell_id": cell_id,
                "power_status": "unavailable",
                "cell": {"model": "tiny", "engine": "vllm-cpu", "arm": "mtp", "k": 3, "concurrency": 1},
            }
        )
    )
    requests, counters = [], []
    for workload, (drafts, draft_tokens, accepted) in workloads.items():
        for repeat in range(2):
            requests.append(
                {
                    "cell_id": cell_id,
                    "workload": workload,
                    "rung": rung,
                    "repeat": repeat,
                    "slot": 0,
                    "warmup": False,
                    "prompt_tokens": rung,
                    "completion_tokens": 33,
                    "ttft_s": 0.5,
                    "decode_s": 0.4,
                    "e2e_s": 0.9,
                    "energy_decode_j": None,
                }
            )
        for name, delta in (
            ("drafts", drafts),
            ("draft_tokens", draft_tokens),
            ("accepted", accepted),
            ("accepted_pos_0", accepted),
        ):
            counters.append(
                {
                    "cell_id": cell_id,
                    "workload": workload,
                    "rung": rung,
                    "counter": name,
                    "before": 100.0,
                    "after": 100.0 + delta,
                    "delta": float(delta),
                }
            )
    pd.DataFrame(requests).to_parquet(cell_dir / "requests.parquet")
    pd.DataFrame(counters).to_parquet(cell_dir / "counters.parquet")
    return cell_dir


def test_each_workload_reads_its_own_counter_deltas(tmp_path):
    cell = _write_cell(tmp_path / "raw" / "cell", {"code": (10, 30, 15), "copy": (20, 60, 6)})
    tables = tidy.collect([cell], tmp_path / "tidy")
    rungs = tables["rungs"].set_index("workload")
    assert rungs.loc["code", "acceptance_rate"] == 0.5 and rungs.loc["copy", "acceptance_rate"] == 0.1
    assert rungs.loc["code", "tok_per_verify"] == 2.5 and rungs.loc["copy", "tok_per_verify"] == 1.3
    assert rungs.loc["copy", "n_repeats"] == 2
    positions = tables["positions"].set_index("workload")
    assert positions.loc["code", "rate"] == 1.5 and positions.loc["copy", "rate"] == 0.3
    assert set(pd.read_parquet(tmp_path / "tidy" / "requests.parquet")["workload"]) == {"code", "copy"}


def test_raw_files_from_before_workloads_are_code(tmp_path):
    """The committed raw cells of an embedded run that predates the workload column."""
    cells = [m.parent for m in (FIXTURES / "embedded-cpu-run").rglob("manifest.json")]
    assert cells
    for cell in cells:
        assert "workload" not in pd.read_parquet(cell / "requests.parquet").columns
    tables = tidy.collect(cells, tmp_path / "tidy")
    assert set(tables["requests"]["workload"]) == set(tables["rungs"]["workload"]) == {"code"}
    drafting = tables["rungs"][tables["rungs"]["arm"] == "mtp"]
    assert (drafting["d_drafts"] > 0).all()


def test_a_real_trained_run_on_two_workloads(tmp_path):
    """The committed raw cells of `make run` on the trained tiny model (1K/4K/16K, code and copy)."""
    cells = [m.parent for m in (FIXTURES / "embedded-trained-run").rglob("manifest.json")]
    assert len(cells) == 4
    tables = tidy.collect(cells, tmp_path / "tidy")
    rungs = tables["rungs"]
    assert set(rungs["workload"]) == {"code", "copy"} and sorted(rungs["rung"].unique()) == [1024, 4096, 16384]
    assert (rungs.groupby(["cell_id", "workload", "rung"]).size() == 1).all()
    assert (rungs["n_repeats"] == 3).all() and (rungs["prompt_tokens"] == rungs["rung"]).all()
    drafting = rungs[rungs["arm"] != "none"]
    # a trained head: every (series, workload, rung) accepted between a third and two thirds of its drafts
    assert drafting["acceptance_rate"].between(0.33, 0.67).all(), drafting[["cell_id", "workload", "rung"]]
    assert (drafting["d_draft_tokens"] == 3 * drafting["d_drafts"]).all()
    positions = tables["positions"]
    per_position = positions.groupby("position")["rate"].mean()
    assert per_position.is_monotonic_decreasing  # later draft positions are accepted less often


def test_the_window_the_draft_read_reaches_the_tables(tmp_path):
    """The plugin's block-rounded sink and window (manifest ``wmtp_plugin``) become columns of both tables."""
    cell = _write_cell(tmp_path / "raw" / "cell", {"code": (10, 30, 15)})
    manifest = json.loads((cell / "manifest.json").read_text())
    manifest["cell"].update(arm="wmtp", sink=16, window=128)
    manifest["wmtp_plugin"] = {
        "block_size": 256,
        "sink_tokens": 256,
        "window_tokens_min": 128,
        "window_tokens_max": 383,
        "windowed_forwards": 42,
    }
    (cell / "manifest.json").write_text(json.dumps(manifest))
    tables = tidy.collect([cell], tmp_path / "tidy")
    for name in ("requests", "rungs"):
        row = tables[name].iloc[0]
        assert (row["kv_block_size"], row["read_sink_tokens"]) == (256, 256), name
        assert (row["read_window_min"], row["read_window_max"], row["cell_windowed_forwards"]) == (128, 383, 42), name


def test_cells_without_a_window_read_nothing_special(tmp_path):
    cell = _write_cell(tmp_path / "raw" / "cell", {"code": (10, 30, 15)})
    rungs = tidy.collect([cell], tmp_path / "tidy")["rungs"]
    assert rungs[["kv_block_size", "read_sink_tokens", "read_window_max"]].isna().all().all()


def test_a_windowed_cell_carries_the_cost_models_ring_reclaim_at_its_length(tmp_path):
    cell = _write_cell(tmp_path / "raw" / "cell", {"code": (10, 30, 15)})
    manifest = json.loads((cell / "manifest.json").read_text())
    manifest["cell"].update(arm="wmtp-ring", sink=16, window=256)
    manifest["kv_cache"] = {"kv_cache_tokens": 1, "max_model_len": 16640, "max_concurrency": 1.0}
    manifest["model_config"] = json.loads((TRAINED_CHECKPOINT / "config.json").read_text())
    (cell / "manifest.json").write_text(json.dumps(manifest))
    predicted = tidy.collect([cell], tmp_path / "tidy")["requests"]["predicted_ring_reclaim"].iloc[0]
    # one full-attention layer and the draft, 256 bytes a token each: the ring keeps 16 + 256 of 16,640 draft
    # tokens, so at most (16,640 − 272) / (2 · 16,640) of the KV comes back, a little less with the recurrent state
    assert 0.48 < predicted < (16640 - 272) / (2 * 16640)
    manifest.pop("model_config")
    (cell / "manifest.json").write_text(json.dumps(manifest))
    assert tidy.collect([cell], tmp_path / "tidy2")["requests"]["predicted_ring_reclaim"].isna().all()


def _real_cells() -> list[Path]:
    return sorted(m.parent for m in (FIXTURES / "embedded-trained-run").rglob("manifest.json"))


def test_cells_recorded_for_another_study_file_are_refused(tmp_path):
    import shutil

    import pytest

    cells, current = [], {}
    for i, cell in enumerate(_real_cells()):
        copy = tmp_path / "raw" / str(i)
        shutil.copytree(cell, copy)
        manifest = json.loads((copy / "manifest.json").read_text())
        manifest["identity_hash"] = f"{i:016x}"  # as a cell records it
        (copy / "manifest.json").write_text(json.dumps(manifest))
        cells.append(copy)
        current[manifest["cell_id"]] = manifest["identity_hash"]
    tidy.collect(cells, tmp_path / "ok", expected_identities=current)  # the study as recorded: collected
    changed = dict(current)
    stale_id = sorted(changed)[1]
    changed[stale_id] = "f" * 16  # what a study with, say, a longer output would give that cell now
    with pytest.raises(tidy.StaleCells, match="1 cell\\(s\\) were measured for another study file") as info:
        tidy.collect(cells, tmp_path / "stale", expected_identities=changed)
    assert stale_id in str(info.value) and "snakemake --forcerun" in str(info.value)
    assert not (tmp_path / "stale" / "requests.parquet").exists()


def test_cells_whose_prompts_came_from_different_corpora_are_refused(tmp_path):
    import shutil

    import pytest

    copies = []
    for i, cell in enumerate(_real_cells()[:2]):
        copy = tmp_path / "raw" / str(i)
        shutil.copytree(cell, copy)
        copies.append(copy)
    manifest = json.loads((copies[1] / "manifest.json").read_text())
    assert manifest["corpus_digest"]
    manifest["corpus_digest"] = "another-python"
    (copies[1] / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(tidy.MixedProtocols, match="different corpora"):
        tidy.collect(copies, tmp_path / "tidy")


def test_the_reports_overview_names_each_series_cell_identity(tmp_path):
    import shutil

    from wmtp.report.load import load_tidy
    from wmtp.report.sections import overview

    cells = []
    for i, cell in enumerate(_real_cells()):
        copy = tmp_path / "raw" / str(i)
        shutil.copytree(cell, copy)
        manifest = json.loads((copy / "manifest.json").read_text())
        manifest["identity_hash"] = f"{i:016x}"
        (copy / "manifest.json").write_text(json.dumps(manifest))
        cells.append(copy)
    tidy.collect(cells, tmp_path / "tidy")
    rows = overview(load_tidy(tmp_path / "tidy"))
    assert sorted(set(rows["identity"])) == [f"{i:016x}" for i in range(len(cells))]
    assert (rows.groupby("identity").size() == 2).all()  # one row per workload, both of one cell


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["python", "-m", "vllm.entrypoints.openai.api_server", "--max-num-seqs", "4"], ""),
        (
            ["--attention-config", '{"flash_attn_max_num_splits_for_cuda_graph": 128, "backend": "FLASH_ATTN"}'],
            "backend=FLASH_ATTN, flash_attn_max_num_splits_for_cuda_graph=128",
        ),
        (
            ['--attention-config={"flash_attn_max_num_splits_for_cuda_graph": 64}'],
            "flash_attn_max_num_splits_for_cuda_graph=64",
        ),
        (
            [
                "--attention-config.flash_attn_max_num_splits_for_cuda_graph",
                "96",
                "--attention-config.backend=TRITON_ATTN",
            ],
            "backend=TRITON_ATTN, flash_attn_max_num_splits_for_cuda_graph=96",
        ),
        (["-ac", '{"flash_attn_max_num_splits_for_cuda_graph": 128}'], "flash_attn_max_num_splits_for_cuda_graph=128"),
        (
            ["--attention-backend", "FLASHINFER", "-ac.flash_attn_version", "3"],
            "backend=FLASHINFER, flash_attn_version=3",
        ),
        # another flag that merely starts like one is not an attention option
        (["--attention-configs", "x", "-acx", "y"], ""),
    ],
)
def test_the_attention_options_a_server_ran_with_read_from_its_argv(argv, expected):
    assert attention_config(argv) == expected


def test_attention_options_that_are_not_an_object_are_refused():
    with pytest.raises(ValueError, match="is not a JSON object"):
        attention_config(["--attention-config", "[128]"])
