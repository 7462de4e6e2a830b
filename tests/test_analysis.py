"""wmtp.analyze.analysis against the Spark study's numbers, and the bootstrap / frame functions on synthetic tables.

The Spark-study tests take the Spark study's *primary* numbers as printed (counter counts, tok/J, board power, TTFT,
prompt and output tokens), rebuild the raw inputs a run would have recorded from them (decode windows,
energies, counter deltas), run those through wmtp.analyze.analysis and compare the result with the *derived*
numbers the study prints (cycleMs, tokPerVerify, acceptance, the draft tax ...). No expected value is
fed back in as an input. Tolerances are the study's own rounding: half a unit in the last printed digit of
every printed number that enters a comparison, added up (relative for products and quotients).
"""

from __future__ import annotations

import importlib.util
import math
from itertools import product
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from wmtp.analyze import analysis as an

FIXTURE = Path(__file__).parent / "fixtures" / "tidy_synthetic" / "make_tidy.py"

# ------------------------------------------------------------------------------------------------
# The Spark study, primary numbers (typed by hand; section names are the study's headings)
# ------------------------------------------------------------------------------------------------

LO, MID, HI = 2040, 32779, 131290  # the Spark study, Method: "2,040 / 32,779 / 131,290 tokens as actually counted"
REPEATS = {LO: 6, MID: 4, HI: 5}  # the Spark study, Method: "Repeats were 6 / 4 / 5 per length."
OUTPUT_TOKENS = 256  # the Spark study, Method: "256 output tokens"
K = 3  # the Spark study, Method: '"num_speculative_tokens":3'
# The first output token comes with prefill (TTFT); the decode window emits the rest.
DECODE_TOKENS = OUTPUT_TOKENS - 1

# the Spark study, Findings, "Acceptance did degrade": "(434/371/298 at 2K against 359/290/240 at 131K)"
ACCEPTED_AT_POSITION = {LO: (434, 371, 298), HI: (359, 290, 240)}
# the Spark study, Findings, "Speculation stayed the energy-efficient choice":
# "2.97 vs 1.96 tok/J at 2K, 1.49 vs 1.06 at 32K, 0.96 vs 0.62 at 131K"
TOK_PER_J = {
    ("mtp", LO): 2.97, ("none", LO): 1.96,
    ("mtp", MID): 1.49, ("none", MID): 1.06,
    ("mtp", HI): 0.96, ("none", HI): 0.62,
}  # fmt: skip
TOK_PER_J_DECIMALS = 2
# same section: "(36.3 vs 36.0 W at 2K, 84.0 vs 81.8 W at 131K)"
POWER_W = {("mtp", LO): 36.3, ("none", LO): 36.0, ("mtp", HI): 84.0, ("none", HI): 81.8}
POWER_W_DECIMALS = 1
# the Spark study, Findings, "The number that actually hurts at 131K is TTFT":
# "43.7 s to first token in the baseline arm, 47.8 s with the draft loaded"
TTFT_S = {("none", HI): 43.7, ("mtp", HI): 47.8}
TTFT_DECIMALS = 1
# the Spark study, Background: "106.5 tok/s at k=3 against 67.9 with no draft — a 57% gain" (the published recipe
# at a 2,048-token prompt, not this study's measurement)
RECIPE_TOK_S = {"mtp": 106.5, "none": 67.9}

# Δdrafts per rung is not printed. It is the only integer that gives the study's acceptance rate, and also
# the only one that gives its tokPerVerify (test_seed_drafts_are_pinned_by_acceptance_and_by_tok_per_verify);
# each of the two therefore checks the other when the counts are run through the formulas.
D_DRAFTS = {LO: 467, HI: 423}

# ------------------------------------------------------------------------------------------------
# The Spark study, derived numbers as printed (the expected values)
# ------------------------------------------------------------------------------------------------

