"""Windowed-MTP inside SGLang: the draft's FlashAttention decode steps attend to a sink of S tokens + the last W.

SGLang loads it through the ``sglang.srt.plugins`` entry point (``wmtp = "wmtp.plugin.sglang:register"``):
``load_plugins()`` calls ``register()`` early in each of its processes (engine, scheduler). The settings come from
the environment, ``WMTP_SGLANG_WINDOW='{"sink": 16, "window": 4096}'`` (the rules of ``wmtp.plugin.window``); without
it ``register()`` does nothing.

With it, ``register()`` has the two methods of SGLang's ``FlashAttentionMultiStepBackend`` that build the draft
decode's attention metadata wrapped as SGLang imports the backend's module (``wmtp.plugin.patch_on_import``, as the
vLLM plugin patches its proposer), one step backend per draft step: ``init_forward_metadata`` (eager) and
``init_forward_metadata_out_graph`` (outside the CUDA graph, before each replay and at capture). After SGLang has
built them, every step's page table, key counts and cumulative key counts are windowed in place
(``wmtp.plugin.paged_window``): under CUDA graphs they are the buffers the captured kernels read, and nothing here
waits for the device. The target verifies with full context, so the output is unchanged.

SGLang only logs what ``register()`` raises (bad settings), and such a server serves plain MTP; a backend that lacks
what the plugin wraps raises as SGLang imports it, which stops the scheduler. Either way what the window did is
counted (``wmtp.plugin.stats``) so that a cell can tell. The names relied on are in ``wmtp.plugin.sglang_hookpoints``.
The proofs' instrument (``wmtp.plugin.sglang_testing``) is inert unless ``WMTP_PLUGIN_TEST_DIR`` is set.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
import os
import time
from typing import Any

from wmtp.plugin import paged_window, patch_on_import, sglang_testing, testing
from wmtp.plugin import sglang_hookpoints as hp
from wmtp.plugin import stats as wstats
from wmtp.plugin import window as win
from wmtp.plugin.sglang_hookpoints import HookPointError

# A child of SGLang's logger, so our lines land in the server log with SGLang's format.
log = logging.getLogger("sglang.wmtp")

ENV = hp.SETTINGS_ENV
ENGINE = "SGLang"
STATE_ATTR = "_wmtp_window"
_ORIGINAL = "__wmtp_original__"


def settings() -> win.WindowConfig | None:
    """The window's settings from ``WMTP_SGLANG_WINDOW``; None when it is unset or empty."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except ValueError as err:
        raise win.WindowConfigError(f'{ENV} must be JSON like {{"sink": 16, "window": 4096}} ({err})') from err
    config = win.parse_settings(value, ENV)
    if config.ring:
        raise win.WindowConfigError(f"{ENV}.ring: the ring is built for vLLM only")
    return config


def sglang_version() -> str:
    import importlib.metadata as md

    try:
        return md.version("sglang")
    except md.PackageNotFoundError:
        return "unknown"


def register() -> None:
    """SGLang's general-plugin entry point: where the window is set, the draft's FlashAttention metadata builds are
    wrapped when SGLang's attention backend module is first imported (at once where it already is). Nothing is
    imported here: SGLang loads its plugins in every process, and its main process, which times each request, never
    needs the backend.

    Safe to call any number of times: a wrapped method is not wrapped again. Raises, naming it, when the backend
    module lacks what the plugin patches (at its import, where SGLang imports it later).
    """
    config = settings()
    if config is None:
        return
    patch_on_import({hp.BACKEND_MODULE: functools.partial(wrap_backend, config=config)})
    sglang_testing.install()


def wrap_backend(module: Any, config: win.WindowConfig) -> None:
    """Wrap the multi-step backend's metadata builds in SGLang's attention backend module ``module``."""
    cls = getattr(module, hp.MULTI_STEP_CLASS, None)
    if cls is None:
        raise _refuse(f"has no {hp.BACKEND_MODULE}.{hp.MULTI_STEP_CLASS}")
    wrapped = 0
    for name, params in hp.WRAPPED_METHODS.items():
        method = cls.__dict__.get(name)
        if method is None:
            raise _refuse(f"has no {hp.MULTI_STEP_CLASS}.{name}")
        if getattr(method, _ORIGINAL, None) is not None:
            continue
        have = tuple(inspect.signature(method).parameters)[1:]
        if have[: len(params)] != params:
            raise _refuse(f"has {hp.MULTI_STEP_CLASS}.{name}{have}, expected {params} first")
        setattr(cls, name, _wrap(method, config))
        wrapped += 1
    if wrapped:
        log.info(
            "wmtp: the draft's FlashAttention decode steps will be windowed: sink S=%d, window W=%d",
            config.sink,
            config.window,
        )


