"""The real engine's section: every shape whose two clocks disagree is listed with both cycles, and the step file's
growth check flags a growth below its floor, saying whether it was taken within a server or across servers."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from wmtp.report import engine_steps

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "measurements" / "h200" / "vllm_qwen3.6-35b-a3b.csv"


def _row(arm: str, context: int, step_ms: float, client_ms: float, disagreement: float, **extra) -> dict:
    window = {"S": 16, "W": 4096} if arm == "wmtp" else {"S": None, "W": None}
    return {"engine_version": "0.24.0", "model": "m", "arm": arm, "k": 0 if arm == "none" else 3, "context": context,
            "batch": 1, "step_ms": step_ms, "client_step_ms": client_ms, "clock_disagreement_max": disagreement,
            **window, **extra}  # fmt: skip


def _steps() -> pd.DataFrame:
    """mtp and wmtp at three contexts: the clocks part at the two longest, one growth below its floor across
    servers (mtp 128K → 512K) and one within a server (wmtp 512K → 1M)."""
    return pd.DataFrame(
        [
            _row("none", 131072, 5.3, 5.2, 0.025),
            _row("mtp", 131072, 10.9, 10.7, 0.019),
            _row("mtp", 524288, 12.4, 11.9, 0.050, growth_ms=1.5, growth_floor_ms=2.2, growth_servers=0),
            _row("mtp", 1048576, 16.8, 15.6, 0.073, growth_ms=4.4, growth_floor_ms=2.9, growth_servers=2),
            _row("wmtp", 131072, 10.2, 10.1, 0.014),
            _row("wmtp", 524288, 11.6, 11.5, 0.031, growth_ms=1.7, growth_floor_ms=1.6, growth_servers=0),
            _row("wmtp", 1048576, 12.0, 11.0, 0.080, growth_ms=0.4, growth_floor_ms=2.2, growth_servers=2),
        ]
    )


def test_every_shape_over_three_percent_is_listed_with_both_clocks():
    section = engine_steps.clock_check_section(_steps())
    table = section.frame
    assert list(zip(table["series"], table["context"], strict=True)) == [
        ("mtp k=3", "524K"), ("mtp k=3", "1M"), ("wmtp k=3 S=16 W=4096", "524K"), ("wmtp k=3 S=16 W=4096", "1M"),
    ]  # fmt: skip
    one = table.set_index(["series", "context"]).loc[("mtp k=3", "1M")]
    assert one["engine's cycle (ms)"] == 16.8 and one["client's cycle (ms)"] == 15.6
    assert one["client vs engine, median (%)"] == pytest.approx(100 * (15.6 / 16.8 - 1), abs=0.05)
    assert one["largest disagreement of one request (%)"] == pytest.approx(7.3)
    (sentence,) = section.notes
    assert "engine's own clock" in sentence and "4 shapes" in sentence and "at most 8.0 %" in sentence
    assert "shorter" in sentence
    # a tighter limit lists more; a looser one none, and the sentence still names the clock used
    assert len(engine_steps.clock_check_section(_steps(), limit=0.02).frame) == 5
    loose = engine_steps.clock_check_section(_steps(), limit=0.10)
    assert loose.frame.empty and "engine's own clock" in loose.notes[0] and "no shape" in loose.notes[0]


def test_the_committed_step_file_lists_exactly_its_rows_over_the_limit():
    steps = engine_steps.load_engine_steps([COMMITTED])
    expected = steps[steps["clock_disagreement_max"] > engine_steps.CLOCK_DISAGREEMENT_LIMIT]
    table = engine_steps.clock_check_section(steps).frame
    assert len(table) == len(expected)
    assert sorted(table["engine's cycle (ms)"]) == sorted(expected["step_ms"].round(2))


def test_a_growth_below_its_floor_is_flagged_within_or_across_servers():
    section = engine_steps.growth_check_section(_steps())
    checks = section.frame.set_index(["series", "from → to"])["check"]
    assert checks[("mtp k=3", "131K → 524K")] == "below its floor, across servers (medians of different servers)"
    assert checks[("mtp k=3", "524K → 1M")] == "at or above its floor, within 2 servers"
    assert checks[("wmtp k=3 S=16 W=4096", "131K → 524K")].startswith("at or above its floor, across servers")
    assert checks[("wmtp k=3 S=16 W=4096", "524K → 1M")] == "below its floor, within 2 servers"
    assert len(section.frame) == 4  # none has one context: no growth
    (sentence,) = section.notes
    assert sentence.startswith("2 of 4 growths fall below") and "1 of them taken across servers" in sentence
    assert "1 within a server" in sentence


def test_two_plugins_at_the_same_contexts_are_grown_apart():
    """A window set per forward and one set per cycle, each at 512K and 1M: each grows from its own shorter row,
    never from the other plugin's row at the same context."""
    rows = [
        _row("wmtp", context, ms, ms, 0.01, window_anchor=anchor, growth_ms=growth, growth_floor_ms=2.2,
             growth_servers=2)
        for anchor, at_512k, at_1m in (("forward", 11.6, 14.8), ("cycle", 12.1, 14.7))
        for context, ms, growth in ((524288, at_512k, None), (1048576, at_1m, at_1m - at_512k))
    ]  # fmt: skip
    frame = engine_steps.growth_check_section(pd.DataFrame(rows)).frame
    assert list(zip(frame["series"], frame["from → to"], strict=True)) == [
        ("wmtp k=3 S=16 W=4096, window per forward", "524K → 1M"),
        ("wmtp k=3 S=16 W=4096, window per cycle", "524K → 1M"),
    ]
    assert frame["growth (ms)"].tolist() == pytest.approx([3.2, 2.6])