# the Spark study, Findings, "The tax is real": "a plain decode step grew 5.70 ms across the sweep (14.14 → 19.84 ms);
# the whole verify cycle grew 7.21 ms (31.16 → 38.35 ms)"
CYCLE_MS = {("none", LO): 14.14, ("none", HI): 19.84, ("mtp", LO): 31.16, ("mtp", HI): 38.35}
CYCLE_DECIMALS = 2
TARGET_GROWTH_MS, CYCLE_GROWTH_MS = 5.70, 7.21
# same section: "leaves 1.51 ms of context-driven growth attributable to the draft, spread over three draft
# steps: ~0.50 ms per draft step" and "The draft's KV tax is about 8.8% of the target's"
DRAFT_GROWTH_MS, PER_STEP_MS, SHARE_PCT = 1.51, 0.50, 8.8
# the Spark study, Findings, "Acceptance did degrade": "Accepted tokens per verify cycle fell from 3.362 to 3.102, and
# the raw acceptance rate from 78.7% to 70.1% of draft tokens."
TOK_PER_VERIFY = {LO: 3.362, HI: 3.102}
ACCEPTANCE_PCT = {LO: 78.7, HI: 70.1}
# same section: "A 7.7% erosion in tokens-per-cycle"
TPV_EROSION_PCT = -7.7
# the Spark study, Findings, "The speedup did not erode":
# "A plain decode step got 40% more expensive between 2K and 131K"
TARGET_GROWTH_PCT = 40
# same section: "the 2K→131K move is +0.080 ± 0.032"
SPEEDUP_CHANGE = 0.080
# the Spark study, Findings, "The number that actually hurts": "Prefill throughput more than halved from 2K to 131K
# (6,970 → 3,003 tok/s baseline)", "The draft costs about 9% on TTFT", "a 1.6× decode win"
PREFILL_TOK_S = {LO: 6970, HI: 3003}
TTFT_COST_PCT = 9
SPEEDUP_HI = 1.6
# the Spark study, Open questions: "a sliding-window draft would recover ~0.5 ms per draft step at 131K. That is roughly
# 1.5 ms per cycle, or about 4% of decode"
RECOVERED_PER_CYCLE_MS, RECOVERED_PCT_OF_DECODE = 1.5, 4


def _half_unit(decimals: int) -> float:
    """Half a unit in the last printed place: how far a printed number can be from the value it rounds."""
    return 0.5 * 10.0**-decimals


def _accepted(rung: int) -> int:
    return sum(ACCEPTED_AT_POSITION[rung])


def _tpv(arm: str, rung: int) -> float:
    """tokPerVerify from the counters (1 for the baseline by definition, as the study says)."""
    return 1.0 if arm == "none" else an.tok_per_verify(_accepted(rung), D_DRAFTS[rung])


def _ttft(arm: str, rung: int) -> float:
    # The study prints TTFT at 131K only; at 2K, 2,040 tokens at its 6,970 tok/s baseline prefill. TTFT does not
    # enter a decode rate (the first token is excluded), so the 2K value only has to be plausible.
    return TTFT_S.get((arm, rung), LO / PREFILL_TOK_S[LO])


def _energy_route_tolerance(arm: str, rung: int) -> float:
    """Relative rounding of tok/J, W and cycleMs together: the three printed numbers the identity
    tok/J × W = tokPerVerify · 1000 / cycleMs ties (Δdrafts is pinned exactly, so tokPerVerify adds nothing)."""
    return (
        _half_unit(TOK_PER_J_DECIMALS) / TOK_PER_J[arm, rung]
        + _half_unit(POWER_W_DECIMALS) / POWER_W[arm, rung]
        + _half_unit(CYCLE_DECIMALS) / CYCLE_MS[arm, rung]
    )


ARM_RUNGS = [("none", LO), ("none", HI), ("mtp", LO), ("mtp", HI)]


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
# The Spark study: counters → tokPerVerify, acceptance, per-position rates
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rung", [LO, HI])
def test_seed_drafts_are_pinned_by_acceptance_and_by_tok_per_verify(rung: int):
    accepted = _accepted(rung)
    # A cycle accepts at most k drafts, so Δdrafts ≥ accepted / k; 4× accepted is far past any plausible count.
    candidates = range(math.ceil(accepted / K), 4 * accepted)
    by_acceptance = [
        d for d in candidates if round(100 * an.acceptance_rate(accepted, K * d), 1) == ACCEPTANCE_PCT[rung]
    ]
    by_tpv = [d for d in candidates if round(an.tok_per_verify(accepted, d), 3) == TOK_PER_VERIFY[rung]]
    # Two printed numbers, one count: each alone leaves exactly one integer, and it is the same one.
    assert by_acceptance == by_tpv == [D_DRAFTS[rung]]
    # The inverse formula finds it from tokPerVerify alone (to the 0.0005 the study's rounding leaves).
    assert round(an.drafts_from_tok_per_verify(accepted, TOK_PER_VERIFY[rung])) == D_DRAFTS[rung]


