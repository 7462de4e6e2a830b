"""The ring's block arithmetic on its own: what a request frees, when, and the most it holds."""

from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from wmtp.plugin import window as win
from wmtp.plugin.ring_math import (
    free_lag,
    free_range,
    freed_blocks,
    in_flight_tokens,
    lookahead_tokens,
    retained_blocks,
    spec_fields,
    stands_apart,
)

NULL = object()


def test_a_range_is_freed_once_and_only_its_new_blocks_after():
    blocks = list(range(10))
    assert free_range(blocks, 1, 4, NULL) == [3, 2, 1]
    assert blocks[0] == 0 and blocks[1:4] == [NULL] * 3 and blocks[4:] == list(range(4, 10))
    # the end grows: only the blocks not yet freed come back
    assert free_range(blocks, 1, 6, NULL) == [5, 4]
    # the end falls back (a rejected draft under an optimistic count): nothing more is freed
    assert free_range(blocks, 1, 5, NULL) == []
    # past the blocks the request holds: stops at its last block
    assert free_range(blocks, 1, 50, NULL) == [9, 8, 7, 6]
    assert blocks == [0] + [NULL] * 9


def test_freed_blocks_are_the_blocks_a_draft_at_that_length_leaves_out():
    rng = random.Random(3)
    for _ in range(2000):
        sink, window, block = rng.choice((0, 4, 16, 600)), rng.choice((8, 128, 4096)), rng.choice((16, 560, 640))
        processed = rng.randrange(0, 50_000)
        first, last = freed_blocks(processed, sink, window, block)
        assert first == win.sink_blocks(sink, block) and last >= first
        # a draft whose first query sits at the committed length drops exactly this range, and any later one more
        assert last - first == win.dropped_blocks(processed + 1, 1, sink, window, block)
        later = processed + rng.randrange(0, 5000)
        assert last - first <= win.dropped_blocks(later + 1, 1, sink, window, block)


@pytest.mark.parametrize("batches", [1, 2])
def test_a_growing_request_never_holds_more_than_the_bound(batches):
    """Chunks and decode steps of random sizes under vLLM's allocation order: free at the count the scheduler
    hands over (committed tokens plus what the batches still in flight scheduled), then allocate through the
    step's tokens and the lookahead. Nothing freed may lie in a window a step can still read: no step starts
    before the settled count, and each reads W tokens back from its start."""
    rng = random.Random(batches)
    sink, window, block, budget, lookahead = 16, 4096, 560, 8192, 4
    in_flight = batches * budget + lookahead
    lag = free_lag(False, batches, budget)
    bound = retained_blocks(sink, window, block, in_flight, 10**7)
    committed, pending, blocks = 0, [], []
    for _ in range(3000):
        count = committed + sum(pending)  # 0.24's optimistic count
        first, last = freed_blocks(max(count - lag, 0), sink, window, block)
        free_range(blocks, first, last, NULL)
        assert last == first or last * block <= committed - window, (committed, count, last)
        new = rng.choice((budget, rng.randrange(1, budget), 4))
        end = count + new + lookahead
        blocks.extend(object() for _ in range(-(-end // block) - len(blocks)))
        held = sum(b is not NULL for b in blocks)
        assert held <= bound, (committed, held, bound)
        pending.append(new)
        if len(pending) == batches:
            # the oldest batch settles; a decode step may reject up to 3 of its tokens
            committed += pending.pop(0) - (rng.randrange(0, 4) if new == 4 else 0)
    assert held > bound - 3  # the bound is reached, not loose


def test_the_lag_covers_only_batches_still_in_flight():
    assert free_lag(True, 2, 8192) == 0  # the count is committed tokens already
    assert free_lag(False, 1, 8192) == 0  # without async scheduling the count is settled when it is handed over
    assert free_lag(False, 2, 8192) == 8192


def test_in_flight_and_lookahead_read_the_config_or_its_parts():
    newer = SimpleNamespace(max_in_flight_tokens=16384, num_lookahead_tokens=3)
    assert in_flight_tokens(newer) == 16384 and lookahead_tokens(newer) == 3
    older = SimpleNamespace(
        max_concurrent_batches=2,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=8192),
        num_speculative_tokens=3,
    )
    assert in_flight_tokens(older) == 16384 and lookahead_tokens(older) == 4


@dataclass(frozen=True, kw_only=True)
class _Attention:
    block_size: int
    num_kv_heads: int
    head_size: int


@dataclass(frozen=True, kw_only=True)
class _Full(_Attention):
    head_size_v: int | None = None
    sliding_window: int | None = None
    non_causal: bool = False


@dataclass(frozen=True, kw_only=True)
class _Ring(_Attention):
    sink: int = 0


def test_a_spec_carries_its_fields_and_refuses_to_lose_one_that_matters():
    drop = ("sliding_window", "non_causal")
    spec = _Full(block_size=560, num_kv_heads=2, head_size=256, head_size_v=256)
    assert spec_fields(spec, _Ring, drop) == {"block_size": 560, "num_kv_heads": 2, "head_size": 256}
    assert spec_fields(_Full(block_size=16, num_kv_heads=2, head_size=64), _Ring, drop)["head_size"] == 64
    with pytest.raises(NotImplementedError, match="head_size_v"):
        spec_fields(_Full(block_size=16, num_kv_heads=2, head_size=64, head_size_v=128), _Ring, drop)
    with pytest.raises(NotImplementedError, match="sliding_window"):
        spec_fields(_Full(block_size=16, num_kv_heads=2, head_size=64, sliding_window=128), _Ring, ("non_causal",))


def test_the_draft_stands_apart_only_where_its_bound_costs_less_than_its_context():
    # the 35B shape at 1M: 39 blocks at ten pages against 1,858 blocks of context
    assert stands_apart(10, 39, 1858)
    # at 60,000 tokens the same bound would cost 390 pages for a context of 108
    assert not stands_apart(10, 39, 108)
    # groups of one layer cost nothing extra
    assert stands_apart(1, 39, 108)
