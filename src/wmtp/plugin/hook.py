"""The vLLM-touching half of the plugin: patch the drafter, window its attention metadata.

Imported only inside a vLLM process, when ``vllm.v1.spec_decode.llm_base_proposer`` is first
imported (see ``wmtp.plugin.register``). The index math is ``wmtp.plugin.window``'s, applied here to
whole batches with tensor operations that never synchronise with the device. The hook runs on the host
before every draft forward, on the engine's critical path wherever the host sets the pace: a decode
cycle's first forward gathers the windowed table, its later forwards reuse it and launch one kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
import time
from types import ModuleType
from typing import Any

import torch

from wmtp.plugin import hookpoints as hp
from wmtp.plugin import stats as wstats
from wmtp.plugin import testing
from wmtp.plugin import window as win
from wmtp.plugin.hookpoints import HookPointError

# A child of vLLM's logger, so our lines land in the server log with vLLM's format and level.
log = logging.getLogger("vllm.wmtp")

STATE_ATTR = "_wmtp_window"
HOST_LENGTH_COPIES = ("_seq_lens_cpu", "_num_computed_tokens_cpu")
_ORIGINAL = "__wmtp_original__"


def window_metadata(cm: Any, config: win.WindowConfig, block_size: int) -> Any:
    """A copy of the common attention metadata that reads only sink ∪ window; ``cm`` is untouched.

    Replaced on the copy: the block table (gathered, int64 index), ``seq_lens`` and
    ``seq_lens_cpu_upper_bound`` (new tensors: ``propose()`` later mutates the originals in place),
    ``max_seq_len`` (a bound that no longer grows with the context) and the cached
    ``num_computed_tokens``. The slot mapping, ``query_start_loc`` and the positions stay: KV writes
    and the per-step slot update go through the full table (``hookpoints.WINDOWED_FIELDS`` and
    ``KEPT_FIELDS``).
    """
    return windowed_with_drops(cm, config, block_size)[0]


@dataclasses.dataclass
class _Cycle:
    """What a decode cycle's first draft forward windowed, for its later forwards to reuse."""

    table: torch.Tensor  # the full block table it was gathered from: a later forward must hand in the same one
    rows: int
    config: win.WindowConfig
    block_size: int
    dropped: torch.Tensor  # blocks dropped per row
    windowed_table: torch.Tensor
    seq_len_bound: int  # of the first forward's windowed lengths; each later forward is one token longer
    buffers: Any = None  # the proposer's fused.CycleBuffers where its kernels windowed the cycle


def windowed_with_drops(cm: Any, config: win.WindowConfig, block_size: int) -> tuple[Any, Any | None]:
    """``window_metadata`` and the per-row count of dropped blocks (a device tensor; None when handed through)."""
    windowed, cycle = _window_first(cm, config, block_size)
    return windowed, None if cycle is None else cycle.dropped


def _window_first(
    cm: Any, config: win.WindowConfig, block_size: int, width: int | None = None, buffers: Any = None
) -> tuple[Any, _Cycle | None]:
    """The windowed copy of a forward that sets its own window; its table ``width`` columns wide (at most the full
    table's), by default enough for this forward alone; by one kernel into ``buffers`` (``fused.CycleBuffers``)
    where given."""
    sink, window = config.sink, config.window
    if not win.needs_window(cm.max_seq_len, sink, window):
        return cm, None
    _refuse_positional_fields(cm)
    seq_lens = cm.seq_lens
    n = seq_lens.shape[0]
    query_start = cm.query_start_loc
    n_sink = win.sink_blocks(sink, block_size)
    bound = win.seq_len_bound(cm.max_query_len, sink, window, block_size)
    if width is None:
        width = win.table_width_bound(cm.max_query_len, sink, window, block_size)
    if buffers is not None:
        full = cm.block_table_tensor
        width = min(full.shape[1], width)
        table, lens, drop = buffers.first(seq_lens, query_start, full, n_sink, window, block_size, width)
        cycle = _Cycle(full, n, config, block_size, drop, table, bound, buffers)
        return _windowed_copy(cm, table, lens, bound), cycle
    # ⌊(p0 − W) / B⌋ − n_sink, at least 0, with p0 = seq_len − query_len: folding the sink into the shift keeps it to
    # five small kernels, each launched from the host before every draft forward.
    drop = torch.sub(seq_lens, query_start[1 : n + 1]).add_(query_start[:n]).sub_(window + n_sink * block_size)
    drop = drop.div_(block_size, rounding_mode="floor").clamp_(min=0)
    new_seq_lens = seq_lens.sub(drop, alpha=block_size)

    table = cm.block_table_tensor
    rows, cols = table.shape
    width = min(cols, width)
    column, after_sink = _columns(width, n_sink, table.device)
    row_drop = drop if rows == n else torch.cat([drop, drop.new_zeros(max(rows - n, 0))])[:rows]
    index = torch.mul(row_drop[:, None], after_sink).add_(column).clamp_(max=cols - 1)
    new_table = torch.gather(table, 1, index)

    cycle = _Cycle(table, n, config, block_size, drop, new_table, bound)
    return _windowed_copy(cm, new_table, new_seq_lens, bound), cycle