@pytest.mark.parametrize("rung", [LO, HI])
def test_seed_acceptance_from_per_position_counts(rung: int):
    result = an.acceptance_from_positions(ACCEPTED_AT_POSITION[rung], D_DRAFTS[rung], k=K)
    # printed to 3 decimals and 0.1 %: equal after the study's rounding
    assert round(result.tok_per_verify, 3) == TOK_PER_VERIFY[rung]
    assert round(100 * result.acceptance_rate, 1) == ACCEPTANCE_PCT[rung]
    rates = result.position_rates
    assert len(rates) == K
    # Per-position rates are not printed, but they must add up to the accepted tokens per cycle (tokPerVerify − 1)
    # and average to the acceptance rate; the tolerance is the rounding of those two printed numbers.
    assert sum(rates) == pytest.approx(TOK_PER_VERIFY[rung] - 1.0, abs=_half_unit(3))
    assert sum(rates) / K == pytest.approx(ACCEPTANCE_PCT[rung] / 100, abs=_half_unit(1) / 100)
    assert rates[0] > rates[1] > rates[2]  # later draft positions are accepted less often
    for position, count in enumerate(ACCEPTED_AT_POSITION[rung]):
        assert an.position_rate(count, D_DRAFTS[rung]) == rates[position]


def test_seed_acceptance_degrades_evenly_and_tokens_per_cycle_erode_7_7_pct():
    lo = an.acceptance_from_positions(ACCEPTED_AT_POSITION[LO], D_DRAFTS[LO], k=K)
    hi = an.acceptance_from_positions(ACCEPTED_AT_POSITION[HI], D_DRAFTS[HI], k=K)
    kept = [b / a for a, b in zip(lo.position_rates, hi.position_rates, strict=True)]
    # "degrades evenly rather than collapsing at the tail": every position keeps 85–95 % of its 2K rate and the
    # third loses no more than the worst of the first two
    assert all(0.85 < x < 0.95 for x in kept), kept
    assert kept[2] >= min(kept[:2])
    assert round(100 * an.relative_change(lo.tok_per_verify, hi.tok_per_verify), 1) == TPV_EROSION_PCT


# ------------------------------------------------------------------------------------------------
# The Spark study: decode windows from energy → decode tok/s → cycleMs; and tok/J, W from the cycle times
# ------------------------------------------------------------------------------------------------


def _request_from_energy(arm: str, rung: int) -> tuple[int, float, float]:
    """(completion_tokens, e2e_s, ttft_s) of one request, from the study's tok/J and board power.

    tok/J is decode tokens per joule of the decode window and W its mean power, so a window of
    ``DECODE_TOKENS`` tokens used DECODE_TOKENS / tok/J joules over (joules / W) seconds.
    """
    energy_j = DECODE_TOKENS / TOK_PER_J[arm, rung]
    window_s = energy_j / POWER_W[arm, rung]
    ttft = _ttft(arm, rung)
    return OUTPUT_TOKENS, ttft + window_s, ttft


@pytest.mark.parametrize(("arm", "rung"), ARM_RUNGS)
def test_seed_cycle_ms_from_energy_power_and_counters(arm: str, rung: int):
    tok_s = an.decode_tok_s(*_request_from_energy(arm, rung))
    tol = _energy_route_tolerance(arm, rung)  # 0.3–0.9 %: tok/J has only two decimals
    assert an.cycle_ms(_tpv(arm, rung), tok_s) == pytest.approx(CYCLE_MS[arm, rung], rel=tol)
    # and the other way round: the rate the printed cycle time implies matches the energy's rate
    assert an.decode_tok_s_from_cycle_ms(CYCLE_MS[arm, rung], _tpv(arm, rung)) == pytest.approx(tok_s, rel=tol)


@pytest.mark.parametrize(("arm", "rung"), ARM_RUNGS)
def test_seed_tok_per_j_and_power_from_the_cycle_times(arm: str, rung: int):
    # A decode window of DECODE_TOKENS tokens at the printed cycle time lasts DECODE_TOKENS / tokPerVerify cycles.
    window_s = DECODE_TOKENS / _tpv(arm, rung) * CYCLE_MS[arm, rung] / 1000.0
    tol = _energy_route_tolerance(arm, rung)
    # energy as a meter reads it at the printed board power → tok/J
    assert an.tok_per_j(DECODE_TOKENS, POWER_W[arm, rung] * window_s) == pytest.approx(TOK_PER_J[arm, rung], rel=tol)
    # energy from the printed tok/J → mean power over the window
    energy_j = DECODE_TOKENS / TOK_PER_J[arm, rung]
    assert an.power_w(energy_j, window_s) == pytest.approx(POWER_W[arm, rung], rel=tol)


