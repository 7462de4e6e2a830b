"""Arm wmtp-ring: the draft layer keeps KV blocks only for sink ∪ window; the rest go back to vLLM's pool.

The windowed draft (``wmtp.plugin.hook``) never reads the blocks between the sink and the window, yet plain
wmtp still holds them for the whole request, because the draft layer shares a KV cache group (one block table,
one manager) with the target's full-attention layers. With ``"ring": true`` the draft layer gets its own group:

- its spec is ``SinkWindowSpec`` (replaced in the model runner's ``get_kv_cache_spec``), a spec that no
  full-attention spec merges with; vLLM's hybrid grouping is wrapped so that the draft layer's group stands apart
  and the target's layers keep the groups they have without it (vLLM would size every group by the one-layer
  draft type: groups of one layer, each with its own block table and metadata every step);
- that group's manager, ``SinkWindowManager``, frees the blocks strictly between the sink and the window as the
  request's committed length grows, exactly as vLLM's sliding-window manager frees the blocks before its window;
- the spec's peak per-request usage is bounded, so vLLM sizes the pool and counts the KV capacity in tokens with
  the draft's bounded share instead of a full-context share.

Freed block ids stay in the worker's block table (vLLM's sliding-window groups do the same), and vLLM's pool hands
a block without a prefix hash to the very next allocation, so a freed id may already hold other KV (the same
request's target's, as its prefill's chunks go on); the windowed copy of the draft's metadata never reads them,
because the freed range is a subset of the dropped range (``freed_blocks``). Imported only inside vLLM processes: by
``install`` from the proposer, and by unpickling a ``SinkWindowSpec`` in the engine core; importing it registers the
spec.

It runs on two generations of vLLM's KV cache manager, and relies only on what both have (``RING_POINTS``):

- vLLM 0.24 hands ``remove_skipped_blocks`` the scheduler's optimistic count, which includes the tokens of a step
  still running under async scheduling (drafts it may reject); 0.26 and later hand it the committed count. The
  spec carries ``free_lag``, the tokens to hold back for the first kind, so the freed range is the same;
- the spec is built from the full-attention spec's fields (no ``replace_as`` in 0.24), and the range is freed by
  this manager itself (no ``_remove_blocks_in_range`` there);
- the admission cap goes to the base class's constructor, which stores it where its version reads it.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, KVCacheSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from wmtp.plugin import hookpoints as hp
from wmtp.plugin import testing
from wmtp.plugin import window as win
from wmtp.plugin.ring_math import (
    cdiv,
    free_lag,
    free_range,
    freed_blocks,
    in_flight_tokens,
    lookahead_tokens,
    retained_blocks,
    spec_fields,
    stands_apart,
)

log = logging.getLogger("vllm.wmtp")

RING_ATTR = "_wmtp_ring"
_ORIGINAL = "__wmtp_original__"
RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
RUNNER_CLASS = "GPUModelRunner"  # the CPU runner inherits get_kv_cache_spec from it
SPEC_METHOD = "get_kv_cache_spec"
# FullAttentionSpec's own fields: a draft layer that sets any of them is not plain full attention.
FULL_ONLY_FIELDS = ("sliding_window", "attention_chunk_size", "non_causal")
# The name vLLM gives remove_skipped_blocks's count where that count is committed tokens only (0.26 on).
COMMITTED_COUNT = "processed_computed_tokens"


@dataclass(frozen=True, kw_only=True)
class SinkWindowSpec(AttentionSpec):
    """The draft layer's KV: attention over sink ∪ window, sized for that and not for the whole context."""

    sink: int
    window: int
    # retained_blocks() at the engine's settings, computed where the spec is made (the worker knows them).
    max_blocks_per_request: int
    # free_lag() at the engine's settings: the engine core's manager frees at its count minus this.
    free_lag: int = 0
    # Blocks of a request at max_model_len: what the draft layer would hold without the ring.
    full_blocks: int = 0

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        return self.max_blocks_per_request * self.page_size_bytes

    def is_uniform_with_collection(self, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        return all(
            isinstance(spec, SinkWindowSpec) and (spec.sink, spec.window) == (self.sink, self.window)
            for spec in kv_cache_specs.values()
        )

    @property
    def prefix_cacheable(self) -> bool:
        # A cache hit would need the sink and the window's blocks of a prefix; install() refuses prefix caching.
        return False


class SinkWindowManager(SingleTypeKVCacheManager):
    """Frees the draft's blocks between the sink and the window; vLLM's block pool gets them back at once."""

    def __init__(self, kv_cache_spec: SinkWindowSpec, **kwargs: Any) -> None:
        # Admission must match the pool sizing (max_memory_usage_bytes), as for vLLM's sliding-window groups.
        kwargs["max_admission_blocks_per_request"] = kv_cache_spec.max_blocks_per_request
        super().__init__(kv_cache_spec, **kwargs)
        self.sink = kv_cache_spec.sink
        self.window = kv_cache_spec.window
        self.free_lag = kv_cache_spec.free_lag
        testing.observe_ring(self)
        log.info(
            "wmtp: ring: the draft layer's KV cache group keeps sink S=%d and window W=%d, at most %d blocks of "
            "%d tokens per request; KV cache pool %d blocks",
            self.sink,
            self.window,
            kv_cache_spec.max_blocks_per_request,
            self.block_size,
            self.block_pool.num_gpu_blocks,
        )

    @classmethod
    def find_longest_cache_hit(cls, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("wmtp ring: the draft's sink+window group has no prefix cache")

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        # Cascade attention would share a prefix's blocks across requests; the ring frees the middle of every
        # prefix, so it has none to share (vLLM 0.24 asks every manager; later versions only some).
        return 0

    def allocate_new_blocks(self, request_id: str, *args: Any, **kwargs: Any) -> Any:
        new = super().allocate_new_blocks(request_id, *args, **kwargs)
        if not hasattr(self, "_record_new_block_ids"):
            # vLLM 0.24 lists the spec types whose new blocks the worker zeroes (on hybrids, where a block may last
            # have held a recurrent state); later versions take every attention spec. Zeroed as wmtp's draft is.
            self.new_block_ids.extend(block.block_id for block in new)
        return new

    def remove_skipped_blocks(
        self, request_id: str, computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        committed = max(computed_tokens - self.free_lag, 0)
        first, last = freed_blocks(committed, self.sink, self.window, self.block_size)
        taken = free_range(blocks, first, last, self._null_block)
        if taken:
            self.block_pool.free_blocks(taken)
            testing.observe_free(request_id, computed_tokens, committed, first, last, len(taken), self.block_size)


def _wrap_grouping(original, group_specs):
    @functools.wraps(original)
    def grouped(kv_cache_spec: dict[str, KVCacheSpec]) -> Any:
        ring = {name: spec for name, spec in kv_cache_spec.items() if isinstance(spec, SinkWindowSpec)}
        rest = {name: spec for name, spec in kv_cache_spec.items() if name not in ring}
        if not ring or not rest:
            return original(kv_cache_spec)
        # vLLM sizes every group by its least numerous layer type: a draft group of one layer splits every other type
        # into groups of one (41 on the 35B shape, each with a block table and attention metadata of its own every
        # step). Grouped apart, as vLLM groups its hidden-state layers, the others keep their groups, but a draft
        # block then costs the pages of a block of their group size: worth it only where that still holds less than
        # the draft's full context.
        groups = original(rest)
        group_size = max(len(group.layer_names) for group in groups)
        draft = next(iter(ring.values()))
        if not stands_apart(group_size, draft.max_blocks_per_request, draft.full_blocks):
            log.info(
                "wmtp: ring: the draft's group in vLLM's own grouping (apart, its %d blocks a request would cost %d "
                "pages, its full context %d)",
                draft.max_blocks_per_request,
                group_size * draft.max_blocks_per_request,
                draft.full_blocks,
            )
            return original(kv_cache_spec)
        log.info("wmtp: ring: the draft's group stands apart; the others keep groups of %d layers", group_size)
        return groups + group_specs(ring, [sorted(ring)])

    setattr(grouped, _ORIGINAL, original)
    return grouped


def grouping_module() -> Any:
    """The vLLM module whose grouping the ring wraps, or None where vLLM keeps its own (hookpoints names them)."""
    import importlib

    for name in hp.RING_GROUPING_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, hp.RING_GROUPING_FUNCTION) and hasattr(module, hp.RING_GROUP_SPECS_FUNCTION):
            return module
    return None


def _register() -> None:
    # vLLM registers its built-in specs only while the registry is empty: fill it first, then add ours.
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(SinkWindowSpec, SinkWindowManager)
    # Imported in every process that groups KV specs (the engine core unpickles the workers' specs, ours among them).
    module = grouping_module()
    if module is None:
        log.warning("wmtp: ring: this vLLM's KV cache grouping is not one the ring knows; vLLM groups around the draft")
        return
    current = getattr(module, hp.RING_GROUPING_FUNCTION)
    if getattr(current, _ORIGINAL, None) is None:
        wrapped = _wrap_grouping(current, getattr(module, hp.RING_GROUP_SPECS_FUNCTION))
        setattr(module, hp.RING_GROUPING_FUNCTION, wrapped)


_register()


def sink_window_spec(spec: KVCacheSpec, config: win.WindowConfig, vllm_config: Any) -> SinkWindowSpec:
    """The draft layer's full-attention spec as a sink+window spec; refuses anything but plain full attention."""
    if type(spec) is not FullAttentionSpec or any(getattr(spec, name, None) for name in FULL_ONLY_FIELDS):
        raise NotImplementedError(
            f"wmtp ring: the draft layer's KV cache spec is {spec!r}; ring = true supports plain full attention only"
        )
    in_flight = in_flight_tokens(vllm_config) + lookahead_tokens(vllm_config)
    limit = retained_blocks(
        config.sink, config.window, spec.block_size, in_flight, vllm_config.model_config.max_model_len
    )
    return SinkWindowSpec(
        **spec_fields(spec, SinkWindowSpec, drop=FULL_ONLY_FIELDS),
        sink=config.sink,
        window=config.window,
        max_blocks_per_request=limit,
        full_blocks=cdiv(vllm_config.model_config.max_model_len, spec.block_size),
        free_lag=free_lag(
            count_is_committed(),
            vllm_config.max_concurrent_batches,
            vllm_config.scheduler_config.max_num_batched_tokens,
        ),
    )


def count_is_committed() -> bool:
    """Whether this vLLM's managers are asked to free at committed tokens (the count's name says so)."""
    parameters = list(inspect.signature(SingleTypeKVCacheManager.remove_skipped_blocks).parameters)
    return COMMITTED_COUNT in parameters


def _wrap_get_kv_cache_spec(original):
    @functools.wraps(original)
    def get_kv_cache_spec(self):
        specs = original(self)
        drafter = getattr(self, "drafter", None)
        config = getattr(drafter, RING_ATTR, None)
        if config is None:
            return specs
        names = sorted(getattr(drafter, "_draft_attn_layer_names", ()))
        if not names:
            raise NotImplementedError("wmtp ring: the drafter has no attention layers of its own to give a ring")
        for name in names:
            # The block size here is the one vLLM unifies page sizes with later; the bound scales with it.
            specs[name] = sink_window_spec(specs[name], config, self.vllm_config)
        return specs

    setattr(get_kv_cache_spec, _ORIGINAL, original)
    return get_kv_cache_spec


def _refusal(vllm_config: Any) -> str | None:
    if vllm_config.cache_config.enable_prefix_caching:
        return "prefix caching is on (a hit would need the freed middle of a prefix); use --no-enable-prefix-caching"
    if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        return "the hybrid KV cache manager is disabled, so the draft layer cannot have a KV cache group of its own"
    return None


def install(proposer: Any, config: win.WindowConfig) -> None:
    """Give ``proposer``'s draft layer a sink+window KV cache group; called from the proposer's __init__.

    The model runner that builds this proposer asks for the layers' KV specs after loading the model, so
    wrapping its class's ``get_kv_cache_spec`` now is in time; the wrapper acts only for a runner whose
    drafter carries the ring setting.
    """
    problem = _refusal(proposer.vllm_config)
    if problem is not None:
        raise win.WindowConfigError(f"--additional-config {win.CONFIG_KEY}.ring = true cannot run: {problem}")
    import importlib

    cls = getattr(importlib.import_module(RUNNER_MODULE), RUNNER_CLASS)
    method = cls.__dict__[SPEC_METHOD]
    if getattr(method, _ORIGINAL, None) is None:
        setattr(cls, SPEC_METHOD, _wrap_get_kv_cache_spec(method))
    setattr(proposer, RING_ATTR, config)
