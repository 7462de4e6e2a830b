"""Spec-decode counter snapshots and their differences over a rung (engine-neutral, short names)."""

from __future__ import annotations


class CounterReset(RuntimeError):
    """A counter went backwards between two snapshots: the window is invalid, not partial."""


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    keys = sorted(set(before) | set(after))
    out = {}
    for key in keys:
        d = after.get(key, 0.0) - before.get(key, 0.0)
        if d < 0:
            raise CounterReset(f"counter {key} went backwards ({before.get(key)} → {after.get(key)})")
        out[key] = d
    return out