def test_seed_speedup_from_energy_is_the_1_6x_decode_win():
    tok_s = {key: an.decode_tok_s(*_request_from_energy(*key)) for key in ARM_RUNGS}
    hi = an.speedup_ci([tok_s["none", HI]], [tok_s["mtp", HI]])
    lo = an.speedup_ci([tok_s["none", LO]], [tok_s["mtp", LO]])
    assert round(hi.point, 1) == SPEEDUP_HI  # "a 1.6× decode win" at 131K
    # "throughput rose ~50%" (the Spark study, "Speculation stayed the energy-efficient choice"), at both lengths
    assert 0.45 < lo.point - 1 < 0.65 and 0.45 < hi.point - 1 < 0.65


def test_a_requests_cycle_takes_its_own_tokens_per_verify_else_its_rungs():
    """At 100 tok/s: a request that counted 3 tokens a cycle took 30 ms a cycle whatever its rung's pooled 2.5; one
    its cell did not count is timed at the rung's 2.5 (25 ms), never at one token a cycle (10 ms)."""
    cycles = an.request_cycle_ms_of([3.0, math.nan, math.nan], [2.5, 2.5, math.nan], [100.0, 100.0, 100.0])
    assert cycles[:2] == pytest.approx([30.0, 25.0])
    assert math.isnan(cycles[2])  # neither count: no cycle


def test_edge_cases_of_the_rate_formulas():
    assert math.isnan(an.decode_tok_s(1, 3.5, 1.0))  # one token is all prefill: no decode window
    assert math.isnan(an.decode_tok_s(10, 1.0, 1.0))
    assert math.isnan(an.prefill_tok_s(10, 0.0))
    assert math.isnan(an.tok_per_j(255, None))
    assert math.isnan(an.tok_per_j(255, 0.0))
    assert math.isnan(an.power_w(float("nan"), 10.0))
    assert math.isnan(an.power_w(100.0, 0.0))
    assert math.isnan(an.cycle_ms(3.0, 0.0))
    assert math.isnan(an.decode_tok_s_from_cycle_ms(float("nan")))
    assert math.isnan(an.tok_per_verify(10, 0))  # counters that did not move: NaN, not a made-up 1.0
    assert math.isnan(an.drafts_from_tok_per_verify(10, 1.0))


# ------------------------------------------------------------------------------------------------
# The Spark study: TTFT, prefill, relative changes
# ------------------------------------------------------------------------------------------------


def test_seed_prefill_rate_from_ttft():
    # TTFT printed to 0.1 s and the rate to 1 tok/s: the relative rounding of both bounds the difference.
    tol = _half_unit(TTFT_DECIMALS) / TTFT_S["none", HI] + _half_unit(0) / PREFILL_TOK_S[HI]
    assert an.prefill_tok_s(HI, TTFT_S["none", HI]) == pytest.approx(PREFILL_TOK_S[HI], rel=tol)


def test_seed_relative_changes():
    # "40% more expensive" (14.14 → 19.84) and "about 9% on TTFT" (43.7 → 47.8), printed as whole percents
    assert round(100 * an.relative_change(CYCLE_MS["none", LO], CYCLE_MS["none", HI])) == TARGET_GROWTH_PCT
    assert round(100 * an.relative_change(TTFT_S["none", HI], TTFT_S["mtp", HI])) == TTFT_COST_PCT
    # the recipe's "a 57% gain" from its 67.9 and 106.5 tok/s
    assert round(100 * an.relative_change(RECIPE_TOK_S["none"], RECIPE_TOK_S["mtp"])) == 57
    assert math.isnan(an.relative_change(0.0, 1.0))


# ------------------------------------------------------------------------------------------------
# The Spark study: the draft tax from the printed cycle times
# ------------------------------------------------------------------------------------------------


def _span(values: list[float]) -> tuple[float, float]:
    return min(values), max(values)


def _overlaps(printed: float, decimals: int, span: tuple[float, float]) -> bool:
    """Whether a printed number's rounding interval meets a range of values (1e-9 for float noise)."""
    h = _half_unit(decimals) + 1e-9
    return printed - h <= span[1] and span[0] <= printed + h


