#!/usr/bin/env python
"""Mutation check of the formula functions: does some test fail when one formula is off by 1 %?

For every *formula* of the given modules (default ``wmtp.analyze.analysis``), one at a time, a copy of ``src/``
is made in a scratch directory with that one function's results multiplied by ``--factor`` (1.01), and
the tests (default ``tests/test_analysis.py tests/test_tidy.py``) run against the copy
(``PYTHONPATH=<copy>/src``). A formula whose mutant passes every test SURVIVED: nothing checks its value
to 1 %. Exit status 0 when every mutant was caught, 1 when one survived, 2 when the check itself could
not run (the unmutated tests fail, a mutant does not import, a run timed out ...).

Which functions are formulas — decided on the module's AST, without importing it:

* a top-level ``def`` whose name does not start with ``_`` and whose return annotation is ``float`` or
  ``int`` ("returns a number"): every ``return X`` in its body (not in nested functions or lambdas)
  becomes ``return (X) * factor``;
* a top-level public ``def`` whose return annotation names a NamedTuple or a ``@dataclass`` defined at
  the top of the same module (``DraftTax``, ``AcceptanceFromPositions``, ``CI`` ...): every ``return X``
  becomes ``return _wmtp_mutant_scale(X)``, which multiplies each *float* field (and the floats inside
  a tuple field) by the factor and leaves ints alone — in these records ints are counts or echoed
  configuration (``k``), not results. Perturbing the returned fields, rather than one operator inside,
  is what a caller sees whichever inner operation is wrong, and it needs no knowledge of the body;
* names listed in :data:`EXPLICIT` for the module, or given with ``--include``, whatever they return
  (scaled like a record: numbers, numeric arrays, tuples, lists, NamedTuples and dataclasses; any other
  value, e.g. a DataFrame, comes back unchanged, so such a mutant reports SURVIVED rather than a false
  "caught");
* minus names in :data:`EXCLUDE` or given with ``--exclude``.

Mutants run in parallel (``--jobs``, default: the number of CPUs, at most 4). That is safe because each
mutant has its own copy of ``src/`` and its own pytest ``--basetemp``, the cache provider is off and no
bytecode is written, so runs share no writable state.

Usage::

    python scripts/mutation_check.py                       # wmtp.analyze.analysis against the analysis tests
    python scripts/mutation_check.py --module wmtp.analyze.costmodel --tests tests/test_costmodel.py
    python scripts/mutation_check.py --list                # only print the formulas it would mutate
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
DEFAULT_MODULES = ("wmtp.analyze.analysis",)
DEFAULT_TESTS = ("tests/test_analysis.py", "tests/test_tidy.py")
DEFAULT_FACTOR = 1.01
DEFAULT_TIMEOUT_S = 300.0
NUMBER_ANNOTATIONS = frozenset({"float", "int"})
#: Formulas the annotation rule would miss, per module: those over arrays.
EXPLICIT: dict[str, tuple[str, ...]] = {
    "wmtp.analyze.analysis": ("cycle_ms_of", "request_cycle_ms_of", "cost_side_wedge_of")
}
#: Public functions the rule would pick that are not formulas, per module.
EXCLUDE: dict[str, tuple[str, ...]] = {"wmtp.analyze.analysis": ()}
SCALE_HELPER = "_wmtp_mutant_scale"

SCALAR, RECORD = "scalar", "record"
CAUGHT, SURVIVED, ERROR = "caught", "SURVIVED", "ERROR"

# Appended to the mutated module; only called at run time, so its place in the module does not matter.
_HELPER_SOURCE = """
def {name}(value, _factor={factor!r}):
    import dataclasses as _dc
    import numbers as _numbers

    def _field(v):
        if isinstance(v, bool) or not isinstance(v, (float, tuple)):
            return v
        if isinstance(v, float):
            return v * _factor
        if hasattr(v, "_fields"):
            return v
        return tuple(_field(x) for x in v)

    if _dc.is_dataclass(value) and not isinstance(value, type):
        return _dc.replace(value, **{{f.name: _field(getattr(value, f.name)) for f in _dc.fields(value)}})
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return value._replace(**{{f: _field(getattr(value, f)) for f in value._fields}})
    if isinstance(value, (tuple, list)):
        return type(value)({name}(v, _factor) for v in value)
    if isinstance(value, _numbers.Number) and not isinstance(value, bool):
        return value * _factor
    if getattr(value, "dtype", None) is not None and getattr(value.dtype, "kind", "") in "fiu":
        return value * _factor
    return value
