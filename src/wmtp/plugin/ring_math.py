"""The ring's block arithmetic, free of vLLM: what a request frees, when, and the most it holds.

``wmtp.plugin.ring`` applies it inside vLLM's KV cache manager; here it is plain integers (and, for
``spec_fields``, plain dataclasses), so it is tested on its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from wmtp.plugin import window as win


def cdiv(a: int, b: int) -> int:
    """Whole blocks of ``b`` that hold ``a``."""
    return -(-a // b)


def retained_blocks(sink: int, window: int, block_size: int, in_flight: int, max_model_len: int) -> int:
    """The most draft blocks one request holds at once.

    After freeing at a committed length c, a request keeps its sink blocks and every block from the one
    holding c - W to the one holding its last slot, at most c + ``in_flight`` (scheduled but unsettled
    tokens and lookahead slots): ceil((W + in_flight) / B) + 1 blocks, the +1 because c - W need not sit
    on a block boundary. Never more than a full-context request.
    """
    bounded = win.sink_blocks(sink, block_size) + cdiv(window + in_flight, block_size) + 1
    return min(bounded, cdiv(max_model_len, block_size))


def in_flight_tokens(vllm_config: Any) -> int:
    """Tokens scheduled for requests but not yet settled: every batch in flight may hold a full token budget.

    vLLM names this bound ``max_in_flight_tokens`` from 0.26 on; 0.24 and 0.25 have its parts.
    """
    bound = getattr(vllm_config, "max_in_flight_tokens", None)
    if bound is None:
        bound = vllm_config.max_concurrent_batches * vllm_config.scheduler_config.max_num_batched_tokens
    return int(bound)


def lookahead_tokens(vllm_config: Any) -> int:
    """KV slots reserved past the target's tokens for the drafter. vLLM's config names the number from 0.29 on;
    before, its scheduler reserves k, or k + 1 for one method, and the bound takes k + 1."""
    reserved = getattr(vllm_config, "num_lookahead_tokens", None)
    if reserved is None:
        reserved = vllm_config.num_speculative_tokens + 1
    return int(reserved)


def free_lag(count_is_committed: bool, max_concurrent_batches: int, max_num_batched_tokens: int) -> int:
    """Tokens to subtract from the count vLLM frees at, so that only committed tokens are freed behind.

    Where the count is optimistic (vLLM 0.24), it includes what the batches still running scheduled for the
    request, at most a token budget each, and any of their drafts may be rejected; the batch being scheduled
    now is not yet in it.
    """
    return 0 if count_is_committed else (max_concurrent_batches - 1) * max_num_batched_tokens


def spec_fields(spec: Any, cls: type, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """``spec``'s constructor fields that ``cls`` also has; refuses a field ``cls`` would lose that matters.

    ``drop`` names fields that may be lost when unset; a ``head_size_v`` equal to ``head_size`` (vLLM 0.24 keeps
    it on the full-attention spec, where it does not change the page) may be lost too.
    """
    kept = {f.name for f in dataclasses.fields(cls) if f.init}
    values = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
    lost = {
        name: value
        for name, value in values.items()
        if name not in kept
        and not (name in drop and not value)
        and not (name == "head_size_v" and value in (None, values.get("head_size")))
    }
    if lost:
        raise NotImplementedError(f"wmtp ring: {cls.__name__} cannot carry {type(spec).__name__}'s {lost}")
    return {name: value for name, value in values.items() if name in kept}


def free_range(blocks: list[Any], first: int, last: int, null_block: Any) -> list[Any]:
    """Replace ``blocks[first:last]`` by ``null_block``; returns the blocks taken out, for the pool.

    Walks down from the last index and stops at the first null: each call frees the same start and an end that
    only grows, so everything below a null is already freed, and a step costs only its newly freed blocks.
    """
    taken = []
    for index in range(min(last, len(blocks)) - 1, first - 1, -1):
        if blocks[index] is null_block:
            break
        taken.append(blocks[index])
        blocks[index] = null_block
    return taken


def freed_blocks(processed: int, sink: int, window: int, block_size: int) -> tuple[int, int]:
    """Block indices [first, last) freed once ``processed`` tokens are committed.

    The same interval as the windowed read's dropped blocks (``window.dropped_blocks``) with the first query
    position p0 replaced by the committed length; every later draft window is set at a first query p0 ≥ that
    length (a decode cycle's first forward's, which its later forwards keep), so whatever is freed is never read.
    """
    first = win.sink_blocks(sink, block_size)
    return first, max(first, max(processed - window, 0) // block_size)


def stands_apart(group_size: int, bound_blocks: int, full_blocks: int) -> bool:
    """Whether the draft's group stands apart from vLLM's grouping: its bound, each block at the pages of a block of
    the others' ``group_size``, must cost less than its ``full_blocks`` would cost wmtp (a page each, among the
    full-attention layers). Otherwise vLLM's own grouping (groups of one layer) keeps the ring's saving whole."""
    return group_size * bound_blocks < full_blocks