def test_seed_draft_tax_from_the_cycle_times():
    c = CYCLE_MS
    tax = an.draft_tax(c["none", LO], c["none", HI], c["mtp", LO], c["mtp", HI], k=K)
    # Each printed cycle time is its true value ± 0.005 ms; the tax at all 16 corners of that box bounds what the
    # study's unrounded numbers can have given.
    h = _half_unit(CYCLE_DECIMALS)
    corners = [
        an.draft_tax(c["none", LO] + a, c["none", HI] + b, c["mtp", LO] + d, c["mtp", HI] + e, k=K)
        for a, b, d, e in product((-h, h), repeat=4)
    ]

    def span(field: str) -> tuple[float, float]:
        return _span([getattr(t, field) for t in corners])

    assert span("target_growth_ms") == pytest.approx((5.69, 5.71), abs=1e-9)
    assert span("cycle_growth_ms") == pytest.approx((7.18, 7.20), abs=1e-9)
    assert _overlaps(TARGET_GROWTH_MS, 2, span("target_growth_ms"))
    assert _overlaps(PER_STEP_MS, 2, span("per_step_ms"))
    assert _overlaps(SHARE_PCT / 100, 3, span("share"))  # 8.8 % ⇒ 0.0875–0.0885
    assert _overlaps(DRAFT_GROWTH_MS, 2, span("draft_growth_ms"))  # only at the edge: 1.51 is 7.21 − 5.70
    # The study's 7.21 ms cannot come from its own 31.16 and 38.35, whatever they rounded from (at most 7.20).
    # Its 1.51 ms and 8.8 % are computed from that 7.21; both stay inside the box only at its edge.
    assert not _overlaps(CYCLE_GROWTH_MS, 2, span("cycle_growth_ms"))
    # At the printed values themselves: 5.70 ms, ~0.50 ms per step, 1.49 ms of draft growth ≈ "roughly 1.5 ms
    # per cycle, or about 4% of decode"
    assert round(tax.target_growth_ms, 2) == TARGET_GROWTH_MS
    assert round(tax.per_step_ms, 2) == PER_STEP_MS
    assert round(tax.draft_growth_ms, 1) == RECOVERED_PER_CYCLE_MS
    assert round(100 * tax.draft_growth_ms / tax.cycle_to_ms) == RECOVERED_PCT_OF_DECODE
    assert tax.draft_growth_ms == pytest.approx(tax.cycle_growth_ms - tax.target_growth_ms)
    assert tax.k == K and tax.as_dict()["per_step_ms"] == tax.per_step_ms


def test_draft_tax_rejects_k_zero():
    with pytest.raises(ValueError, match="k must be ≥ 1"):
        an.draft_tax(1, 2, 3, 4, k=0)


def test_cost_side_of_the_seeds_hypothetical_windowed_draft():
    # Open questions: a windowed draft that recovers "roughly 1.5 ms per cycle" at 131K would run a 38.35 ms cycle
    # in 36.85 ms: 38.35 / 36.85 = 1.040706 (by hand), a wedge of "about 4%".
    step_nat = CYCLE_MS["mtp", HI]
    step_win = step_nat - RECOVERED_PER_CYCLE_MS
    assert an.cost_side_ratio(step_nat, step_win) == pytest.approx(1.040706, abs=1e-6)
    assert an.cost_side_wedge(step_nat, step_win) == pytest.approx(0.040706, abs=1e-6)
    assert round(100 * an.cost_side_wedge(step_nat, step_win)) == RECOVERED_PCT_OF_DECODE
    assert math.isnan(an.cost_side_wedge(1.0, 0.0))


# ------------------------------------------------------------------------------------------------
# The Spark study: speedup and its change, with the bootstrap
# ------------------------------------------------------------------------------------------------


def _repeats(center: float, sd: float, n: int) -> np.ndarray:
    """``n`` repeats spread symmetrically around ``center`` (so it is their median) with sample σ ``sd``."""
    x = np.linspace(-1.0, 1.0, n)
    return center + sd * x / np.std(x, ddof=1)


