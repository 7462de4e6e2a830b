"""Greedy outputs equal "up to numerics" (docs/design.md, "Lossless up to numerics").

A speculative arm verifies k+1 tokens in one batched forward, so bf16 rounding can flip an argmax
that the reference arm decided by a hair. Equality therefore means: identical token ids, or a first
divergence at a position where the reference's top-2 logprob gap is below ``eps``. After a divergence
the sequences are no longer comparable, so nothing past it is judged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_EPS = 0.05


@dataclass(frozen=True)
class Verdict:
    equal: bool
    identical: bool
    first_divergence: int | None
    reference_gap: float | None
    reason: str


def first_divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    for i, (a, b) in enumerate(zip(reference, other, strict=False)):
        if a != b:
            return i
    if len(reference) != len(other):
        return min(len(reference), len(other))
    return None


def equal_up_to_numerics(
    reference: Sequence[int], reference_gaps: Sequence[float], other: Sequence[int], eps: float = DEFAULT_EPS
) -> Verdict:
    i = first_divergence(reference, other)
    if i is None:
        return Verdict(True, True, None, None, "token-identical")
    if i >= len(reference) or i >= len(other):
        return Verdict(False, False, i, None, f"lengths differ ({len(reference)} vs {len(other)})")
    gap = float(reference_gaps[i])
    if gap < eps:
        return Verdict(
            True, False, i, gap, f"first divergence at token {i} is a near-tie of the reference (gap {gap:.4f} < {eps})"
        )
    return Verdict(
        False,
        False,
        i,
        gap,
        f"divergence at token {i} where the reference was confident (gap {gap:.4f} ≥ {eps}): "
        f"reference {reference[i]} vs {other[i]}",
    )