"""


@dataclass(frozen=True)
class Formula:
    module: str
    name: str
    kind: str  # SCALAR: return (X) * factor; RECORD: return helper(X)
    line: int

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass
class Result:
    formula: str
    kind: str
    verdict: str
    seconds: float
    detail: str


def module_path(module: str, src: Path = SRC) -> Path:
    path = src.joinpath(*module.split(".")).with_suffix(".py")
    if not path.exists():
        raise FileNotFoundError(f"{module}: no {path}")
    return path


def _annotation_name(node: ast.expr | None) -> str | None:
    """``float`` for ``-> float`` / ``-> "float"``, ``DraftTax`` for ``-> mod.DraftTax``; None otherwise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return None
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _is_record_class(node: ast.ClassDef) -> bool:
    bases = {_annotation_name(b) for b in node.bases}
    if "NamedTuple" in bases:
        return True
    for deco in node.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        if _annotation_name(target) == "dataclass":
            return True
    return False


def select_formulas(
    source: str, module: str, include: Iterable[str] = (), exclude: Iterable[str] = ()
) -> list[Formula]:
    """The formulas of a module's source, by the rule in this script's docstring."""
    tree = ast.parse(source)
    records = {n.name for n in tree.body if isinstance(n, ast.ClassDef) and _is_record_class(n)}
    explicit = set(EXPLICIT.get(module, ())) | set(include)
    excluded = set(EXCLUDE.get(module, ())) | set(exclude)
    found = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name in excluded:
            continue
        returns = _annotation_name(node.returns)
        if node.name in explicit:
            kind = SCALAR if returns in NUMBER_ANNOTATIONS else RECORD
        elif node.name.startswith("_"):
            continue
        elif returns in NUMBER_ANNOTATIONS:
            kind = SCALAR
        elif returns in records:
            kind = RECORD
        else:
            continue
        found.append(Formula(module, node.name, kind, node.lineno))
    missing = explicit - {f.name for f in found}
    if missing:
        raise ValueError(f"{module}: no top-level function named {', '.join(sorted(missing))}")
    return found


class _ReturnRewriter(ast.NodeTransformer):
    """Rewrites the returns of one function body, not those of functions or lambdas nested in it."""

    def __init__(self, kind: str, factor: float) -> None:
        self.kind, self.factor, self.count = kind, factor, 0

    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        return node  # a nested def: its returns are not the formula's

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_Lambda(self, node: ast.Lambda) -> ast.AST:
        return node

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.AST:
        return node

    def visit_Return(self, node: ast.Return) -> ast.AST:
        if node.value is None:
            return node
        self.count += 1
        if self.kind == SCALAR:
            value: ast.expr = ast.BinOp(left=node.value, op=ast.Mult(), right=ast.Constant(self.factor))
        else:
            value = ast.Call(func=ast.Name(SCALE_HELPER, ast.Load()), args=[node.value], keywords=[])
        return ast.copy_location(ast.Return(value=value), node)


def mutate_source(source: str, formula: Formula, factor: float = DEFAULT_FACTOR) -> str:
    """The module's source with ``formula``'s results multiplied by ``factor``."""
    tree = ast.parse(source)
    target = next(
        (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == formula.name),
        None,
    )
    if target is None:
        raise ValueError(f"{formula.qualname}: not a top-level function")
    rewriter = _ReturnRewriter(formula.kind, factor)
    target.body = [rewriter.visit(stmt) for stmt in target.body]
    if rewriter.count == 0:
        raise ValueError(f"{formula.qualname}: no return statement to mutate")
    if formula.kind == RECORD:
        tree.body.extend(ast.parse(_HELPER_SOURCE.format(name=SCALE_HELPER, factor=factor)).body)
    return ast.unparse(ast.fix_missing_locations(tree))


def _copy_src(dest: Path) -> Path:
    shutil.copytree(SRC, dest / "src", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    return dest / "src"


def _env(src: Path) -> dict[str, str]:
    env = dict(os.environ)
    # The copy must shadow the editable install (a .pth entry, which comes after PYTHONPATH on sys.path).
    env["PYTHONPATH"] = os.pathsep.join([str(src), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no pyc next to the shared tests while mutants run in parallel
    env.pop("PYTEST_ADDOPTS", None)
    return env


def _check_shadowing(src: Path, modules: Sequence[str]) -> None:
    probe = "import importlib, sys; print('\\n'.join(importlib.import_module(m).__file__ for m in sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", probe, *modules], cwd=ROOT, env=_env(src), capture_output=True, text=True, check=False
    )
    files = proc.stdout.split()
    if proc.returncode != 0 or len(files) != len(modules) or not all(Path(f).is_relative_to(src) for f in files):
        raise RuntimeError(f"the copy in {src} does not shadow the installed package:\n{proc.stdout}{proc.stderr}")


def _failed_tests(output: str) -> str:
    """The failing test ids from pytest's short summary (``-ra``), else its last line."""
    lines = output.strip().splitlines()
    failed = [line.removeprefix("FAILED ").split(" - ")[0] for line in lines if line.startswith("FAILED ")]
    errors = [line for line in lines if line.startswith("ERROR ")]
    return ", ".join(failed) or (errors[0] if errors else lines[-1] if lines else "")


def _run_tests(src: Path, tests: Sequence[str], basetemp: Path, timeout_s: float) -> tuple[int | None, str, float]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", f"--basetemp={basetemp}", *tests]
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=_env(src), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout_s:.0f} s", time.monotonic() - start
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def _run_mutant(
    formula: Formula, scratch: Path, tests: Sequence[str], factor: float, timeout_s: float, index: int
) -> Result:
    work = scratch / f"m{index:03d}"
    src = _copy_src(work)
    path = module_path(formula.module, src)
    path.write_text(mutate_source(path.read_text(), formula, factor))
    rc, output, seconds = _run_tests(src, tests, work / "pytest", timeout_s)
    if rc == 1:  # pytest: tests ran and some failed
        verdict, detail = CAUGHT, _failed_tests(output)
    elif rc == 0:
        verdict, detail = SURVIVED, "every test passed"
    else:  # interrupted, internal or usage error, nothing collected, timeout: the check did not run
        verdict, detail = ERROR, f"pytest exit {rc}: {_failed_tests(output)}"
    shutil.rmtree(work, ignore_errors=True)
    return Result(formula.qualname, formula.kind, verdict, seconds, detail)