def test_seed_speedup_change_from_the_cycle_times():
    # The printed cycle times are the study's most precise statement of its median decode rates
    # (rate = tokPerVerify · 1000 / cycleMs, tokPerVerify from the counters); the speedup change is not among them.
    rate = {key: _tpv(*key) * 1000.0 / CYCLE_MS[key] for key in ARM_RUNGS}
    # Spread as the study describes it (Method): baseline sem 0.03–0.07 tok/s, run-to-run σ 1.3–2.0 tok/s.
    base_sd, arm_sd = 0.05 * math.sqrt(6), 1.65
    base_from, base_to = (_repeats(rate["none", r], base_sd, REPEATS[r]) for r in (LO, HI))
    arm_from, arm_to = (_repeats(rate["mtp", r], arm_sd, REPEATS[r]) for r in (LO, HI))
    ci = an.speedup_change_ci(base_from, arm_from, base_to, arm_to, n_boot=4000, seed=1)
    # Rounding: ±0.0005 on the printed +0.080, and each speedup moves by at most the relative rounding of its two
    # cycle times (0.05 % at 2K, 0.04 % at 131K).
    tol = _half_unit(3) + sum(
        (_half_unit(2) / CYCLE_MS["none", r] + _half_unit(2) / CYCLE_MS["mtp", r]) * rate["mtp", r] / rate["none", r]
        for r in (LO, HI)
    )
    assert ci.point == pytest.approx(SPEEDUP_CHANGE, abs=tol)
    assert ci.lo < ci.point < ci.hi
    s_from = an.speedup_ci(base_from, arm_from, n_boot=2000)
    s_to = an.speedup_ci(base_to, arm_to, n_boot=2000)
    assert s_to.point - s_from.point == pytest.approx(ci.point)
    assert round(s_to.point, 1) == SPEEDUP_HI
    # The study's ± 0.032 ("about 2.5σ") cannot be reproduced: it needs the per-repeat rates, which it does not
    # print. With the σ it does print, the bootstrap se of this change is 0.019–0.029: the same order, not more.
    samples = [base_from, arm_from, base_to, arm_to]
    _, replicates = an.bootstrap_replicates(samples, lambda b0, a0, b1, a1: a1 / b1 - a0 / b0, n_boot=4000)
    assert 0.01 < an.bootstrap_se(replicates) < 0.032


def test_speedup_cis_on_constant_repeats_are_exact():
    # No spread, so every replicate equals the point: 12/8 = 1.5, 9/5 = 1.8, a change of +0.3.
    base_from, arm_from, base_to, arm_to = [8.0] * 4, [12.0] * 4, [5.0] * 3, [9.0] * 3
    assert an.speedup_ci(base_from, arm_from) == pytest.approx(an.CI(1.5, 1.5, 1.5))
    assert an.speedup_change_ci(base_from, arm_from, base_to, arm_to) == pytest.approx(an.CI(0.3, 0.3, 0.3))


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


def test_percentile_ci_takes_the_quantiles_of_the_replicates():
    replicates = np.arange(1.0, 102.0)  # 1 … 101: the 2.5 % and 97.5 % quantiles are 3.5 and 98.5
    assert an.percentile_ci(50.0, replicates) == pytest.approx(an.CI(50.0, 3.5, 98.5))
    with pytest.raises(ValueError, match="level"):
        an.percentile_ci(50.0, replicates, level=1.0)


def test_bootstrap_se_is_the_spread_of_the_replicates():
    # sample σ of 2, 4, 4, 4, 5, 5, 7, 9 (mean 5, Σ(x − 5)² = 32): √(32/7)
    assert an.bootstrap_se(np.array([2.0, 4, 4, 4, 5, 5, 7, 9, np.nan])) == pytest.approx(math.sqrt(32 / 7))
    assert math.isnan(an.bootstrap_se(np.array([1.0])))
    # the bootstrap se of a mean of n draws is about σ/√n (large n and n_boot: within 3 %)
    values = np.random.default_rng(2).normal(0.0, 2.0, size=400)
    _, reps = an.bootstrap_replicates([values], lambda a: a, statistic="mean", n_boot=20_000, seed=5)
    assert an.bootstrap_se(reps) == pytest.approx(np.std(values, ddof=0) / math.sqrt(len(values)), rel=0.03)


# ------------------------------------------------------------------------------------------------
# Frames over the tidy tables (the synthetic fixture: raw cells → wmtp.analyze.tidy.collect → wmtp.analyze.analysis)
# ------------------------------------------------------------------------------------------------


def test_fixture_tables_come_from_raw_cells(tables):
    req, rungs = tables["requests"], tables["rungs"]
    assert not req["warmup"].any()  # the three warm-up requests per server were dropped by the collect step
    counts = rungs[rungs["arm"] == "none"].set_index("rung")["n_repeats"].to_dict()
    assert counts == REPEATS
    assert (rungs["prompt_tokens"] == rungs["rung"]).all()
    # counters were differenced per rung: the warm-up's counts before the first rung are not in Δdrafts
    mtp = rungs[rungs["arm"] == "mtp"].set_index("rung")
    assert mtp.at[LO, "d_drafts"] == D_DRAFTS[LO] and mtp.at[HI, "d_accepted"] == _accepted(HI)


