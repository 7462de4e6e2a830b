"""Does the installed vLLM still have the hook points the wmtp plugin patches?

Runs inside the engine environment (the engine build's self-check):

    python -c "from wmtp.engines.vllm_hooks import check_hook_points; import json; \\
               print(json.dumps(check_hook_points()))"

By default it reads vLLM's source with ``ast`` instead of importing it (importing the proposer module
pulls in torch and most of vLLM: ~15 s on a small CPU box); ``deep=True`` imports the module and
checks the live objects as the plugin will see them. Either way a missing hook point raises
``HookPointError`` naming the missing attribute and the vLLM version.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
from pathlib import Path

from wmtp.plugin import hookpoints as hp
from wmtp.plugin.hookpoints import HookPointError


def _vllm_root() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise HookPointError("vllm is not importable in this Python; the wmtp plugin needs vLLM")
    return Path(next(iter(spec.submodule_search_locations)))


def _module_tree(root: Path, module: str, version: str) -> tuple[Path, ast.Module]:
    path = root.joinpath(*module.split(".")[1:]).with_suffix(".py")
    if not path.exists():
        raise HookPointError(f"vLLM {version} has no module {module} (looked for {path}); the wmtp plugin patches it")
    return path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _class(tree: ast.Module, name: str, module: str, version: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise HookPointError(f"vLLM {version}: {module} has no class {name}; the wmtp plugin patches it")


def _method(cls: ast.ClassDef, name: str, module: str, version: str) -> ast.FunctionDef:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise HookPointError(f"vLLM {version}: {module}.{cls.name} has no method {name}; the wmtp plugin patches it")


def _calls_to(func: ast.FunctionDef, attr: str) -> int:
    return sum(
        1
        for node in ast.walk(func)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr
    )


def _check_params(params: list[str], version: str) -> None:
    where = f"{hp.PROPOSER_MODULE}.{hp.PROPOSER_CLASS}.{hp.BUILD_METHOD}"
    if tuple(params[: len(hp.BUILD_PARAMS)]) != hp.BUILD_PARAMS:
        raise HookPointError(
            f"vLLM {version}: {where} takes {params}, the wmtp plugin expects {list(hp.BUILD_PARAMS)} first"
        )


def _check_fields(fields: set[str], version: str) -> None:
    missing = [name for name in hp.METADATA_FIELDS if name not in fields]
    if missing:
        raise HookPointError(
            f"vLLM {version}: {hp.METADATA_MODULE}.{hp.METADATA_CLASS} has no field "
            f"{missing[0]} (missing: {missing}); the wmtp plugin replaces it"
        )
    unknown = hp.unclassified_fields(fields)
    if unknown:
        # A new length or position field that the windowed copy does not update would reach the draft's
        # kernel with its full-context value: decide about it in wmtp.plugin.hookpoints first.
        raise HookPointError(
            f"vLLM {version}: {hp.METADATA_MODULE}.{hp.METADATA_CLASS} has fields {unknown} that the wmtp "
            "plugin neither windows, keeps nor refuses (wmtp.plugin.hookpoints.WINDOWED_FIELDS, KEPT_FIELDS, "
            "REFUSED_FIELDS)"
        )


def _plugin_entry_points() -> list[str]:
    return sorted(ep.value for ep in md.entry_points(group="vllm.general_plugins") if ep.name == "wmtp")


def _class_chain(classes: dict[str, ast.ClassDef], name: str) -> list[ast.ClassDef]:
    """A class and the base classes it names that are defined in the same module, nearest first."""
    chain, todo = [], [name]
    while todo:
        node = classes.get(todo.pop(0))
        if node is not None and node not in chain:
            chain.append(node)
            todo.extend(base.id for base in node.bases if isinstance(base, ast.Name))
    return chain


def _params(func: ast.FunctionDef) -> set[str]:
    return {a.arg for a in (*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs)}


def _ring_point_missing(tree: ast.Module, cls: str | None, member: str | None, params: tuple[str, ...]) -> str:
    """'' when the point is there; else what is missing of it."""
    if cls is None:
        found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == member]
    else:
        classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
        if cls not in classes:
            return "the class"
        if member is None:
            return ""
        found = [
            n for c in _class_chain(classes, cls) for n in c.body if isinstance(n, ast.FunctionDef) and n.name == member
        ]
    if not found:
        return "the method" if cls else "the function"
    absent = [p for p in params if p not in _params(found[0])]
    return f"parameters {absent}" if absent else ""


def _assigns_self(tree: ast.Module, cls: str, attribute: str) -> bool:
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    for node in (n for c in _class_chain(classes, cls) for n in ast.walk(c)):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and target.attr == attribute
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
            ):
                return True
    return False


def _tree(root: Path, module: str) -> ast.Module | None:
    path = root.joinpath(*module.split(".")[1:]).with_suffix(".py")
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path)) if path.exists() else None


def ring_points(root: Path, version: str) -> dict:
    """Whether arm wmtp-ring's hook points exist: ``{"ring": "ok", "ring_grouping": module or None}`` or
    ``{"ring_refused": reason}``.

    A vLLM can pass the windowed draft's check and still lack what the ring replaces; then only wmtp-ring is
    refused, before its server starts.
    """
    missing = []
    for module, cls, member, params in hp.RING_POINTS:
        tree = _tree(root, module)
        gap = "the module" if tree is None else _ring_point_missing(tree, cls, member, params)
        if gap:
            missing.append(".".join(part for part in (module, cls, member) if part) + f" ({gap})")
    for module, cls, attribute in hp.RING_ATTRIBUTES:
        tree = _tree(root, module)
        if tree is None or not _assigns_self(tree, cls, attribute):
            missing.append(f"{module}.{cls}: self.{attribute}")
    if missing:
        return {"ring_refused": f"vLLM {version} lacks {', '.join(missing)}, which arm wmtp-ring relies on"}
    return {"ring": "ok", "ring_grouping": ring_grouping(root)}


def ring_grouping(root: Path) -> str | None:
    """The module whose KV cache grouping the ring stands its draft group apart in, or None (vLLM's own grouping)."""
    for module in hp.RING_GROUPING_MODULES:
        tree = _tree(root, module)
        if tree is not None and all(
            not _ring_point_missing(tree, None, name, ())
            for name in (hp.RING_GROUPING_FUNCTION, hp.RING_GROUP_SPECS_FUNCTION)
        ):
            return module
    return None


def runner_switch(root: Path, version: str) -> dict:
    """Which model runner a wmtp server runs: the V1 runner (the hooked one) or a refusal.

    vLLM versions with Model Runner V2 draft there through their own speculators; the pipeline starts every
    vLLM server with ``VLLM_USE_V2_MODEL_RUNNER=0``, which only works where vLLM reads that variable.
    """
    v2 = root.joinpath(*hp.V2_RUNNER_MODULE.split(".")[1:]).with_suffix(".py").exists()
    envs = root / "envs.py"
    switch = envs.exists() and hp.V2_RUNNER_ENV in envs.read_text(encoding="utf-8")
    if v2 and not switch:
        raise HookPointError(
            f"vLLM {version} has Model Runner V2 ({hp.V2_RUNNER_MODULE}) but no {hp.V2_RUNNER_ENV} switch in "
            "vllm/envs.py, so a server cannot be held on the V1 runner whose proposer the wmtp plugin hooks"
        )
    return {"runner": f"V1 ({hp.V2_RUNNER_ENV}=0)" if v2 else "V1 (no V2 runner)"}


def check_hook_points(deep: bool = False, root: Path | None = None, version: str | None = None) -> dict:
    """What the plugin hooks in a vLLM, as a JSON-able dict; raises HookPointError if absent.

    By default the installed vLLM; ``root`` points at another vLLM's package folder (its sources unpacked
    from a wheel) and ``version`` names it.
    """
    installed = root is None
    version = hp.vllm_version() if version is None else version
    root = _vllm_root() if root is None else root
    proposer_path, proposer_tree = _module_tree(root, hp.PROPOSER_MODULE, version)
    proposer = _class(proposer_tree, hp.PROPOSER_CLASS, hp.PROPOSER_MODULE, version)
    build = _method(proposer, hp.BUILD_METHOD, hp.PROPOSER_MODULE, version)
    params = [a.arg for a in build.args.args[1:]]
    _check_params(params, version)
    propose = _method(proposer, hp.PROPOSE_METHOD, hp.PROPOSER_MODULE, version)
    calls = _calls_to(propose, hp.BUILD_METHOD)
    if calls < 2:
        raise HookPointError(
            f"vLLM {version}: {hp.PROPOSER_CLASS}.{hp.PROPOSE_METHOD} calls "
            f"{hp.BUILD_METHOD} {calls} time(s), the wmtp plugin expects the first pass "
            "and the draft-step loop to build through it"
        )
    metadata_path, metadata_tree = _module_tree(root, hp.METADATA_MODULE, version)
    metadata = _class(metadata_tree, hp.METADATA_CLASS, hp.METADATA_MODULE, version)
    fields = {
        node.target.id
        for node in metadata.body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }
    _check_fields(fields, version)

    # Proposers that override the method bypass the wrapper; the plugin refuses them when configured.
    overriding = []
    for path in sorted(proposer_path.parent.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ClassDef)
                and node.name != hp.PROPOSER_CLASS
                and any(isinstance(f, ast.FunctionDef) and f.name == hp.BUILD_METHOD for f in node.body)
            ):
                overriding.append(f"{path.stem}.{node.name}")

    found = {
        "vllm_version": version,
        "vllm_path": str(root),
        "mode": "deep" if deep else "source",
        "proposer": f"{hp.PROPOSER_MODULE}.{hp.PROPOSER_CLASS}",
        "proposer_file": str(proposer_path),
        "method": hp.BUILD_METHOD,
        "method_params": params,
        "method_line": build.lineno,
        "calls_in_propose": calls,
        "metadata": f"{hp.METADATA_MODULE}.{hp.METADATA_CLASS}",
        "metadata_file": str(metadata_path),
        "metadata_fields": list(hp.METADATA_FIELDS),
        "metadata_fields_all": sorted(fields),
        "proposers_overriding_method": overriding,
        **runner_switch(root, version),
        **ring_points(root, version),
    }
    if installed:
        found["plugin_entry_points"] = _plugin_entry_points()
    if deep:
        found.update(_deep_check(version))
    return found


def _deep_check(version: str) -> dict:
    """Import the proposer module and check the live objects (slow: imports torch and vLLM)."""
    import dataclasses
    import importlib
    import inspect

    module = importlib.import_module(hp.PROPOSER_MODULE)
    cls = getattr(module, hp.PROPOSER_CLASS, None)
    if cls is None:
        raise HookPointError(f"vLLM {version}: {hp.PROPOSER_MODULE} has no class {hp.PROPOSER_CLASS}")
    method = getattr(cls, hp.BUILD_METHOD, None)
    if method is None:
        raise HookPointError(f"vLLM {version}: {hp.PROPOSER_CLASS} has no method {hp.BUILD_METHOD}")
    _check_params(list(inspect.signature(method).parameters)[1:], version)
    metadata_cls = getattr(importlib.import_module(hp.METADATA_MODULE), hp.METADATA_CLASS)
    _check_fields({f.name for f in dataclasses.fields(metadata_cls)}, version)
    return {"patched": bool(getattr(method, "__wmtp_original__", None))}
