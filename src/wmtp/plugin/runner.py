"""Refuse Model Runner V2 when wmtp is configured: its speculators bypass the hooked proposer.

Without this a wmtp server on a vLLM that picks V2 (the default on CUDA where Triton is present) would
serve plain MTP under a wmtp label. Imports neither torch nor vLLM, so the refusal is testable on a stand-in
module.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from wmtp.plugin import hookpoints as hp
from wmtp.plugin import window as win

_ORIGINAL = "__wmtp_original__"


def refusal() -> str:
    return (
        f"wmtp plugin: vLLM {hp.vllm_version()} runs Model Runner V2 ({hp.V2_RUNNER_MODULE}), whose speculators "
        f"bypass {hp.PROPOSER_CLASS}, so the draft would never be windowed; start the server with "
        f"{hp.V2_RUNNER_ENV}=0 (the V1 runner)"
    )


def patch(module: ModuleType) -> None:
    """Wrap the V2 runner's __init__ so that a wmtp-configured engine refuses to start; idempotent."""
    cls = getattr(module, hp.V2_RUNNER_CLASS, None)
    if cls is None or getattr(cls.__init__, _ORIGINAL, None) is not None:
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        if win.parse_config(getattr(vllm_config, "additional_config", None)) is not None:
            raise hp.HookPointError(refusal())
        original(self, vllm_config, *args, **kwargs)

    setattr(__init__, _ORIGINAL, original)
    cls.__init__ = __init__
