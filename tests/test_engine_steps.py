"""A real engine's step file in the report: its ratio beside the replica's, the cost model's and the ceiling."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest

from wmtp.report.engine_steps import break_even_tokens, engine_step_section, load_engine_steps

ROOT = Path(__file__).resolve().parents[1]


def _step(arm: str, k: int, context: int, step_ms: float, n: int = 3, **extra) -> dict:
    window = {"S": 16, "W": 4096} if arm == "wmtp" else {}
    return {"engine_version": "0.24.0", "arm": arm, "k": k, "context": context, "batch": 1, "step_ms": step_ms,
            "n": n, **window, **extra}  # fmt: skip


def _write(tmp_path: Path, rows: list[dict], model: str = "qwen3.6-35b-a3b") -> Path:
    path = tmp_path / f"vllm_{model}.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


def test_break_even_is_the_cycle_over_the_no_draft_step():
    assert break_even_tokens(12.0, 6.0) == 2.0
    assert math.isnan(break_even_tokens(12.0, math.nan)) and math.isnan(break_even_tokens(12.0, 0.0))


def test_one_row_per_context_and_k_with_the_replica_at_the_same_shape(tmp_path):
    rows = [
        _step("none", 0, 131072, 5.0),
        _step("mtp", 3, 131072, 9.0),
        _step("wmtp", 3, 131072, 8.0, windowed_forwards=100.0),
        _step("mtp", 1, 131072, 7.0),  # no wmtp at k 1: no row
        _step("mtp", 3, 262144, 10.0, n=2),
        _step("wmtp", 3, 262144, 9.0, n=2, windowed_forwards=50.0),  # no none here, no replica at 262K
    ]
    replica = pd.DataFrame(
        [
            {"model": "Qwen3.6-35B-A3B", "context": 131072, "k": 3, "batch": 1, "arm": arm, "measured_ratio": 1.04,
             "predicted_ratio": 1.05}
            for arm in ("mtp", "wmtp")
        ]
        + [{"model": "Qwen3.6-35B-A3B", "context": 131072, "k": 3, "batch": 2, "arm": "mtp", "measured_ratio": 1.1,
            "predicted_ratio": 1.2}]
    )  # fmt: skip
    steps = load_engine_steps([_write(tmp_path, rows)])
    frame = engine_step_section(steps, replica).frame.set_index("context")
    assert list(frame.index) == ["131K", "262K"] and set(frame["k"]) == {3}
    short = frame.loc["131K"]
    assert short["engine"] == "vLLM 0.24.0" and short["model"] == "qwen3.6-35b-a3b"
    assert short["engine mtp / wmtp"] == pytest.approx(9 / 8, abs=1e-3)
    assert (short["replica"], short["cost model"]) == (1.04, 1.05)  # batch 1, not the batch-2 row
    assert short["ceiling 1 + k/L_full"] == pytest.approx(1.3)  # 10 full-attention layers, k 3
    assert (short["break-even tokens/cycle, mtp"], short["break-even tokens/cycle, wmtp"]) == (1.8, 1.6)
    assert short["n none/mtp/wmtp"] == "3/3/3" and short["windowed draft forwards (server)"] == 100.0
    longer = frame.loc["262K"]
    assert math.isnan(longer["replica"]) and math.isnan(longer["break-even tokens/cycle, mtp"])
    assert longer["n none/mtp/wmtp"] == "0/2/2"


def test_the_ratio_carries_its_range_over_servers_and_the_window_off_control_its_own_column(tmp_path):
    rows = [
        _step("none", 0, 131072, 5.0, servers=2, server_step_ms="5.0;5.0"),
        _step("mtp", 3, 131072, 10.0, servers=3, server_step_ms="9.5;10.0;11.0"),
        _step("wmtp", 3, 131072, 9.0, servers=3, server_step_ms="8.0;9.0;10.0"),
        _step("wmtp", 3, 131072, 10.5, W=1048576, servers=1, server_step_ms="10.5"),
    ]
    frame = engine_step_section(load_engine_steps([_write(tmp_path, rows)]), None).frame
    row = frame.iloc[0]
    assert row["wmtp (ms)"] == 9.0 and row["wmtp, window off (ms)"] == 10.5
    assert (row["ratio_lo"], row["ratio_hi"]) == pytest.approx((9.5 / 10.0, 11.0 / 8.0))
    assert row["mtp / wmtp [range over servers]"] == "1.11 [0.95, 1.38], not resolved"
    assert row["servers none/mtp/wmtp"] == "2/3/3"


def test_nothing_to_show_without_a_step_file():
    assert not engine_step_section(None, None).available
    assert load_engine_steps([]) is None


def test_the_committed_h200_steps_are_the_engines_clock_over_several_servers():
    """The real-engine file as committed: every arm at 128K, 512K and 1M for each plugin that set the window with
    PyTorch operations (per forward and per cycle), and at 128K and 1M for the one whose Triton kernels set it, timed
    by the engine's clock, mtp from three servers or more at 128K and 1M and every drafting arm from at least two,
    every cycle above its byte floor, the window applied in every wmtp row, and every growth timed within a server
    above its extra bytes: 512K to 1M in each arm, 128K to 512K in each arm but the per-forward plugin's wmtp."""
    path = ROOT / "measurements" / "h200" / "vllm_qwen3.6-35b-a3b.csv"
    steps = load_engine_steps([path])
    assert (steps["clock"] == "engine").all() and (steps["over_floor"] > 1).all()
    frame = engine_step_section(steps, None).frame
    assert (frame["clock"] == "engine").all() and (frame["windowed draft forwards (server)"] > 0).all()
    assert sorted(frame["wmtp window set per"].unique()) == ["cycle", "cycle, Triton kernels", "forward"]
    for key, plugin in frame.groupby("wmtp window set per"):
        contexts = [131072, 1048576] if key.endswith("Triton kernels") else [131072, 524288, 1048576]
        assert plugin["tokens"].tolist() == contexts
        servers = [[int(n) for n in s.split("/")] for s in plugin["servers none/mtp/wmtp"]]
        assert all(min(mtp, wmtp) >= 2 for _, mtp, wmtp in servers)
        assert servers[0][1] >= 3 and servers[-1][1] >= 3
    assert (frame["ratio_lo"] <= frame["engine mtp / wmtp"]).all()
    assert (frame["engine mtp / wmtp"] <= frame["ratio_hi"]).all()
    assert steps.groupby("arm")["context"].nunique().to_dict() == {"none": 3, "mtp": 3, "wmtp": 3}
    within = steps[steps["growth_servers"] > 0]
    assert (within["growth_ms"] > within["growth_floor_ms"]).all()
    anchors = within["arm"] + within["window_anchor"].fillna("").map(lambda a: f" per {a}" if a else "")
    assert set(anchors[within["context"] == 1048576]) == {"none", "mtp", "wmtp per forward", "wmtp per cycle"}
    assert set(anchors[within["context"] == 524288]) == {"none", "mtp", "wmtp per cycle"}


