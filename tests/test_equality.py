"""The near-tie-aware comparison of greedy outputs."""

from __future__ import annotations

from wmtp.analyze.equality import equal_up_to_numerics, first_divergence


def test_identical():
    v = equal_up_to_numerics([1, 2, 3], [1.0, 1.0, 1.0], [1, 2, 3])
    assert v.equal and v.identical and v.first_divergence is None


def test_divergence_at_near_tie_is_numerics():
    v = equal_up_to_numerics([1, 2, 3, 4], [1.0, 0.004, 1.0, 1.0], [1, 9, 8, 7], eps=0.01)
    assert v.equal and not v.identical and v.first_divergence == 1 and v.reference_gap == 0.004


def test_divergence_at_confident_token_fails():
    v = equal_up_to_numerics([1, 2, 3], [1.0, 0.5, 1.0], [1, 9, 3], eps=0.01)
    assert not v.equal and "confident" in v.reason


def test_length_mismatch_is_a_divergence():
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert not equal_up_to_numerics([1, 2], [1.0, 1.0], [1, 2, 3]).equal
