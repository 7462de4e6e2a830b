"""A training run's course against a committed one (wmtp.model.reproduce): pure, no torch."""

from __future__ import annotations

import copy

from wmtp.model.reproduce import LOSS_RTOL, compare, expectation


def _manifest() -> dict:
    return {
        "torch": "2.13.0+cpu",
        "cpu_dispatch": "avx2",
        "cpu_capability": "AVX2",
        "log": {
            "target_loss": [[1, 7.6123, 0.0], [2, 7.5012, 0.01], [3, 7.3001, 0.02]],
            "mtp_loss": [[1, 12.5], [2, 12.25]],
            "heldout": {"target_loss": 7.2, "target_copy_accuracy": 0.05, "mtp_agreement": [0.1, 0.0, 0.0]},
            "probe": [{"start": 0, "ids": [5, 9, 9, 4], "gaps": [0.8, 0.01, 1.2, 0.4]}],
        },
    }


def test_the_expectation_keeps_losses_and_the_probe_and_drops_discrete_counts():
    found = expectation(_manifest())
    assert found["target_loss"] == [[1, 7.6123], [2, 7.5012], [3, 7.3001]]
    assert found["heldout"] == {"target_loss": 7.2}
    assert found["probe"] == [{"ids": [5, 9, 9, 4], "gaps": [0.8, 0.01, 1.2, 0.4]}]
    assert found["made_with"]["cpu_dispatch"] == "avx2"


def test_a_run_within_the_tolerance_reproduces_and_one_beyond_it_names_the_step():
    want = expectation(_manifest())
    near = copy.deepcopy(want)
    near["target_loss"][1][1] *= 1 + LOSS_RTOL / 2
    assert compare(want, near) == []
    far = copy.deepcopy(want)
    far["target_loss"][2][1] *= 1 + 2 * LOSS_RTOL
    assert compare(want, far) == [
        f"target_loss at step 3: {far['target_loss'][2][1]} where 7.3001 was expected "
        f"(relative tolerance {LOSS_RTOL:g})"
    ]


def test_a_non_finite_loss_or_other_logged_steps_do_not_reproduce():
    want = expectation(_manifest())
    nan = copy.deepcopy(want)
    nan["mtp_loss"][0][1] = float("nan")
    assert compare(want, nan)[0].startswith("mtp_loss at step 1: nan")
    fewer = copy.deepcopy(want)
    fewer["target_loss"].pop()
    assert compare(want, fewer)[0] == "target_loss: logged at steps [1, 2], expected [1, 2, 3]"


def test_the_held_out_loss_is_checked():
    want = expectation(_manifest())
    got = copy.deepcopy(want)
    got["heldout"]["target_loss"] = 7.3
    expected = f"held-out target_loss: 7.3 where 7.2 was expected (relative tolerance {LOSS_RTOL:g})"
    assert compare(want, got) == [expected]


def test_a_probe_may_flip_at_a_near_tie_but_not_where_the_expected_run_was_confident():
    want = expectation(_manifest())
    tie = copy.deepcopy(want)
    tie["probe"][0]["ids"] = [5, 4, 1, 1]  # diverges at token 1, where the expected gap was 0.01
    assert compare(want, tie) == []
    confident = copy.deepcopy(want)
    confident["probe"][0]["ids"] = [6, 9, 9, 4]  # token 0, gap 0.8
    (problem,) = compare(want, confident)
    assert problem.startswith("greedy probe 0: divergence at token 0 where the reference was confident (gap 0.8000")
    missing = copy.deepcopy(want)
    missing["probe"] = []
    assert compare(want, missing) == ["greedy probe: 0 prompts, expected 1"]