def test_a_replica_table_from_before_the_batch_sweep_is_read_as_one_request(tmp_path):
    rows = [_step("none", 0, 131072, 5.0), _step("mtp", 3, 131072, 9.0), _step("wmtp", 3, 131072, 8.0)]
    replica = pd.DataFrame(
        [{"model": "Qwen3.6-35B-A3B", "context": 131072, "k": 3, "arm": "mtp", "measured_ratio": 1.04,
          "predicted_ratio": 1.05}]
    )  # fmt: skip
    steps = load_engine_steps([_write(tmp_path, rows)])
    assert engine_step_section(steps, replica).frame["replica"].tolist() == [1.04]


def test_the_windows_saving_splits_into_bytes_and_what_a_tuned_engine_takes_away():
    from wmtp.report.engine_steps import window_gain_split

    def row(arm: str, step: float, floor: float, attention: str, servers: str) -> dict:
        window = {"S": 16, "W": 4096, "window_anchor": "cycle"} if arm == "wmtp" else {}
        return {"model": "m", "engine_version": "0.24.0", "attention_config": attention, "arm": arm, "k": 3,
                "context": 1_048_576, "batch": 1, "step_ms": step, "floor_ms": floor,
                "servers": len(servers.split(";")), "server_step_ms": servers, **window}  # fmt: skip

    steps = pd.DataFrame(
        [
            row("mtp", 16.8, 10.0, "", "16.7;16.9"),
            row("wmtp", 14.75, 8.5, "", "14.75"),
            row("mtp", 14.3, 10.0, "split=128", "14.3"),
            row("wmtp", 12.8, 8.5, "split=128", "12.8"),
        ]
    )
    (split,) = window_gain_split(steps).frame.to_dict("records")
    assert split["saved, default (ms)"] == 2.05 and split["saved, tuned (ms)"] == 1.5
    assert split["by bytes (ms)"] == 1.5 and split["taken by the tuned options (ms)"] == 0.55
    assert split["tuned less bytes (ms)"] == 0.0 and split["default servers' range, mtp + wmtp (ms)"] == 0.2
    assert "attention split=128" in split["tuned engine"]
    assert split["split"].startswith("above the default's server range; one tuned server an arm")
    wide = steps.assign(server_step_ms=["15.0;17.0", "14.75", "14.3", "12.8"])
    (spread,) = window_gain_split(wide).frame.to_dict("records")
    assert spread["split"] == "not resolved: the default engine's servers range more"
    # Without a tuned engine beside the default one there is nothing to split.
    assert not window_gain_split(steps[steps["attention_config"] == ""]).available


