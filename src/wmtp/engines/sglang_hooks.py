"""Does an SGLang source tree still have what the wmtp SGLang plugin patches and reads?

Reads the sources with ``ast``, never imports SGLang (its attention backends import CUDA kernels), so it runs on
any machine against a tree unpacked from a wheel (``python -m wmtp sglang-sources``) or an installed package:

    python -c "from wmtp.engines.sglang_hooks import check_hook_points; print(check_hook_points('…/sglang'))"

The names come from ``wmtp.plugin.sglang_hookpoints``. The result lists what was found and what is missing, each
as one line naming the module, class and member; ``ok`` is true when nothing is missing.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from wmtp.engines.sglang import METRICS_MODULE, metric_families
from wmtp.plugin import sglang_hookpoints as hp


def module_path(root: Path, module: str) -> Path:
    """The file of ``module`` under the ``sglang`` package folder ``root``: a module or a package's __init__."""
    base = root.joinpath(*module.split(".")[1:])
    package = base / "__init__.py"
    return package if package.exists() else base.with_suffix(".py")


def source_version(root: Path) -> str | None:
    """The version an SGLang tree says it is, from its generated version module; None when it has none."""
    path = module_path(root, hp.VERSION_MODULE)
    if not path.exists():
        return None
    found = re.search(r"^__version__\s*=.*?['\"]([^'\"]+)['\"]", path.read_text(encoding="utf-8"), re.MULTILINE)
    return found.group(1) if found else None


def source_members() -> set[str]:
    """The wheel members the checks read: each module's file, or its package's ``__init__.py``."""
    members = set()
    for module in (hp.PLUGINS_MODULE, hp.BACKEND_MODULE, hp.VERSION_MODULE, METRICS_MODULE):
        base = "/".join(module.split("."))
        members |= {f"{base}.py", f"{base}/__init__.py"}
    return members


def fetch_sources(version: str, dest: Path) -> dict[str, Any]:
    """The members the check reads out of SGLang ``version``'s wheel, under ``dest/sglang``, with the check's result."""
    from wmtp.engines.vllm_versions import fetch_sources as fetch_wheel_sources

    members = source_members()
    found = fetch_wheel_sources(version, dest, "sglang", members.__contains__)
    found["hook_points"] = check_hook_points(dest / "sglang")
    found["server_metrics"] = check_metrics(dest / "sglang")
    return found


class _Report:
    def __init__(self) -> None:
        self.found: list[str] = []
        self.missing: list[str] = []

    def note(self, present: bool, what: str) -> bool:
        (self.found if present else self.missing).append(what)
        return present


def _parse(root: Path, module: str, report: _Report) -> ast.Module | None:
    path = module_path(root, module)
    if not report.note(path.exists(), f"module {module}"):
        return None
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _top(tree: ast.Module, kind: type, name: str) -> Any:
    return next((node for node in tree.body if isinstance(node, kind) and node.name == name), None)


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)}


def _self_assigned(cls: ast.ClassDef) -> set[str]:
    """Attributes the class's methods assign as ``self.<name>``."""
    names = set()
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                names.add(target.attr)
    return names


def _attributes_read(func: ast.FunctionDef) -> set[str]:
    return {node.attr for node in ast.walk(func) if isinstance(node, ast.Attribute)}


def _check_plugins(root: Path, report: _Report) -> None:
    tree = _parse(root, hp.PLUGINS_MODULE, report)
    if tree is None:
        return
    group = None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == hp.PLUGINS_GROUP_CONSTANT for t in node.targets
        ):
            group = node.value.value if isinstance(node.value, ast.Constant) else None
    report.note(group == hp.PLUGINS_GROUP, f"{hp.PLUGINS_MODULE}.{hp.PLUGINS_GROUP_CONSTANT} = {hp.PLUGINS_GROUP!r}")
    loader = _top(tree, ast.FunctionDef, hp.PLUGINS_LOADER)
    report.note(loader is not None, f"{hp.PLUGINS_MODULE}.{hp.PLUGINS_LOADER}()")


