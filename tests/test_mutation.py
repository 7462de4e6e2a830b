"""scripts/mutation_check.py: which functions it mutates and how, and that every analysis formula is caught."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "mutation_check.py"

# A module with one of each kind of function the selection rule has to tell apart.
SOURCE = """
from dataclasses import dataclass
from typing import NamedTuple


class Pair(NamedTuple):
    a: float
    n: int
    rates: tuple[float, ...]


@dataclass(frozen=True)
class Box:
    k: int
    x: float


class Plain:
    x: float


def rate(a: float, b: float) -> float:
    def helper() -> float:
        return 2.0

    three = lambda: 3.0  # noqa: E731
    if b == 0:
        return float("nan")
    return a / b + helper() + three() - 5.0


def count(n: int) -> int:
    return n


def pair(a: float) -> Pair:
    return Pair(a, 3, (a, 2 * a))


def box(x: float) -> "Box":
    return Box(3, x)


def plain() -> Plain:
    return Plain()


def table(x: float) -> list[float]:
    return [x, 2 * x]


def _private(x: float) -> float:
    return x
"""


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutation_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutation_check"] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def mc() -> ModuleType:
    return _script()


def _load(source: str) -> dict[str, object]:
    """Executes a (mutated) module source and returns its namespace."""
    module = ModuleType("mutant")
    sys.modules["mutant"] = module  # as above: @dataclass needs the module registered while it runs
    try:
        exec(compile(source, "mutant", "exec"), module.__dict__)
    finally:
        del sys.modules["mutant"]
    return module.__dict__


def test_selection_rule(mc):
    picked = {f.name: f.kind for f in mc.select_formulas(SOURCE, "m")}
    # numbers and NamedTuple/dataclass records of the module; not a plain class, a list, or a private function
    assert picked == {"rate": mc.SCALAR, "count": mc.SCALAR, "pair": mc.RECORD, "box": mc.RECORD}
    with_table = {f.name for f in mc.select_formulas(SOURCE, "m", include=["table"], exclude=["count"])}
    assert with_table == {"rate", "pair", "box", "table"}
    with pytest.raises(ValueError, match="no top-level function named nope"):
        mc.select_formulas(SOURCE, "m", include=["nope"])


def test_scalar_mutant_scales_the_formulas_own_returns_only(mc):
    formulas = {f.name: f for f in mc.select_formulas(SOURCE, "m")}
    mutant = _load(mc.mutate_source(SOURCE, formulas["rate"], 1.01))
    # 3/1 + 2 + 3 − 5 = 3: the nested helper and lambda keep their values, the result is scaled once
    assert mutant["rate"](3.0, 1.0) == pytest.approx(3.03, abs=1e-12)
    assert math.isnan(mutant["rate"](3.0, 0.0))
    assert mutant["count"](7) == 7  # the other functions are untouched


def test_record_mutants_scale_float_fields_and_keep_ints(mc):
    formulas = {f.name: f for f in mc.select_formulas(SOURCE, "m", include=["table"])}
    pair = _load(mc.mutate_source(SOURCE, formulas["pair"], 1.01))["pair"](2.0)
    assert (pair.a, pair.n) == (pytest.approx(2.02), 3)
    assert pair.rates == pytest.approx((2.02, 4.04))
    box = _load(mc.mutate_source(SOURCE, formulas["box"], 1.01))["box"](5.0)
    assert (box.k, box.x) == (3, pytest.approx(5.05))
    assert _load(mc.mutate_source(SOURCE, formulas["table"], 1.01))["table"](1.0) == pytest.approx([1.01, 2.02])


def test_the_analysis_formulas_are_selected(mc):
    source = (ROOT / "src" / "wmtp" / "analyze" / "analysis.py").read_text()
    picked = {f.name: f.kind for f in mc.select_formulas(source, "wmtp.analyze.analysis")}
    for name in ("decode_tok_s", "cycle_ms", "tok_per_verify", "acceptance_rate", "position_rate", "tok_per_j"):
        assert picked[name] == mc.SCALAR, name
    for name in ("draft_tax", "acceptance_from_positions", "speedup_change_ci", "bootstrap_ci"):
        assert picked[name] == mc.RECORD, name
    assert not {"speedup_table", "draft_tax_table", "rungs_of", "bootstrap_replicates"} & set(picked)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_analysis_formula_is_caught(tmp_path):
    """The real check: each formula × 1.01 against tests/test_analysis.py and tests/test_tidy.py (~25 s)."""
    out = tmp_path / "mutants.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--json", str(out)], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert out.exists(), proc.stdout + proc.stderr
    results = json.loads(out.read_text())
    names = {r["formula"] for r in results}
    expected = {f"wmtp.analyze.analysis.{name}" for name in ("cycle_ms", "draft_tax", "speedup_change_ci")}
    assert expected <= names
    not_caught = [r for r in results if r["verdict"] != "caught"]
    assert not not_caught, proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