def test_each_engine_sets_its_newest_plugin_beside_the_other(tmp_path):
    from wmtp.report.engine_steps import cross_engine_section

    vllm = [
        _step("none", 0, 131072, 5.0),
        _step("mtp", 3, 131072, 10.0),
        _step("wmtp", 3, 131072, 8.5, window_anchor="cycle", window_kernels="triton"),
        _step("wmtp", 3, 131072, 9.0, window_anchor="cycle", window_kernels="torch"),
        _step("wmtp", 3, 131072, 8.0, window_anchor="forward", window_kernels="torch"),
    ]
    sglang = [
        {**_step(arm, k, 131072, ms, window_anchor="forward"), "engine_version": "0.5.17"}
        for arm, k, ms in (("none", 0, 6.0), ("mtp", 3, 12.0), ("wmtp", 3, 10.0))
    ]
    second = tmp_path / "sglang_qwen3.6-35b-a3b.csv"
    pd.DataFrame(sglang).to_csv(second, index=False)
    row = cross_engine_section(load_engine_steps([_write(tmp_path, vllm), second])).frame.iloc[0]
    assert row["vLLM 0.24.0: wmtp (ms)"] == 8.5 and row["vLLM 0.24.0: none (ms)"] == 5


def test_the_same_shape_in_two_engines_side_by_side(tmp_path):
    from wmtp.report.engine_steps import cross_engine_section

    vllm = [
        _step("none", 0, 131072, 5.0),
        _step("mtp", 3, 131072, 10.0),
        _step("wmtp", 3, 131072, 8.0, window_anchor="forward"),
        _step("wmtp", 3, 131072, 9.0, window_anchor="cycle"),  # the plugin's window set once a cycle: this one
        {**_step("wmtp", 3, 131072, 9.9), "W": 1049600},  # the window-off control is not the windowed arm
        _step("mtp", 3, 1048576, 16.0),
        _step("wmtp", 3, 1048576, 14.0),
    ]
    sglang = [
        {**_step("none", 0, 131072, 6.0), "engine_version": "0.5.17"},
        {**_step("mtp", 3, 131072, 12.0), "engine_version": "0.5.17"},
        {**_step("wmtp", 3, 131072, 10.0, window_anchor="forward"), "engine_version": "0.5.17"},
    ]
    first = _write(tmp_path, vllm)
    second = tmp_path / "sglang_qwen3.6-35b-a3b.csv"
    pd.DataFrame(sglang).to_csv(second, index=False)
    steps = load_engine_steps([first, second])
    assert set(steps["engine"]) == {"vLLM", "SGLang"}
    section = cross_engine_section(steps)
    # 1M was measured in one engine only: no row.
    assert section.frame["context"].tolist() == ["131K"]
    row = section.frame.iloc[0]
    assert (row["vLLM 0.24.0: none (ms)"], row["vLLM 0.24.0: mtp (ms)"], row["vLLM 0.24.0: wmtp (ms)"]) == (5, 10, 9)
    assert row["vLLM 0.24.0: mtp / wmtp"] == pytest.approx(10 / 9, abs=1e-3)
    assert row["SGLang 0.5.17: mtp / wmtp"] == pytest.approx(1.2)
    # Each engine says how many servers its cycles came from and how far the ratio ranges between them.
    assert row["vLLM 0.24.0: servers none/mtp/wmtp"] == "1/1/1" and row["SGLang 0.5.17: range over servers"]
    assert set(engine_step_section(steps, None).frame["engine"]) == {"SGLang 0.5.17", "vLLM 0.24.0"}
    assert not cross_engine_section(load_engine_steps([first])).available
    with pytest.raises(ValueError, match=r"named <engine>_<model>\.csv"):
        load_engine_steps([first.rename(tmp_path / "qwen.csv")])
