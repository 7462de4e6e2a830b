"""The report's view of a traced cycle: per arm and context, each component beside its floor, and the window's
device saving beside what its bytes allow."""

from __future__ import annotations

import math

import pandas as pd

from wmtp.report.cycle_profile import cycle_profile_section, cycle_profile_table, window_gain
from wmtp.report.questions import cycle_profile_sentence

CELL = "model~m/engine~vllm/arm~{arm}/k~3{window}/c~1"


def _traces() -> pd.DataFrame:
    rows = []
    shapes = {("mtp", ""): (900.0, 600.0), ("wmtp", "/s~16/w~4096"): (100.0, 10.0)}
    for (arm, window), (draft_us, draft_floor) in shapes.items():
        for trace, jitter in (("a", 0.0), ("b", 20.0)):
            common = {"cell_id": CELL.format(arm=arm, window=window), "rung": 1_048_576, "gpu": "NVIDIA H200",
                      "trace": trace, "steps": 8, "tokens_per_step": 4.0, "wall_us": 5000.0 + jitter,
                      "device_busy_us": 4000.0, "device_idle_us": 1000.0 + jitter}  # fmt: skip
            rows += [
                {**common, "component": "target_attn", "us": 2000.0 + jitter, "floor_us": 1000.0},
                {**common, "component": "draft_attn", "us": draft_us + jitter, "floor_us": draft_floor},
                {**common, "component": "sampling", "us": 50.0, "floor_us": math.nan},
            ]
    return pd.DataFrame(rows)


def test_each_component_is_the_median_over_traces_beside_its_floor_and_idle_is_a_component():
    table = cycle_profile_table(_traces())
    mtp = table[table["arm"] == "mtp"].set_index("component")
    assert list(mtp.index) == ["target_attn", "draft_attn", "sampling", "device_idle"]
    assert mtp.at["target_attn", "us"] == 2010.0 and mtp.at["target_attn", "over_floor"] == 2.01
    assert mtp.at["device_idle", "us"] == 1010.0 and math.isnan(mtp.at["device_idle", "floor_us"])
    assert set(table["traces"]) == {2} and set(table["k"]) == {3} and set(table["context"]) == {1_048_576}
    assert set(table["cycles"]) == {16}  # 8 traced steps in each of the 2 requests, whatever its components


def test_the_windows_saving_sits_beside_what_its_bytes_allow():
    gain = window_gain(cycle_profile_table(_traces())).set_index("component")
    assert gain.at["draft_attn", "saved_us"] == 800.0 and gain.at["draft_attn", "saved_by_bytes_us"] == 590.0
    assert gain.at["target_attn", "saved_us"] == 0.0
    sentence = cycle_profile_sentence(cycle_profile_table(_traces()), gain.reset_index())
    assert "0.80 ms a cycle off the draft's attention" in sentence and "bytes allow 0.59 ms" in sentence
    assert "target's attention 2.01×" in sentence
    assert "traced (mtp 16 cycles of 2 request(s), wmtp 16 cycles of 2 request(s))," in sentence
    assert "no interval" not in sentence  # two traces an arm


def test_without_a_trace_table_the_section_says_so():
    section = cycle_profile_section(None)
    assert not section.available and "replica.traces" in section.notes[0]