def _window_later(cm: Any, cycle: _Cycle, step: int) -> Any:
    """The windowed copy of a later forward of an anchored cycle, ``step`` tokens on: one kernel."""
    _refuse_positional_fields(cm)
    if cycle.buffers is not None:
        new_seq_lens = cycle.buffers.later(cm.seq_lens, cycle.dropped, cycle.block_size, step)
    else:
        new_seq_lens = torch.sub(cm.seq_lens, cycle.dropped, alpha=cycle.block_size)
    return _windowed_copy(cm, cycle.windowed_table, new_seq_lens, cycle.seq_len_bound + step)


def _windowed_copy(cm: Any, table: torch.Tensor, seq_lens: torch.Tensor, bound: int) -> Any:
    upper = cm.seq_lens_cpu_upper_bound
    replaced = {
        "block_table_tensor": table,
        "seq_lens": seq_lens,
        "max_seq_len": min(cm.max_seq_len, bound),
        # Still an upper bound of every windowed length: each is at most its full length and at most bound.
        "seq_lens_cpu_upper_bound": None if upper is None else upper.clamp(max=bound),
        "_num_computed_tokens_cache": None,
    }
    # vLLM ≤ 0.29 keeps deprecated host copies of the lengths, which FlashInfer reads: reset, as propose() itself
    # does between draft steps, so a backend that asks derives them from the windowed device lengths (one copy to
    # the host). Windowing the host copy instead would inherit its aliasing with seq_lens_cpu_upper_bound, which
    # propose() increments in place, so it can run ahead of the device lengths.
    replaced.update({name: None for name in HOST_LENGTH_COPIES if hasattr(cm, name)})
    return dataclasses.replace(cm, **replaced)


def _refuse_positional_fields(cm: Any) -> None:
    for name in hp.REFUSED_FIELDS:
        if getattr(cm, name, None) is not None:
            raise NotImplementedError(
                f"wmtp: the draft's attention metadata sets {name}, which indexes keys by their logical "
                "position; windowing shifts those positions, so wmtp does not support it"
            )