def test_fixture_tok_per_j_from_its_rates_and_power(tables):
    # The fixture's energy is board power × decode time; tok/J is then a consequence and must round to the study's.
    # (Not at 32K, where the study prints no power and the fixture's was chosen to give its tok/J.)
    rungs = tables["rungs"].set_index(["arm", "rung"])
    for key in ARM_RUNGS:
        assert round(rungs.at[key, "tok_per_j"], TOK_PER_J_DECIMALS) == TOK_PER_J[key], key


def test_fixture_cycle_ms_agrees_with_tok_per_j_times_power(tables):
    # The fixture's rates come from the study's cycleMs, so they are compared with the independent energy route.
    rungs = tables["rungs"].set_index(["arm", "rung"])
    for arm, rung in ARM_RUNGS:
        from_energy = _tpv(arm, rung) * 1000.0 / (TOK_PER_J[arm, rung] * POWER_W[arm, rung])
        tol = _energy_route_tolerance(arm, rung) + 0.0005  # + the fixture's four-digit rates
        assert rungs.at[(arm, rung), "cycle_ms"] == pytest.approx(from_energy, rel=tol), (arm, rung)


def test_speedup_table_matches_the_rungs_medians(tables):
    req, rungs = tables["requests"], tables["rungs"]
    sp = an.speedup_table(req, n_boot=500)
    assert set(sp["arm"]) == {"mtp", "wmtp", "wmtp-ring"}
    assert len(sp) == 9
    row = sp[(sp["arm"] == "mtp") & (sp["rung"] == HI)].iloc[0]
    med = rungs.set_index(["arm", "rung"])["decode_tok_s"]
    assert row["speedup"] == pytest.approx(med["mtp", HI] / med["none", HI])
    assert round(row["speedup"], 1) == SPEEDUP_HI
    assert row["lo"] <= row["speedup"] <= row["hi"]
    assert (row["n_base"], row["n_arm"]) == (REPEATS[HI], REPEATS[HI])


def test_speedup_change_table_defaults_to_smallest_and_largest_rung(tables):
    ch = an.speedup_change_table(tables["requests"], n_boot=500)
    mtp = ch[ch["arm"] == "mtp"].iloc[0]
    assert (mtp["rung_from"], mtp["rung_to"]) == (LO, HI)
    assert mtp["change"] == pytest.approx(mtp["speedup_to"] - mtp["speedup_from"])
    # the fixture's four-digit rates move each speedup by < 0.0004, the study's rounding allows 0.0019 more
    assert mtp["change"] == pytest.approx(SPEEDUP_CHANGE, abs=0.0025)
    assert mtp["lo"] < mtp["change"] < mtp["hi"] and mtp["se"] > 0
    # the 32K "dip": the speedup there is below the 2K one (the study's noisiest rung)
    dip = an.speedup_change_table(tables["requests"], rung_to=MID, n_boot=200)
    assert dip[dip["arm"] == "mtp"].iloc[0]["change"] < 0
    one = an.speedup_change_table(tables["requests"][tables["requests"]["rung"] == LO])
    assert one.empty


def test_draft_tax_table(tables):
    tax = an.draft_tax_table(tables["rungs"], tables["requests"], n_boot=500)
    mtp = tax[tax["arm"] == "mtp"].iloc[0]
    assert (mtp["rung_from"], mtp["rung_to"], mtp["k"]) == (LO, HI, K)
    assert round(mtp["target_growth_ms"], 2) == TARGET_GROWTH_MS
    assert round(mtp["per_step_ms"], 2) == PER_STEP_MS
    # 8.58–8.85 %: what the study's rounded cycle times allow (test_seed_draft_tax_from_the_cycle_times)
    assert 0.0858 <= mtp["share"] <= 0.0885
    assert mtp["per_step_lo"] <= mtp["per_step_ms"] <= mtp["per_step_hi"]
    assert mtp["share_lo"] <= mtp["share"] <= mtp["share_hi"]
    assert an.draft_tax_table(tables["rungs"][tables["rungs"]["arm"] != "none"]).empty