def _check_multi_step(tree: ast.Module, report: _Report) -> None:
    where = f"{hp.BACKEND_MODULE}.{hp.MULTI_STEP_CLASS}"
    cls = _top(tree, ast.ClassDef, hp.MULTI_STEP_CLASS)
    if not report.note(cls is not None, f"class {where}"):
        return
    methods = _methods(cls)
    for name, params in hp.WRAPPED_METHODS.items():
        method = methods.get(name)
        have = tuple(arg.arg for arg in method.args.args[1:]) if method is not None else ()
        report.note(have[: len(params)] == params, f"{where}.{name}({', '.join(params)})")
    assigned = _self_assigned(cls)
    for attr in hp.MULTI_STEP_ATTRIBUTES:
        report.note(attr in assigned, f"{where}: self.{attr}")


def _check_step(tree: ast.Module, report: _Report) -> None:
    where = f"{hp.BACKEND_MODULE}.{hp.STEP_CLASS}"
    cls = _top(tree, ast.ClassDef, hp.STEP_CLASS)
    if not report.note(cls is not None, f"class {where}"):
        return
    assigned = _self_assigned(cls)
    for attr in hp.STEP_ATTRIBUTES:
        report.note(attr in assigned, f"{where}: self.{attr}")
    decode = _methods(cls).get(hp.DECODE_METHOD)
    read = _attributes_read(decode) if decode is not None else set()
    for attr in (hp.METADATA_ATTR, *hp.WINDOWED_FIELDS):
        report.note(attr in read, f"{where}.{hp.DECODE_METHOD} reads .{attr}")


def _check_metadata(tree: ast.Module, report: _Report) -> None:
    where = f"{hp.BACKEND_MODULE}.{hp.METADATA_CLASS}"
    cls = _top(tree, ast.ClassDef, hp.METADATA_CLASS)
    if not report.note(cls is not None, f"class {where}"):
        return
    fields = {
        node.target.id for node in cls.body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }
    for name in hp.WINDOWED_FIELDS:
        report.note(name in fields, f"{where}.{name}")
    # The refused fields are looked for at run time; one that a version lacks cannot be set, so it is no gap.
    report.found.extend(f"{where}.{name} (refused when set)" for name in hp.REFUSED_FIELDS if name in fields)


def check_hook_points(root: Path | str) -> dict[str, Any]:
    """What the plugin relies on in the SGLang package folder ``root`` (the one holding ``srt/``): found and missing."""
    root = Path(root)
    report = _Report()
    _check_plugins(root, report)
    tree = _parse(root, hp.BACKEND_MODULE, report)
    if tree is not None:
        _check_multi_step(tree, report)
        _check_step(tree, report)
        _check_metadata(tree, report)
    return {
        "root": str(root),
        "version": source_version(root),
        "ok": not report.missing,
        "found": report.found,
        "missing": report.missing,
    }


def declared_metrics(tree: ast.Module) -> set[str]:
    """The metric names a module declares: every string constant passed as ``name=`` to a call."""
    return {
        keyword.value.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        for keyword in node.keywords
        if keyword.arg == "name" and isinstance(keyword.value, ast.Constant) and isinstance(keyword.value.value, str)
    }


def check_metrics(root: Path | str) -> dict[str, Any]:
    """Whether the SGLang package folder ``root`` declares the server metrics the SGLang adapter reads
    (``wmtp.engines.sglang.SERVER_SAMPLES``): found and missing, as :func:`check_hook_points` says them."""
    root = Path(root)
    report = _Report()
    tree = _parse(root, METRICS_MODULE, report)
    declared = declared_metrics(tree) if tree is not None else set()
    for name in sorted(metric_families()):
        report.note(name in declared, f"{METRICS_MODULE}: metric {name}")
    return {"root": str(root), "version": source_version(root), "ok": not report.missing, **vars(report)}