@functools.lru_cache(maxsize=64)
def _columns(width: int, n_sink: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The windowed table's column numbers and which of them lie past the sink (int64, as gather indexes)."""
    column = torch.arange(width, device=device, dtype=torch.int64)
    return column, (column >= n_sink).to(torch.int64)


@dataclasses.dataclass
class _State:
    config: win.WindowConfig
    stats: wstats.DraftStats
    draft_steps: int  # k: a cycle's draft forwards
    logged: bool = False
    cycle: _Cycle | None = None
    # The window kernels' buffers on a GPU (fused.CycleBuffers), made at the first windowed build; False: none.
    buffers: Any = None


def window_forward(
    state: _State, cm: Any, config: win.WindowConfig, block_size: int, draft_index: int
) -> tuple[Any, Any | None, bool]:
    """The windowed copy for one draft forward, the dropped blocks per row (None when handed through), and
    whether it reused its cycle's window.

    A decode cycle's first forward (``draft_index`` 0) sets the window and keeps it in ``state``; a later
    forward of the same cycle (same block table, same rows, same S and W) reuses it.
    """
    buffers = _buffers(state, cm.block_table_tensor)
    if draft_index == 0:
        anchors = win.anchors_cycle(cm.max_query_len, state.draft_steps)
        width = win.anchored_table_width(config.sink, config.window, block_size, state.draft_steps) if anchors else None
        windowed, cycle = _window_first(cm, config, block_size, width, buffers)
        state.cycle = cycle if anchors else None
        return windowed, None if cycle is None else cycle.dropped, False
    cycle = state.cycle
    if (
        cycle is not None
        and cycle.table is cm.block_table_tensor
        and cycle.rows == cm.seq_lens.shape[0]
        and cycle.config == config
    ):
        return _window_later(cm, cycle, draft_index), cycle.dropped, True
    # A forward that windows on its own ends its cycle's window: the kernels' buffers it held are written again.
    state.cycle = None
    windowed, cycle = _window_first(cm, config, block_size, None, buffers)
    return windowed, None if cycle is None else cycle.dropped, False


# On a GPU the plugin windows with its own Triton kernels (wmtp.plugin.fused: k launches a cycle instead of about a
# dozen); "torch" here keeps the PyTorch operations, the path every CPU takes.
KERNELS_ENV = "WMTP_WINDOW_KERNELS"


def _buffers(state: _State, table: torch.Tensor) -> Any:
    """The proposer's window-kernel buffers where its block table is on a GPU and Triton is there; None otherwise."""
    if state.buffers is None:
        _make_buffers(state, table.device)
    return state.buffers or None


def _make_buffers(state: _State, device: torch.device) -> None:
    """Once a proposer: the window kernels' buffers on a GPU, their kernels compiled, and from then on the count of
    dropped blocks kept on the device by them; False where the PyTorch path windows (a CPU, no Triton, or
    ``WMTP_WINDOW_KERNELS=torch``)."""
    state.buffers = False
    if device.type != "cuda" or os.environ.get(KERNELS_ENV, "triton") == "torch":
        return
    try:
        from wmtp.plugin import fused
    except ImportError:
        log.warning("wmtp: Triton does not import; the window is set with PyTorch operations")
        return
    buffers = fused.CycleBuffers(device)
    buffers.warm_up()
    state.buffers = buffers
    state.stats.count_on_device(buffers.total)
    log.info("wmtp: the window is set by the plugin's Triton kernels, one launch a draft forward")


def _refuse(what: str) -> HookPointError:
    return HookPointError(
        f"wmtp plugin: vLLM {hp.vllm_version()} {what}; Windowed-MTP cannot hook this "
        "vLLM (run wmtp.engines.vllm_hooks.check_hook_points() for details)"
    )


def _check_instance(proposer: Any) -> None:
    vllm_config = proposer.vllm_config
    method = getattr(type(proposer), hp.BUILD_METHOD, None)
    if getattr(method, _ORIGINAL, None) is None:
        raise _refuse(
            f"uses {type(proposer).__qualname__}, which overrides {hp.BUILD_METHOD}; the wmtp "
            f"wrapper sits on {hp.PROPOSER_CLASS}.{hp.BUILD_METHOD}"
        )
    dcp = getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1)
    if dcp and dcp > 1:
        raise _refuse(f"runs decode context parallelism ({dcp}); wmtp supports decode_context_parallel_size = 1 only")


def _wrap_init(original, problem: str | None):
    @functools.wraps(original)
    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        config = win.parse_config(getattr(vllm_config, "additional_config", None))
        if config is None:
            setattr(self, STATE_ATTR, None)
            return
        if problem is not None:
            raise _refuse(problem)
        _check_instance(self)
        stats = wstats.DraftStats(config.sink, config.window, hp.vllm_version())
        state = _State(config, stats, int(getattr(self, "num_speculative_tokens", 1) or 1))
        setattr(self, STATE_ATTR, state)
        device = getattr(self, "device", None)
        if isinstance(device, torch.device):
            # Its kernels compile now, at the server's start, not in the first request that outgrows S + W.
            _make_buffers(state, device)
        testing.install(self)
        if config.ring:
            from wmtp.plugin import ring  # imports vLLM's KV cache manager: only when asked for

            ring.install(self, config)

    setattr(__init__, _ORIGINAL, original)
    return __init__