def test_acceptance_and_position_tables(tables):
    acc = an.acceptance_table(tables["rungs"])
    mtp = acc[acc["arm"] == "mtp"].set_index("rung")
    for rung in (LO, HI):
        assert round(100 * mtp.at[rung, "acceptance_rate"], 1) == ACCEPTANCE_PCT[rung]
        assert round(mtp.at[rung, "tok_per_verify"], 3) == TOK_PER_VERIFY[rung]
    pos = an.position_table(tables["positions"], tables["rungs"])
    for rung in (LO, HI):
        p = pos[(pos["arm"] == "mtp") & (pos["rung"] == rung)]
        assert list(p["d_accepted_pos"]) == list(ACCEPTED_AT_POSITION[rung])
        assert p["rate"].sum() == pytest.approx(TOK_PER_VERIFY[rung] - 1.0, abs=_half_unit(3))


def test_energy_table(tables):
    en = an.energy_table(tables["rungs"], tables["requests"], n_boot=200)
    rungs = tables["rungs"].set_index(["arm", "rung"])
    for key in ARM_RUNGS:
        row = en[(en["arm"] == key[0]) & (en["rung"] == key[1])].iloc[0]
        # tok/J × W = decode tokens per second of the summed decode windows (both from the raw energy and times)
        tokens_per_s = rungs.at[key, "n_repeats"] * DECODE_TOKENS / rungs.at[key, "decode_window_s"]
        assert row["tok_per_j"] * row["power_w"] == pytest.approx(tokens_per_s, rel=1e-9)
        assert row["tok_per_j_lo"] <= row["tok_per_j"] <= row["tok_per_j_hi"]
    none = _fixture().build("x", energy=False, windowed=False)
    assert an.energy_table(none["rungs"], none["requests"]).empty


def test_prefill_table(tables):
    pf = an.prefill_table(tables["requests"], n_boot=200)
    row = pf[(pf["arm"] == "none") & (pf["rung"] == HI)].iloc[0]
    assert row["ttft_s"] == pytest.approx(TTFT_S["none", HI])
    tol = _half_unit(TTFT_DECIMALS) / TTFT_S["none", HI] + _half_unit(0) / PREFILL_TOK_S[HI]
    assert row["prefill_tok_s"] == pytest.approx(PREFILL_TOK_S[HI], rel=tol)
    assert row["prefill_tok_s_lo"] <= row["prefill_tok_s"] <= row["prefill_tok_s_hi"]


def test_cost_side_table(tables):
    cs = an.cost_side_table(tables["rungs"], tables["requests"], n_boot=500)
    assert set(cs["arm"]) == {"wmtp", "wmtp-ring"}
    row = cs[(cs["arm"] == "wmtp") & (cs["rung"] == HI)].iloc[0]
    r = tables["rungs"]
    nat = r[(r["arm"] == "mtp") & (r["rung"] == HI)]["cycle_ms"].iloc[0]
    win = r[(r["arm"] == "wmtp") & (r["rung"] == HI)]["cycle_ms"].iloc[0]
    assert row["wedge"] == pytest.approx(nat / win - 1)
    assert row["ratio"] == pytest.approx(nat / win)
    assert row["wedge_lo"] <= row["wedge"] <= row["wedge_hi"]
    plain = _fixture().build("x", windowed=False)
    assert an.cost_side_table(plain["rungs"], plain["requests"]).empty


def test_the_wedges_interval_is_of_the_two_cycles_not_of_the_two_rates():
    """Native MTP at 3 tokens per cycle and 100 tok/s (a 30 ms cycle), the window at 2 and 80 tok/s (25 ms): a wedge
    of +20 %, though the windowed arm decodes slower. Requests without spread pin the interval to the point."""
    series = {"model": "m", "engine": "e", "k": 3, "concurrency": 1, "workload": "code", "rung": 1000}
    arms = {"mtp": (3.0, 100.0, math.nan, math.nan), "wmtp": (2.0, 80.0, 16, 256)}
    rungs = pd.DataFrame(
        [
            {**series, "arm": arm, "sink": s, "window": w, "tok_per_verify": tpv, "cycle_ms": an.cycle_ms(tpv, rate)}
            for arm, (tpv, rate, s, w) in arms.items()
        ]
    )
    requests = pd.DataFrame(
        [
            {**series, "arm": arm, "sink": s, "window": w, "decode_tok_s": rate}
            for arm, (_, rate, s, w) in arms.items()
            for _ in range(3)
        ]
    )
    row = an.cost_side_table(rungs, requests, n_boot=200).iloc[0]
    assert row["wedge"] == pytest.approx(0.2)
    assert row["wedge_lo"] == pytest.approx(0.2) and row["wedge_hi"] == pytest.approx(0.2)


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