def run_check(
    modules: Sequence[str],
    tests: Sequence[str],
    *,
    factor: float = DEFAULT_FACTOR,
    jobs: int = 1,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    include: Sequence[str] = (),
    exclude: Sequence[str] = (),
    only: Sequence[str] = (),
    log: Callable[[str], None] = print,
) -> list[Result]:
    """Run the baseline and every mutant; raises RuntimeError when the unmutated tests do not pass."""
    formulas = [
        f
        for m in modules
        for f in select_formulas(module_path(m).read_text(), m, include, exclude)
        if not only or f.name in only or f.qualname in only
    ]
    if not formulas:
        raise RuntimeError(f"no formula selected in {', '.join(modules)}")
    with tempfile.TemporaryDirectory(prefix="wmtp-mutants-") as tmp:
        scratch = Path(tmp)
        base_src = _copy_src(scratch / "baseline")
        _check_shadowing(base_src, modules)
        rc, output, _ = _run_tests(base_src, tests, scratch / "baseline" / "pytest", timeout_s)
        summary = output.strip().splitlines()[-1] if output.strip() else ""
        if rc != 0:
            raise RuntimeError(f"the unmutated tests do not pass (pytest exit {rc}):\n{output[-4000:]}")
        log(f"  baseline (no mutation): {summary}")
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futures = [
                pool.submit(_run_mutant, f, scratch, tests, factor, timeout_s, i) for i, f in enumerate(formulas)
            ]
            results = []
            width = max(len(f.qualname) for f in formulas)
            for future in futures:  # in source order; they finish in any order
                r = future.result()
                results.append(r)
                log(f"  {r.verdict:<8}  {r.formula:<{width}}  {r.kind:<6}  {r.seconds:5.1f} s  {r.detail}")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--module",
        action="append",
        default=[],
        help="module to mutate (repeat; wmtp.analyze.analysis is always included)",
    )
    parser.add_argument("--tests", nargs="+", default=list(DEFAULT_TESTS), help="test files or node ids to run")
    parser.add_argument("--factor", type=float, default=DEFAULT_FACTOR)
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1), help="mutants run at once")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per test run")
    parser.add_argument("--include", action="append", default=[], help="also mutate this function (repeat)")
    parser.add_argument("--exclude", action="append", default=[], help="do not mutate this function (repeat)")
    parser.add_argument("--only", action="append", default=[], help="mutate only this function (repeat)")
    parser.add_argument("--list", action="store_true", help="print the selected formulas and exit")
    parser.add_argument("--json", type=Path, help="also write the results as JSON to this file")
    args = parser.parse_args(argv)
    modules = list(dict.fromkeys([*DEFAULT_MODULES, *args.module]))
    if args.list:
        for m in modules:
            for f in select_formulas(module_path(m).read_text(), m, args.include, args.exclude):
                print(f"{f.qualname}  ({f.kind}, line {f.line})")
        return 0
    start = time.monotonic()
    print(f"mutation check: each formula's results × {args.factor}, one formula at a time")
    print(f"  modules: {' '.join(modules)}   tests: {' '.join(args.tests)}   jobs: {args.jobs}")
    try:
        results = run_check(
            modules,
            args.tests,
            factor=args.factor,
            jobs=args.jobs,
            timeout_s=args.timeout,
            include=args.include,
            exclude=args.exclude,
            only=args.only,
        )
    except (RuntimeError, ValueError, FileNotFoundError) as exc:
        print(f"mutation check could not run: {exc}", file=sys.stderr)
        return 2
    counts = {v: sum(r.verdict == v for r in results) for v in (CAUGHT, SURVIVED, ERROR)}
    elapsed = time.monotonic() - start
    print(
        f"{len(results)} formulas: {counts[CAUGHT]} caught, {counts[SURVIVED]} survived, {counts[ERROR]} errors "
        f"({elapsed:.1f} s)"
    )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
    if counts[ERROR]:
        return 2
    return 1 if counts[SURVIVED] else 0


if __name__ == "__main__":
    sys.exit(main())
