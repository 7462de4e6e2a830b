"""Windowed-MTP inside vLLM: the draft attends to an attention sink of S tokens + the last W tokens.

Loaded by vLLM through the ``vllm.general_plugins`` entry point (``wmtp = "wmtp.plugin:register"``)
in every vLLM process: API server, EngineCore and workers. ``register()`` only installs an import hook:
the proposer module (``vllm.v1.spec_decode.llm_base_proposer``) is patched when it is first imported,
which happens in the worker only. The patched proposer reads its settings from
``--additional-config '{"wmtp": {"sink": S, "window": W, "ring": false}}'`` and does nothing when that
key is absent. The target still verifies with full context, so the output is unchanged. Model Runner V2
(``vllm.v1.worker.gpu.model_runner``), whose speculators bypass that proposer, is patched the same way to
refuse a wmtp-configured engine (``wmtp.plugin.runner``). What the draft windowed is counted and reported
to the cell (``wmtp.plugin.stats``).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType

from wmtp.plugin.hookpoints import PROPOSER_MODULE, V2_RUNNER_MODULE

# Modules patched when first imported: the proposer (windowed) and Model Runner V2 (refused when configured).
PATCHED_MODULES = (PROPOSER_MODULE, V2_RUNNER_MODULE)

_registered = False


def source_sha256() -> str:
    """A hash of the plugin's own source files (16 hex digits): names the code a server ran, beside the revision,
    also where the checkout carried no git history or had changes."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _on_import(module: ModuleType) -> None:
    if module.__name__ == V2_RUNNER_MODULE:
        from wmtp.plugin import runner

        runner.patch(module)
        return
    from wmtp.plugin import hook

    hook.patch(module)


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then patches the module before anyone can use it."""

    def __init__(self, inner: importlib.abc.Loader, patch: Callable[[ModuleType], None]):
        self._inner = inner
        self._patch = patch

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str):  # get_source, get_code, ... for inspect and linecache
        return getattr(self._inner, name)


class ImportHook(importlib.abc.MetaPathFinder):
    """Finds the modules it patches through the other finders and wraps their loaders."""

    wmtp_import_hook = True

    def __init__(self, patches: Mapping[str, Callable[[ModuleType], None]]):
        self.patches = dict(patches)

    def find_spec(self, fullname, path, target=None):
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if getattr(finder, "wmtp_import_hook", False) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def patch_on_import(patches: Mapping[str, Callable[[ModuleType], None]]) -> None:
    """Patch each named module now where it is loaded, else when it is first imported: a process that never imports
    it (an engine's API server) never loads it for the plugin's sake. One hook per set of names: a later call's
    patches replace an earlier call's."""
    for name, patch in patches.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
    names = set(patches)
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, ImportHook) or set(f.patches) != names]
    sys.meta_path.insert(0, ImportHook(patches))


def register() -> None:
    """vLLM's general-plugin entry point; safe to call any number of times in any process."""
    global _registered
    if _registered:
        return
    _registered = True
    patch_on_import(dict.fromkeys(PATCHED_MODULES, _on_import))