def _wrap_build(original):
    @functools.wraps(original)
    def build_per_group_and_layer_attn_metadata(self, common_attn_metadata, *args, **kwargs):
        state: _State | None = getattr(self, STATE_ATTR, None)
        if state is not None:
            started = time.perf_counter_ns()
            config = testing.config(state.config)
            block_size = getattr(self, hp.BLOCK_SIZE_ATTR)
            if not state.logged:
                state.logged = True
                _log_start(config, block_size)
            draft_index = kwargs.get("draft_index", args[0] if args else 0)
            if testing.skip_window():
                windowed, dropped, reused = common_attn_metadata, None, False
            else:
                windowed, dropped, reused = window_forward(state, common_attn_metadata, config, block_size, draft_index)
            cm = common_attn_metadata
            state.stats.record(
                config.sink, config.window, block_size, cm.max_seq_len, cm.max_query_len, dropped, reused=reused
            )
            testing.observe(self, common_attn_metadata, windowed, config, block_size, draft_index, reused)
            common_attn_metadata = windowed
            state.stats.add_host_ns(time.perf_counter_ns() - started)
        return original(self, common_attn_metadata, *args, **kwargs)

    setattr(build_per_group_and_layer_attn_metadata, _ORIGINAL, original)
    return build_per_group_and_layer_attn_metadata


def _log_start(config: win.WindowConfig, block_size: int) -> None:
    eff = wstats.effective(config.sink, config.window, block_size)
    log.info(
        "wmtp: windowed MTP draft active: sink S=%d, window W=%d, KV block size %d "
        "(sink %d block(s); window at least W tokens, block-aligned)",
        config.sink,
        config.window,
        block_size,
        eff["sink_blocks"],
    )
    if config.sink % block_size or config.window % block_size:
        # The study names S and W in tokens; with large blocks (hybrid models) the draft reads noticeably more.
        log.warning(
            "wmtp: S=%d and W=%d are not both multiples of the KV block size %d: the draft reads a sink of %d "
            "tokens and a window of %d-%d tokens before each forward's queries",
            config.sink,
            config.window,
            block_size,
            eff["sink_tokens"],
            eff["window_tokens_min"],
            eff["window_tokens_max"],
        )


def _problem(module: ModuleType) -> str | None:
    """What is missing from the proposer module, or None."""
    cls = getattr(module, hp.PROPOSER_CLASS)
    method = cls.__dict__.get(hp.BUILD_METHOD)
    if method is None:
        return f"has no {hp.PROPOSER_CLASS}.{hp.BUILD_METHOD} in {hp.PROPOSER_MODULE}"
    params = list(inspect.signature(method).parameters)[1:]
    if tuple(params[: len(hp.BUILD_PARAMS)]) != hp.BUILD_PARAMS:
        return f"has {hp.PROPOSER_CLASS}.{hp.BUILD_METHOD}{tuple(params)}, expected {hp.BUILD_PARAMS} first"
    from vllm.v1.attention import backend

    metadata_cls = getattr(backend, hp.METADATA_CLASS, None)
    if metadata_cls is None:
        return f"has no {hp.METADATA_MODULE}.{hp.METADATA_CLASS}"
    fields = {f.name for f in dataclasses.fields(metadata_cls)}
    missing = [name for name in hp.METADATA_FIELDS if name not in fields]
    if missing:
        return f"has no field {missing[0]} on {hp.METADATA_CLASS} (missing: {missing})"
    unknown = hp.unclassified_fields(fields)
    if unknown:
        return f"has fields on {hp.METADATA_CLASS} that wmtp does not know how to window: {unknown}"
    return None


def patch(module: ModuleType) -> None:
    """Wrap the proposer class of a freshly imported module; idempotent.

    Nothing here raises: an unconfigured server must keep working on a vLLM we cannot hook. A missing
    hook point makes every proposer that *is* configured for wmtp refuse to start instead.
    """
    cls = getattr(module, hp.PROPOSER_CLASS, None)
    if cls is None:
        log.error(
            "wmtp plugin: vLLM %s has no %s.%s; wmtp cannot run on it",
            hp.vllm_version(),
            hp.PROPOSER_MODULE,
            hp.PROPOSER_CLASS,
        )
        return
    if getattr(cls.__init__, _ORIGINAL, None) is not None:
        return
    problem = _problem(module)
    if problem is not None:
        log.warning(
            "wmtp plugin: vLLM %s %s; servers configured for wmtp will refuse to start", hp.vllm_version(), problem
        )
    else:
        setattr(cls, hp.BUILD_METHOD, _wrap_build(cls.__dict__[hp.BUILD_METHOD]))
    cls.__init__ = _wrap_init(cls.__init__, problem)
