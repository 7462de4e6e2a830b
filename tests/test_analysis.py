"""wmtp.analysis against seed 000's numbers, and the bootstrap / frame functions on synthetic tables."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from wmtp import analysis as an

FIXTURE = Path(__file__).parent / "fixtures" / "tidy_synthetic" / "make_tidy.py"

# Seed 000 states cycleMs and tokPerVerify; the decode rates follow from them (to the 0.01 tok/s a
# chart would print). Fed back, analysis must give the seed's cycleMs again.
SEED_TPV = {2040: 3.362, 131290: 3.102}
SEED_CYCLE = {("none", 2040): 14.14, ("none", 131290): 19.84, ("mtp", 2040): 31.16, ("mtp", 131290): 38.35}
SEED_TOK_S = {
    (arm, rung): round(an.decode_tok_s_from_cycle_ms(ms, 1.0 if arm == "none" else SEED_TPV[rung]), 2)
    for (arm, rung), ms in SEED_CYCLE.items()
}
SEED_POSITIONS = {2040: (434, 371, 298), 131290: (359, 290, 240)}


def _fixture():
    spec = importlib.util.spec_from_file_location("make_tidy", FIXTURE)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tables() -> dict[str, pd.DataFrame]:
    return _fixture().build("spark-128k", energy=True, windowed=True)


# ------------------------------------------------------------------------------------------------
# Scalar formulas and seed 000
# ------------------------------------------------------------------------------------------------


def test_decode_and_prefill_formulas():
    assert an.decode_tok_s(256, 3.5, 1.0) == pytest.approx(255 / 2.5)
    assert math.isnan(an.decode_tok_s(1, 3.5, 1.0))
    assert math.isnan(an.decode_tok_s(10, 1.0, 1.0))
    assert an.prefill_tok_s(131290, 43.7) == pytest.approx(3004.3, abs=0.1)
    assert math.isnan(an.prefill_tok_s(10, 0.0))


@pytest.mark.parametrize(("arm", "rung"), list(SEED_CYCLE))
def test_seed_cycle_ms_reproduced_from_tok_s_and_tok_per_verify(arm: str, rung: int):
    tpv = 1.0 if arm == "none" else SEED_TPV[rung]
    assert an.cycle_ms(tpv, SEED_TOK_S[(arm, rung)]) == pytest.approx(SEED_CYCLE[(arm, rung)], abs=0.01)


def test_seed_draft_tax_from_the_cycle_times():
    c = {key: an.cycle_ms(1.0 if key[0] == "none" else SEED_TPV[key[1]], tok_s) for key, tok_s in SEED_TOK_S.items()}
    tax = an.draft_tax(c["none", 2040], c["none", 131290], c["mtp", 2040], c["mtp", 131290], k=3)
    assert tax.target_growth_ms == pytest.approx(5.70, abs=0.01)
    # The seed prints 7.21 ms and 1.51 ms, from unrounded cycle times; its own rounded endpoints give
    # 38.35 − 31.16 = 7.19 ms and 1.49 ms. Both round to 0.50 ms per step and ≈ 8.8 % of the target's.
    assert tax.cycle_growth_ms == pytest.approx(7.20, abs=0.02)
    assert tax.per_step_ms == pytest.approx(0.50, abs=0.01)
    assert 100 * tax.share == pytest.approx(8.8, abs=0.15)


def test_seed_draft_tax_from_the_stated_growths():
    # 5.70 ms for the target, 7.21 ms for the verify cycle: 1.51 ms over 3 steps, 8.8 %.
    tax = an.draft_tax(0.0, 5.70, 0.0, 7.21, k=3)
    assert tax.draft_growth_ms == pytest.approx(1.51)
    assert tax.per_step_ms == pytest.approx(0.503, abs=0.001)
    assert round(100 * tax.share, 1) == 8.8


def test_draft_tax_rejects_k_zero():
    with pytest.raises(ValueError, match="k must be ≥ 1"):
        an.draft_tax(1, 2, 3, 4, k=0)


@pytest.mark.parametrize(("rung", "acceptance"), [(2040, 78.7), (131290, 70.1)])
def test_seed_acceptance_from_per_position_counts(rung: int, acceptance: float):
    counts = SEED_POSITIONS[rung]
    drafts = an.drafts_from_tok_per_verify(sum(counts), SEED_TPV[rung])
    assert drafts == pytest.approx(round(drafts), abs=0.5)  # 467 and 423 cycles
    result = an.acceptance_from_positions(counts, round(drafts), k=3)
    assert round(100 * result.acceptance_rate, 1) == acceptance
    assert result.tok_per_verify == pytest.approx(SEED_TPV[rung], abs=0.001)
    rates = result.position_rates
    assert rates[0] > rates[1] > rates[2]  # degrades evenly, no collapse at the tail
    assert an.acceptance_rate(sum(counts), 3 * round(drafts)) == pytest.approx(result.acceptance_rate)


def test_seed_speedup_change_is_about_plus_0_08():
    # Per-repeat decode rates spread symmetrically around the seed's rates (6 and 5 repeats).
    def repeats(center: float, n: int, spread: float) -> np.ndarray:
        return center + spread * np.linspace(-1, 1, n)

    base_from = repeats(SEED_TOK_S["none", 2040], 6, 0.05)
    arm_from = repeats(SEED_TOK_S["mtp", 2040], 6, 1.5)
    base_to = repeats(SEED_TOK_S["none", 131290], 5, 0.05)
    arm_to = repeats(SEED_TOK_S["mtp", 131290], 5, 1.5)
    ci = an.speedup_change_ci(base_from, arm_from, base_to, arm_to, n_boot=4000, seed=1)
    assert ci.point == pytest.approx(0.08, abs=0.005)
    assert ci.lo < ci.point < ci.hi
    s_from = an.speedup_ci(base_from, arm_from, n_boot=2000)
    s_to = an.speedup_ci(base_to, arm_to, n_boot=2000)
    assert s_to.point - s_from.point == pytest.approx(ci.point)
    assert s_from.point == pytest.approx(1.526, abs=0.002)
    assert s_to.point == pytest.approx(1.605, abs=0.002)


def test_energy_and_cost_side_formulas():
    assert an.tok_per_j(255, 130.0) == pytest.approx(1.9615, abs=1e-4)
    assert math.isnan(an.tok_per_j(255, None))
    assert math.isnan(an.tok_per_j(255, 0.0))
    assert an.power_w(360.0, 10.0) == 36.0
    assert math.isnan(an.power_w(float("nan"), 10.0))
    assert an.relative_change(14.14, 19.84) == pytest.approx(0.403, abs=0.001)  # "40% more expensive"
    assert an.cost_side_ratio(1.44, 1.0) == pytest.approx(1.44)
    assert an.cost_side_wedge(1.28, 1.0) == pytest.approx(0.28)
    assert math.isnan(an.cost_side_wedge(1.0, 0.0))


# ------------------------------------------------------------------------------------------------
# Bootstrap
# ------------------------------------------------------------------------------------------------


def test_bootstrap_is_seeded_and_percentile():
    values = [10.0, 11.0, 12.0, 13.0, 30.0]
    a = an.bootstrap_ci(values, seed=3)
    b = an.bootstrap_ci(values, seed=3)
    assert a == b
    assert a.point == 12.0
    assert a.lo <= a.point <= a.hi
    assert an.bootstrap_ci(values, statistic="mean").point == pytest.approx(15.2)
    constant = an.bootstrap_ci([5.0, 5.0, 5.0])
    assert constant == an.CI(5.0, 5.0, 5.0)


def test_bootstrap_drops_nan_and_handles_empty():
    assert an.bootstrap_ci([1.0, float("nan"), 3.0], statistic="mean").point == 2.0
    empty = an.bootstrap_ci([float("nan")])
    assert all(math.isnan(x) for x in empty)
    single = an.bootstrap_ci([7.0])
    assert single == an.CI(7.0, 7.0, 7.0)
    with pytest.raises(ValueError, match="statistic"):
        an.bootstrap_ci([1.0], statistic="mode")  # type: ignore[arg-type]


def test_bootstrap_interval_narrows_with_level():
    rng = np.random.default_rng(0)
    values = rng.normal(100, 2, size=20)
    wide = an.bootstrap_ci(values, level=0.99)
    narrow = an.bootstrap_ci(values, level=0.5)
    assert wide.lo <= narrow.lo <= narrow.hi <= wide.hi


# ------------------------------------------------------------------------------------------------
# Frames over the tidy tables
# ------------------------------------------------------------------------------------------------


def test_speedup_table_matches_the_rungs_medians(tables):
    req, rungs = tables["requests"], tables["rungs"]
    sp = an.speedup_table(req, n_boot=500)
    assert set(sp["arm"]) == {"mtp", "wmtp", "wmtp-ring"}
    assert len(sp) == 9
    row = sp[(sp["arm"] == "mtp") & (sp["rung"] == 131290)].iloc[0]
    med = rungs.set_index(["arm", "rung"])["decode_tok_s"]
    assert row["speedup"] == pytest.approx(med["mtp", 131290] / med["none", 131290])
    assert row["lo"] <= row["speedup"] <= row["hi"]
    assert (row["n_base"], row["n_arm"]) == (5, 5)


def test_speedup_change_table_defaults_to_smallest_and_largest_rung(tables):
    ch = an.speedup_change_table(tables["requests"], n_boot=500)
    mtp = ch[ch["arm"] == "mtp"].iloc[0]
    assert (mtp["rung_from"], mtp["rung_to"]) == (2040, 131290)
    assert mtp["change"] == pytest.approx(mtp["speedup_to"] - mtp["speedup_from"])
    assert mtp["change"] == pytest.approx(0.08, abs=0.02)
    assert mtp["se"] > 0
    one = an.speedup_change_table(tables["requests"][tables["requests"]["rung"] == 2040])
    assert one.empty


def test_draft_tax_table(tables):
    tax = an.draft_tax_table(tables["rungs"], tables["requests"], n_boot=500)
    mtp = tax[tax["arm"] == "mtp"].iloc[0]
    r = tables["rungs"].set_index(["arm", "rung"])["cycle_ms"]
    expected = an.draft_tax(r["none", 2040], r["none", 131290], r["mtp", 2040], r["mtp", 131290], 3)
    assert mtp["per_step_ms"] == pytest.approx(expected.per_step_ms)
    assert mtp["share"] == pytest.approx(0.088, abs=0.01)
    assert mtp["per_step_lo"] <= mtp["per_step_ms"] <= mtp["per_step_hi"]
    assert mtp["share_lo"] <= mtp["share"] <= mtp["share_hi"]
    assert an.draft_tax_table(tables["rungs"][tables["rungs"]["arm"] != "none"]).empty


def test_acceptance_and_position_tables(tables):
    acc = an.acceptance_table(tables["rungs"])
    mtp = acc[acc["arm"] == "mtp"].set_index("rung")
    assert round(100 * mtp.at[2040, "acceptance_rate"], 1) == 78.7
    assert round(100 * mtp.at[131290, "acceptance_rate"], 1) == 70.1
    assert mtp.at[2040, "tok_per_verify"] == pytest.approx(3.362, abs=0.001)
    pos = an.position_table(tables["positions"], tables["rungs"])
    p = pos[(pos["arm"] == "mtp") & (pos["rung"] == 2040)]
    assert list(p["d_accepted_pos"]) == [434, 371, 298]
    assert p["rate"].iloc[0] == pytest.approx(434 / 467)


def test_energy_table(tables):
    en = an.energy_table(tables["rungs"], tables["requests"], n_boot=200)
    row = en[(en["arm"] == "none") & (en["rung"] == 2040)].iloc[0]
    assert row["power_w"] == pytest.approx(36.0)
    assert row["tok_per_j"] == pytest.approx(1.96, abs=0.01)
    assert row["tok_per_j_lo"] <= row["tok_per_j"] <= row["tok_per_j_hi"]
    none = _fixture().build("x", energy=False, windowed=False)
    assert an.energy_table(none["rungs"], none["requests"]).empty


def test_cost_side_table(tables):
    cs = an.cost_side_table(tables["rungs"], tables["requests"], n_boot=500)
    assert set(cs["arm"]) == {"wmtp", "wmtp-ring"}
    row = cs[(cs["arm"] == "wmtp") & (cs["rung"] == 131290)].iloc[0]
    r = tables["rungs"]
    nat = r[(r["arm"] == "mtp") & (r["rung"] == 131290)]["cycle_ms"].iloc[0]
    win = r[(r["arm"] == "wmtp") & (r["rung"] == 131290)]["cycle_ms"].iloc[0]
    assert row["wedge"] == pytest.approx(nat / win - 1)
    assert row["ratio"] == pytest.approx(nat / win)
    assert row["wedge_lo"] <= row["wedge"] <= row["wedge_hi"]
    plain = _fixture().build("x", windowed=False)
    assert an.cost_side_table(plain["rungs"], plain["requests"]).empty


def test_cpu_shaped_tables_do_not_break_the_frames():
    cpu = _fixture().build("embedded", shape="cpu")
    req, rungs = cpu["requests"], cpu["rungs"]
    assert not an.speedup_table(req, n_boot=100).empty
    acc = an.acceptance_table(rungs)
    assert (acc["tok_per_verify"] == 1.0).all()
    assert (acc["acceptance_rate"] == 0.0).all()
    assert an.energy_table(rungs, req).empty
    assert an.cost_side_table(rungs, req).empty
    assert not an.draft_tax_table(rungs, req, n_boot=100).empty
