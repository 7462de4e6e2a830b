"""The plugin's run-time counters and the cell's check of them, without an engine.

The engine tests (tests/test_plugin_vllm.py) show the same check on the real plugin's counters: passing
for a windowed engine and a real server, failing for an engine whose hook hands the metadata through.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from wmtp.engines import vllm as vllm_adapter
from wmtp.engines.build import spec_hash
from wmtp.plugin import stats


class _Drops:
    """Stands in for the per-row tensor of dropped blocks (summed on the device in the plugin)."""

    def __init__(self, *rows: int):
        self.rows = rows

    def sum(self) -> int:
        return sum(self.rows)


def _cell(arm: str = "wmtp", sink: int = 16, window: int = 128, k: int = 3):
    return SimpleNamespace(arm=arm, sink=sink, window=window, k=k)


def _protocol(*rungs: int):
    return SimpleNamespace(rungs=list(rungs))


def _stats_dir(tmp_path: Path, monkeypatch, *forwards: tuple[int, _Drops | None]) -> Path:
    """Counters written by a proposer that saw these (max_seq_len, dropped) forwards of one query token."""
    directory = tmp_path / "wmtp-stats"
    monkeypatch.setenv(stats.ENV, str(directory))
    counter = stats.DraftStats(16, 128, "9.9.9")
    for max_seq_len, dropped in forwards:
        counter.record(16, 128, 128, max_seq_len, 1, dropped)
    counter.write()
    return directory


def test_counts_and_effective_window_reach_the_manifest(tmp_path, monkeypatch):
    directory = _stats_dir(tmp_path, monkeypatch, (100, None), (1100, _Drops(5, 0)), (1101, _Drops(6)))
    out = vllm_adapter.verify_windowed({stats.ENV: str(directory)}, _cell(), _protocol(256, 1100))
    summary = out["wmtp_plugin"]
    assert (summary["requested_sink"], summary["requested_window"]) == (16, 128)
    assert summary["builds"] == 3 and summary["windowed_forwards"] == 2
    assert summary["blocks_skipped"] == 11 and summary["tokens_skipped"] == 11 * 128
    # S = 16 rounds up to one 128-token block; the window starts at a block boundary.
    assert (summary["sink_tokens"], summary["window_tokens_min"], summary["window_tokens_max"]) == (128, 128, 255)
    assert summary["longest_context"] == 1101
    assert "2 of 3 draft forwards windowed" in summary["messages"][0]


def test_a_window_that_never_ran_fails_the_cell_with_the_plugins_message(tmp_path, monkeypatch):
    directory = _stats_dir(tmp_path, monkeypatch, (1100, None), (1101, None))
    with pytest.raises(stats.WindowNotApplied) as err:
        vllm_adapter.verify_windowed({stats.ENV: str(directory)}, _cell(), _protocol(1100))
    message = str(err.value)
    assert message.startswith("the windowed draft never ran: prompts of up to 1100 tokens exceed S + W = 144")
    assert "0 of 2 draft forwards windowed" in message and "vLLM 9.9.9" in message


def test_no_counters_at_all_fail_and_say_where_they_were_looked_for(tmp_path):
    with pytest.raises(stats.WindowNotApplied, match=r"no wmtp counters in .*nothing-here"):
        vllm_adapter.verify_windowed({stats.ENV: str(tmp_path / "nothing-here")}, _cell(), _protocol(1100))
    with pytest.raises(stats.WindowNotApplied, match="WMTP_PLUGIN_STATS_DIR was not set"):
        vllm_adapter.verify_windowed({}, _cell(), _protocol(1100))


def test_windowed_forwards_without_a_dropped_block_fail_where_one_must_drop(tmp_path, monkeypatch):
    directory = _stats_dir(tmp_path, monkeypatch, (1100, _Drops(0)))
    with pytest.raises(stats.WindowNotApplied, match="decode steps at up to 1100 tokens must drop KV blocks"):
        vllm_adapter.verify_windowed({stats.ENV: str(directory)}, _cell(), _protocol(1100))
    # Just past S + W no block has to drop (the sink rounds to a whole block, the window starts at one).
    short = _stats_dir(tmp_path / "short", monkeypatch, (300, _Drops(0)))
    assert vllm_adapter.verify_windowed({stats.ENV: str(short)}, _cell(), _protocol(1100))


def test_short_contexts_and_other_arms_need_no_proof(tmp_path):
    assert vllm_adapter.verify_windowed({}, _cell(), _protocol(100, 144))["wmtp_plugin"]["proposers"] == 0
    for arm in ("none", "mtp"):
        assert vllm_adapter.verify_windowed({}, _cell(arm), _protocol(100_000)) == {}


def test_the_server_env_names_a_stats_dir_inside_the_cells_tmp(tmp_path):
    env = vllm_adapter.server_env({stats.ENV: "/shared"}, tmp_path / "work", tmp_path / "tmp")
    assert env[stats.ENV] == str(tmp_path / "tmp" / "wmtp-stats")


def test_without_the_variable_the_plugin_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(stats.ENV, raising=False)
    counter = stats.DraftStats(0, 64, "9.9.9")
    counter.record(0, 64, 16, 1000, 1, _Drops(3))
    assert counter.path is None and counter.snapshot()["blocks_skipped"] == 3


def test_run_cell_fails_a_wmtp_cell_whose_window_never_ran(tmp_path, tiny_tokenizer, monkeypatch):
    """The cell calls the adapter's check after the sweep: failure.json carries the plugin's message."""
    from test_sglang import FAKE_SITE, _probe

    from wmtp.config import study_from_dict
    from wmtp.engines.sglang import SGLangAdapter
    from wmtp.measure.cell import CellRun, run_cell

    # The SGLang stand-in server serves the cell; the check is vLLM's, reading an empty stats dir.
    empty = tmp_path / "stats"
    empty.mkdir()
    monkeypatch.setattr(
        SGLangAdapter,
        "verify_cell",
        lambda self, run_dir, env, cell, protocol: vllm_adapter.verify_windowed(
            {stats.ENV: str(empty)}, cell, protocol
        ),
        raising=False,
    )
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    shutil.copy(tiny_tokenizer, model_dir / "tokenizer.json")
    raw = {
        "study": "sg",
        "results_dir": str(tmp_path / "results"),
        "engines": [
            {
                "name": "sg",
                "kind": "sglang",
                "device": "cuda",
                "source": "python",
                "python": sys.executable,
                "env": {"PYTHONPATH": str(FAKE_SITE)},
            }
        ],
        "models": [{"name": "m", "path": str(model_dir), "max_model_len": 4096}],
        "arms": [{"name": "wmtp", "k": [3], "sink": [4], "window": [64]}],
        "protocol": {
            "rungs": [160],
            "repeats": 1,
            "output_tokens": 5,
            "warmup_requests": 0,
            "health_timeout_s": 60,
            "request_timeout_s": 60,
        },
    }
    study = study_from_dict(raw, base_dir=tmp_path)
    (cell,) = study.cells()
    manifest = {"python": sys.executable, "engine": "sg", "kind": "sglang", "source": "python"}
    manifest["versions"] = _probe(FAKE_SITE)
    manifest["spec_hash"] = spec_hash(study.engine(cell.engine))  # a build of this study's engine
    out = tmp_path / "results" / "sg" / "raw" / cell.cell_id
    with pytest.raises(stats.WindowNotApplied, match="the windowed draft never ran"):
        run_cell(CellRun(study=study, cell=cell, out_dir=out, engine_manifest=manifest, model_dir=model_dir))
    failure = json.loads((out / "failure.json").read_text())
    assert failure["error"] == "WindowNotApplied"
    assert failure["message"].startswith("the windowed draft never ran: prompts of up to 160 tokens exceed S + W = 68")
    assert not (out / "manifest.json").exists()


def test_the_check_compares_the_skipped_blocks_with_the_decode_context_they_were_read_at():
    """On a GPU the sum of dropped blocks lags the host's counters by a write: the check pairs it with the decode
    context of its own read, so a lagging zero after a short start is no failure, and a zero at a long one is."""
    base = {"pid": 1, "vllm_version": "9.9.9", "sink": 16, "window": 128, "builds": 9, "windowed_forwards": 8,
            "longest_context": 5000, "longest_decode_context": 5000, "message": "m",
            **stats.effective(16, 128, 128)}  # fmt: skip
    lagging = {**base, "blocks_skipped": 0, "skipped_as_of_decode_context": 200}
    assert stats.check([lagging], 5000, 16, 128, 3, None)["windowed_forwards"] == 8
    stale = {**base, "blocks_skipped": 0, "skipped_as_of_decode_context": 5000}
    with pytest.raises(stats.WindowNotApplied, match="decode steps at up to 5000 tokens must drop"):
        stats.check([stale], 5000, 16, 128, 3, None)
    older = {**base, "blocks_skipped": 0}  # a file written before the read was paired: its longest context
    with pytest.raises(stats.WindowNotApplied):
        stats.check([older], 5000, 16, 128, 3, None)


def test_a_host_sum_is_read_at_once_and_the_hooks_host_time_is_averaged_per_build(tmp_path, monkeypatch):
    monkeypatch.setenv(stats.ENV, str(tmp_path))
    counter = stats.DraftStats(16, 128, "9.9.9")
    for length in (1000, 2000):
        counter.record(16, 128, 128, length, 1, _Drops(2, 1))
        counter.add_host_ns(150_000)
    counter.record(16, 128, 128, 100, 1, None)
    snap = counter.snapshot()
    assert (snap["blocks_skipped"], snap["skipped_as_of_decode_context"]) == (6, 2000)
    assert snap["hook_host_us_per_build"] == 100.0  # 300 µs over three builds
    one = {**snap, "builds": 3}
    assert (
        stats.summarize([one, {**one, "hook_host_us_per_build": 200.0, "builds": 1}])["hook_host_us_per_build"] == 125.0
    )


def test_a_cycles_later_forwards_count_its_first_forwards_drops_once_summed(tmp_path, monkeypatch):
    """A later forward that keeps its cycle's window adds that window's dropped blocks without a new sum."""
    monkeypatch.setenv(stats.ENV, str(tmp_path))
    counter = stats.DraftStats(16, 128, "9.9.9")
    sums = []

    class Counted(_Drops):
        def sum(self) -> int:
            sums.append(self.rows)
            return super().sum()

    first = Counted(2, 3)
    counter.record(16, 128, 128, 5000, 4, first)
    counter.record(16, 128, 128, 5001, 1, first, reused=True)
    counter.record(16, 128, 128, 5002, 1, first, reused=True)
    assert counter.snapshot()["blocks_skipped"] == 15  # three forwards of 5 blocks
    counter.record(16, 128, 128, 5003, 4, Counted(4))
    counter.record(16, 128, 128, 5004, 1, Counted(4), reused=True)
    snap = counter.snapshot()
    assert (snap["blocks_skipped"], snap["windowed_forwards"], snap["anchored_forwards"]) == (23, 5, 3)
    assert sums == [(2, 3), (4,)]  # one sum a cycle


def test_a_longest_context_kept_on_the_device_is_read_with_the_sum_it_goes_with(monkeypatch):
    """SGLang's draft under CUDA graphs knows its lengths only on the device: the plugin hands them over as tensors,
    and a write reads the longest of them in one go with the dropped blocks, which the check then compares."""
    import torch

    monkeypatch.delenv(stats.ENV, raising=False)  # no file: nothing is read before the snapshot below
    counter = stats.DraftStats(16, 128, "0.5.17", engine="SGLang")
    for longest, drops in ((900, [0, 0]), (5000, [30, 0]), (4000, [20])):
        dropped = torch.tensor(drops, dtype=torch.int32)
        counter.record(16, 128, 128, 0, 1, dropped, device_max_seq_len=torch.tensor(longest, dtype=torch.int32))
    assert counter.longest_decode_context == 0  # nothing read yet: the host never waited for the device
    snap = counter.snapshot()
    assert (snap["blocks_skipped"], snap["skipped_as_of_decode_context"]) == (50, 5000)
    assert (snap["longest_context"], snap["longest_decode_context"]) == (5000, 5000)
    assert (snap["engine"], snap["engine_version"]) == ("SGLang", "0.5.17") and "vllm_version" not in snap
    assert snap["message"].startswith(f"wmtp plugin (pid {snap['pid']}, SGLang 0.5.17; sink S=16, window W=128")
    assert stats.check([snap], 5000, 16, 128, 3, None)["blocks_skipped"] == 50
    with pytest.raises(stats.WindowNotApplied, match="must drop"):
        stats.check([{**snap, "blocks_skipped": 0}], 5000, 16, 128, 3, None)


def test_vllms_counters_keep_their_version_key():
    snap = stats.DraftStats(16, 128, "9.9.9").snapshot()
    assert (snap["engine"], snap["vllm_version"]) == ("vLLM", "9.9.9")
    assert "vLLM 9.9.9;" in snap["message"]
