"""The plugin's test instrument deciding where its poison may land under the ring: what the ring's KV cache manager
holds, at which position, and what its pool holds free, as vLLM's manager and pool keep them."""

from __future__ import annotations

from dataclasses import dataclass, field

from wmtp.plugin.testing import ring_spared


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0


@dataclass
class Pool:
    blocks: list[Block]


@dataclass
class Manager:
    """The parts of a vLLM single-type KV cache manager the instrument reads."""

    block_size: int
    block_pool: Pool
    req_to_blocks: dict[str, list[Block]] = field(default_factory=dict)


def _manager(block_size: int, held: list[int], handed_out: list[int], pool_size: int = 16) -> Manager:
    """One request whose draft group holds ``held`` (block ids by position; 0 is vLLM's null block, where the ring
    freed), and ``handed_out`` held by other owners; every other block is free."""
    pool = Pool([Block(i) for i in range(pool_size)])
    for block_id in [b for b in held if b] + handed_out:
        pool.blocks[block_id].ref_cnt = 1
    pool.blocks[0].ref_cnt = 1  # the null block is never free
    return Manager(block_size, pool, {"r": [pool.blocks[b] for b in held]})


def test_without_the_ring_nothing_is_spared():
    assert ring_spared(None, [(3, 0), (4, 96)], 96) == ([False, False], [False, False])


def test_a_given_back_block_is_poisoned_while_free_and_spared_once_handed_out():
    # The draft's table still names 5 and 6 at positions 1 and 2; the ring freed both; 6 went to the target.
    manager = _manager(96, held=[1, 0, 0, 7], handed_out=[6])
    spared, free = ring_spared(manager, [(5, 96), (6, 2 * 96)], 96)
    assert spared == [False, True] and free == [True, False]


def test_a_block_the_ring_still_holds_is_poisoned_only_at_its_own_position():
    # Block 7 is the draft's at position 3; handed back to the draft for position 3, the stale position 1 is not it.
    manager = _manager(96, held=[1, 0, 0, 7], handed_out=[])
    spared, free = ring_spared(manager, [(7, 3 * 96 + 5), (7, 96 + 5)], 96)
    assert spared == [False, True] and free == [False, False]


def test_kernel_blocks_smaller_than_the_managers_are_read_as_the_managers_block():
    # A 96-token manager block in 32-token kernel blocks: kernel ids 15, 16, 17 are manager block 5.
    manager = _manager(96, held=[1, 0, 0, 7], handed_out=[5])
    spared, free = ring_spared(manager, [(15, 96), (17, 96 + 64), (21, 3 * 96)], 32)
    assert spared == [True, True, False] and free == [False, False, False]
    manager.block_pool.blocks[5].ref_cnt = 0
    assert ring_spared(manager, [(16, 96 + 32)], 32) == ([False], [True])
