"""What a CPU training run reproduces, and the check of one run against a committed expectation.

Bytes are a promise on one machine only: the same machine, torch and pinned dispatch level write the same
weights twice. Across CPUs they are not. Kernels of one instruction set still differ by CPU model in how
they block and sum, so one float32 rounding differs, and twenty AdamW steps carry it into the last bits of
every weight. What holds across CPUs is the run's course: its loss at every logged step agrees within a
relative tolerance far below what any change of the recipe (data, schedule, seed) moves it by, and the
trained target's greedy continuations of fixed held-out prompts agree up to near ties (the lossless tests'
comparison, wmtp.analyze.equality).

:func:`expectation` cuts that course out of a training manifest (``wmtp-model.json``); :func:`compare` lists
how a run departs from a committed one. Both are pure.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from wmtp.analyze.equality import equal_up_to_numerics

# Measured on the tiny budget (20 logged steps): an Intel Xeon with AMX under torch 2.11 and an AMD EPYC with AVX-512
# under torch 2.13, at the AVX2 and the scalar dispatch levels, differed by at most 1.5e-6 relative in any logged
# loss; a warm-up one step shorter moved the loss by 2.2e-3 at its first differing step and by up to 8.8e-2.
LOSS_RTOL = 1e-4
# Greedy probe: a flip where the expected top-2 log-probabilities lay closer than this is a near tie.
PROBE_EPS = 0.05
HELDOUT_LOSSES = ("target_loss", "joint_target_loss")


def expectation(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The reproducible course of a training run, from its manifest."""
    log = manifest["log"]
    heldout = log.get("heldout", {})
    return {
        "target_loss": [[int(row[0]), float(row[1])] for row in log["target_loss"]],
        "mtp_loss": [[int(row[0]), float(row[1])] for row in log["mtp_loss"]],
        "heldout": {name: float(heldout[name]) for name in HELDOUT_LOSSES if name in heldout},
        "probe": [{"ids": list(p["ids"]), "gaps": list(p["gaps"])} for p in log.get("probe", [])],
        "made_on": manifest.get("cpu_model"),
        "made_with": {
            "torch": manifest.get("torch"),
            "cpu_dispatch": manifest.get("cpu_dispatch"),
            "cpu_capability": manifest.get("cpu_capability"),
        },
    }


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def _compare_losses(name: str, expected: Sequence[Sequence[float]], got: Sequence[Sequence[float]], rtol: float):
    if [int(s) for s, _ in expected] != [int(s) for s, _ in got]:
        return [f"{name}: logged at steps {[int(s) for s, _ in got]}, expected {[int(s) for s, _ in expected]}"]
    for (step, want), (_, have) in zip(expected, got, strict=True):
        if not (math.isfinite(have) and _relative(want, have) <= rtol):
            return [f"{name} at step {int(step)}: {have} where {want} was expected (relative tolerance {rtol:g})"]
    return []


def compare(
    expected: Mapping[str, Any],
    got: Mapping[str, Any],
    rtol: float = LOSS_RTOL,
    eps: float = PROBE_EPS,
) -> list[str]:
    """How ``got`` departs from ``expected`` (both from :func:`expectation`); empty when it reproduces it.

    For each loss series, the first step outside ``rtol``; for each held-out loss, whether it is within
    ``rtol``; for each greedy probe, a first divergence where the expected run was confident (gap ≥ ``eps``).
    """
    problems: list[str] = []
    for series in ("target_loss", "mtp_loss"):
        problems += _compare_losses(series, expected[series], got[series], rtol)
    for name, want in expected["heldout"].items():
        have = got["heldout"].get(name)
        if have is None or not _relative(want, have) <= rtol:
            problems.append(f"held-out {name}: {have} where {want} was expected (relative tolerance {rtol:g})")
    if len(expected["probe"]) != len(got["probe"]):
        problems.append(f"greedy probe: {len(got['probe'])} prompts, expected {len(expected['probe'])}")
    for i, (want, have) in enumerate(zip(expected["probe"], got["probe"], strict=False)):
        verdict = equal_up_to_numerics(want["ids"], want["gaps"], have["ids"], eps)
        if not verdict.equal:
            problems.append(f"greedy probe {i}: {verdict.reason}")
    return problems