def test_a_step_file_without_growth_servers_says_so_and_one_without_growth_shows_nothing():
    old = _steps().drop(columns="growth_servers")
    assert set(engine_steps.growth_check_section(old).frame["check"].str.split(", ").str[1]) == {"not recorded"}
    assert not engine_steps.growth_check_section(_steps().drop(columns=["growth_ms"])).available
    assert not engine_steps.growth_check_section(None).available


def test_each_arms_cycles_by_both_clocks_in_arm_order():
    cycles = engine_steps.engine_cycles(_steps())
    assert list(dict.fromkeys(cycles["arm"])) == ["none", "mtp", "wmtp"]
    assert (cycles.groupby("series")["tokens"].apply(lambda t: t.is_monotonic_increasing)).all()
    assert cycles.loc[cycles["series"] == "mtp k=3", "client_step_ms"].tolist() == [10.7, 11.9, 15.6]


def test_the_windows_each_ran_are_read_from_the_replica_table_and_the_step_file():
    steps = engine_steps.load_engine_steps([COMMITTED])
    replica = pd.DataFrame({"sink": [64, 64], "window": [4032, 4032]})
    assert engine_steps.windows_sentence(steps, replica) == (
        "The replica ran S 64, W 4032; the engine S 16, W 4096, which it reads as a sink of one 560-token block."
    )
    # a window that covers every context is the window-off control, not a window the engine ran
    control = _row("wmtp", 131072, 10.0, 10.0, 0.0) | {"S": 16, "W": 1 << 20}
    assert engine_steps.windows_sentence(pd.DataFrame([control]), None) == ""
    # a sink of more than half of what the engine read may span several blocks: only the tokens are said
    wide = _row("wmtp", 131072, 10.0, 10.0, 0.0) | {"S": 400, "read_sink_tokens": 560}
    assert engine_steps.windows_sentence(pd.DataFrame([wide]), None) == (
        "The engine ran S 400, W 4096, which it reads as a sink of 560 tokens."
    )
    assert engine_steps.windows_sentence(None, None) == ""


def test_each_way_the_plugin_set_its_window_gets_its_own_ratio_to_native_mtp():
    steps = pd.DataFrame(
        [
            _row("none", 131072, 5.3, 5.3, 0.0, n=3, servers=1),
            _row("mtp", 131072, 10.8, 10.8, 0.0, n=3, servers=1, server_step_ms="10.8"),
            _row("wmtp", 131072, 12.0, 12.0, 0.0, n=3, servers=1, server_step_ms="12.0", window_anchor="forward"),
            _row("wmtp", 131072, 9.0, 9.0, 0.0, n=3, servers=1, server_step_ms="9.0", window_anchor="cycle"),
        ]
    )
    table = engine_steps.engine_step_section(steps, None).frame
    ratios = dict(zip(table["wmtp window set per"], table["engine mtp / wmtp"], strict=True))
    assert ratios == pytest.approx({"forward": 0.9, "cycle": 1.2})


def test_the_plugins_own_kernels_are_another_plugin_never_pooled_with_the_pytorch_path():
    from wmtp.report.headline import _plugin_text

    steps = pd.DataFrame(
        [
            _row("none", 131072, 5.3, 5.3, 0.0, n=3, servers=1),
            _row("mtp", 131072, 10.8, 10.8, 0.0, n=3, servers=1, server_step_ms="10.8"),
            _row("wmtp", 131072, 9.0, 9.0, 0.0, n=3, servers=1, server_step_ms="9.0", window_anchor="cycle",
                 window_kernels="torch"),
            _row("wmtp", 131072, 8.0, 8.0, 0.0, n=3, servers=1, server_step_ms="8.0", window_anchor="cycle",
                 window_kernels="triton"),
        ]
    )  # fmt: skip
    table = engine_steps.engine_step_section(steps, None).frame
    ratios = dict(zip(table["wmtp window set per"], table["engine mtp / wmtp"], strict=True))
    assert ratios == pytest.approx({"cycle": 1.2, "cycle, Triton kernels": 1.35})
    assert _plugin_text("cycle, Triton kernels") == "once a decode cycle, by the plugin's Triton kernels"
    assert _plugin_text("cycle") == "once a decode cycle"