def _refuse(what: str) -> HookPointError:
    return HookPointError(
        f"wmtp plugin: SGLang {sglang_version()} {what}; Windowed-MTP cannot hook this SGLang, its draft is not "
        f"windowed (check the sources: wmtp.engines.sglang_hooks.check_hook_points)"
    )


def _wrap(original, config: win.WindowConfig):
    @functools.wraps(original)
    def wrapper(self, forward_batch, *args, **kwargs):
        out = original(self, forward_batch, *args, **kwargs)
        if testing.skip_window():
            return out
        # A CUDA graph's capture builds metadata of no request: windowed like any other, counted as none.
        in_capture = bool(kwargs.get("in_capture", args[0] if args else False))
        window_steps(self, testing.config(config), count=not in_capture)
        return out

    setattr(wrapper, _ORIGINAL, original)
    return wrapper


@dataclasses.dataclass
class _State:
    stats: wstats.DraftStats
    logged: bool = False


def window_steps(backend: Any, config: win.WindowConfig, count: bool = True) -> None:
    """Window every step backend's freshly built metadata in place and, where ``count``, count it, one draft
    forward a step."""
    started = time.perf_counter_ns()
    state = _state(backend, config)
    for step in getattr(backend, hp.STEP_BACKENDS_ATTR):
        metadata = getattr(step, hp.METADATA_ATTR, None)
        _refuse_unwindowable(metadata)
        page_size = int(getattr(step, hp.PAGE_SIZE_ATTR))
        if not state.logged:
            state.logged = True
            _log_start(config, page_size)
        lengths = metadata.cache_seqlens_int32
        longest = lengths.max() if lengths.numel() else None  # on the device: read back with the dropped pages
        dropped = paged_window.window_draft_step(
            metadata.page_table, lengths, metadata.cu_seqlens_k, config.sink, config.window, page_size
        )
        if count:
            state.stats.record(config.sink, config.window, page_size, 0, 1, dropped, device_max_seq_len=longest)
    if count:
        state.stats.add_host_ns(time.perf_counter_ns() - started)


def _state(backend: Any, config: win.WindowConfig) -> _State:
    state = getattr(backend, STATE_ATTR, None)
    if state is None:
        topk = getattr(backend, hp.TOPK_ATTR)
        if topk > 1:
            raise NotImplementedError(
                f"wmtp: the window assumes a chain draft (--speculative-eagle-topk 1); this draft has topk={topk}"
            )
        # Each step windows from its own length (no cycle's window kept across steps): the window anchors a forward.
        stats = wstats.DraftStats(config.sink, config.window, sglang_version(), engine=ENGINE, window_anchor="forward")
        state = _State(stats)
        setattr(backend, STATE_ATTR, state)
    return state


def _refuse_unwindowable(metadata: Any) -> None:
    if metadata is None or any(getattr(metadata, name, None) is None for name in hp.WINDOWED_FIELDS):
        raise NotImplementedError(
            f"wmtp: a draft step's metadata lacks one of {hp.WINDOWED_FIELDS}; the window cannot be set"
        )
    for name in hp.REFUSED_FIELDS:
        if getattr(metadata, name, None) is not None:
            raise NotImplementedError(
                f"wmtp: the draft step's metadata sets {name}, which the kernel may read instead of the windowed "
                "page table or which was planned for the full lengths; wmtp does not support it"
            )


def _log_start(config: win.WindowConfig, page_size: int) -> None:
    eff = wstats.effective(config.sink, config.window, page_size)
    log.info(
        "wmtp: windowed MTP draft active: sink S=%d, window W=%d, page size %d (sink %d page(s); window at least W "
        "tokens, page-aligned)",
        config.sink,
        config.window,
        page_size,
        eff["sink_blocks"],
    )
    if config.sink % page_size or config.window % page_size:
        log.warning(
            "wmtp: S=%d and W=%d are not both multiples of the page size %d: the draft reads a sink of %d tokens and "
            "a window of %d-%d tokens before each step's query",
            config.sink,
            config.window,
            page_size,
            eff["sink_tokens"],
            eff["window_tokens_min"],
            eff["window_tokens_max"],
        )
