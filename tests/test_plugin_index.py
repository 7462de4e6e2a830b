"""Index math of the windowed draft (wmtp.plugin.window) against a brute-force reference; no vLLM."""

from __future__ import annotations

import random

import pytest

from wmtp.plugin import window as win


def reference(seq_len: int, query_len: int, sink: int, window: int, block_size: int) -> list[int]:
    """Blocks the draft reads, straight from the definition: block j is kept when it lies in the sink
    (S rounded up to blocks) or holds any token at or after max(p0 - W, 0), p0 = seq_len - query_len."""
    n_blocks = -(-seq_len // block_size)
    n_sink = -(-sink // block_size)
    window_start = max(seq_len - query_len - window, 0)
    return [j for j in range(n_blocks) if j < n_sink or (j + 1) * block_size > window_start]


def tokens_of(blocks: list[int], seq_len: int, block_size: int) -> set[int]:
    return {t for j in blocks for t in range(j * block_size, min((j + 1) * block_size, seq_len))}


def random_cases(n: int, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(n):
        block_size = rng.choice([1, 2, 16, 32, 128, 256, 544])
        seq_len = rng.randint(1, 40 * block_size + 5000)
        query_len = rng.randint(1, min(seq_len, rng.choice([1, 4, 16, 600, 5000])))
        sink = rng.choice([0, 1, 4, 16, block_size, block_size + 1, rng.randint(0, 3000)])
        window = rng.choice([1, 8, 64, 128, block_size - 1 or 1, block_size, rng.randint(1, 6000)])
        yield seq_len, query_len, sink, window, block_size


CASES = list(random_cases(5000))


def test_kept_blocks_match_brute_force():
    for case in CASES:
        assert win.kept_blocks(*case) == reference(*case), case


def test_windowed_seq_len_counts_the_kept_tokens():
    for seq_len, query_len, sink, window, block_size in CASES:
        kept = reference(seq_len, query_len, sink, window, block_size)
        expected = len(tokens_of(kept, seq_len, block_size))
        assert win.windowed_seq_len(seq_len, query_len, sink, window, block_size) == expected


def test_read_set_covers_sink_window_and_queries_and_nothing_else():
    for seq_len, query_len, sink, window, block_size in CASES:
        read = tokens_of(win.kept_blocks(seq_len, query_len, sink, window, block_size), seq_len, block_size)
        first_query = seq_len - query_len
        must = set(range(min(sink, seq_len))) | set(range(max(first_query - window, 0), seq_len))
        assert must <= read
        # Block granularity only: the sink rounds up to whole blocks, the window starts at its block.
        n_sink = win.sink_blocks(sink, block_size)
        start_block = max(first_query - window, 0) // block_size
        allowed = set(range(min(n_sink * block_size, seq_len))) | set(range(start_block * block_size, seq_len))
        assert read <= allowed


def test_gather_index_rebuilds_the_kept_blocks():
    for seq_len, query_len, sink, window, block_size in CASES:
        drop = win.dropped_blocks(seq_len, query_len, sink, window, block_size)
        n_sink = win.sink_blocks(sink, block_size)
        width = -(-win.windowed_seq_len(seq_len, query_len, sink, window, block_size) // block_size)
        columns = [win.gather_index(c, drop, n_sink) for c in range(width)]
        assert columns == reference(seq_len, query_len, sink, window, block_size)


def test_table_and_seq_len_are_bounded_independently_of_context():
    for seq_len, query_len, sink, window, block_size in CASES:
        length = win.windowed_seq_len(seq_len, query_len, sink, window, block_size)
        assert length <= win.seq_len_bound(query_len, sink, window, block_size)
        assert -(-length // block_size) <= win.table_width_bound(query_len, sink, window, block_size)


def test_bound_does_not_move_as_the_context_grows():
    sink, window, block_size, query_len = 16, 128, 256, 4
    lengths = [win.windowed_seq_len(n, query_len, sink, window, block_size) for n in range(400, 200_000, 97)]
    assert max(lengths) <= win.seq_len_bound(query_len, sink, window, block_size)
    assert max(lengths) < 2 * block_size + window + query_len  # one sink block, ≤ 1 partial block
    assert lengths[-1] < 1000  # at 200K tokens the draft still reads under a thousand


@pytest.mark.parametrize(
    ("seq_len", "query_len", "expected"),
    [
        (144, 1, 144),  # context ≤ S + W: everything
        (1501, 1, 349),  # S=16 → 1 block of 128; window from 1372 → block 10; 1501 - 9·128
        (1504, 4, 352),  # the first query position decides: 1500 − 128 = 1372, still block 10
    ],
)
def test_worked_examples(seq_len, query_len, expected):
    assert win.windowed_seq_len(seq_len, query_len, 16, 128, 128) == expected


def test_window_smaller_than_a_block_and_no_sink():
    # S = 0, W = 8 < B = 256: the window is the block holding p0 − 8 and what follows.
    assert win.kept_blocks(1000, 1, 0, 8, 256) == [3]
    assert win.kept_blocks(1025, 1, 0, 8, 256) == [3, 4]  # p0 − 8 = 1016 lies in block 3
    assert win.kept_blocks(1033, 1, 0, 8, 256) == [4]


def test_needs_window():
    assert not win.needs_window(144, 16, 128)
    assert win.needs_window(145, 16, 128)


def test_parse_config():
    assert win.parse_config(None) is None
    assert win.parse_config({}) is None
    assert win.parse_config({"other": 1}) is None
    assert win.parse_config({"wmtp": {"sink": 16, "window": 128, "ring": False}}) == win.WindowConfig(16, 128)
    assert win.parse_config({"wmtp": {"sink": 0, "window": 1}}) == win.WindowConfig(0, 1)
    assert win.parse_config({"wmtp": {"sink": 4, "window": 8, "ring": True}}) == win.WindowConfig(4, 8, ring=True)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"sink": -1, "window": 128}, "wmtp.sink must be an integer ≥ 0"),
        ({"sink": 16, "window": 0}, "wmtp.window must be an integer ≥ 1"),
        ({"sink": 16}, "wmtp.window must be an integer"),
        ({"sink": None, "window": 128}, "wmtp.sink must be an integer"),
        ({"sink": True, "window": 128}, "wmtp.sink must be an integer"),
        ({"sink": 16, "window": 128, "ring": "no"}, "wmtp.ring must be true or false"),
        ({"sink": 16, "window": 128, "windw": 3}, "unknown keys ['windw']"),
        ([16, 128], "must be an object"),
    ],
)
def test_parse_config_names_the_bad_field(raw, message):
    with pytest.raises(win.WindowConfigError, match=r"^--additional-config wmtp") as err:
        win.parse_config({"wmtp": raw})
    assert message in str(err.value)


def test_host_copies_of_the_lengths_are_reset_so_a_backend_derives_the_windowed_ones():
    """vLLM ≤ 0.29 keeps host copies of seq_lens (FlashInfer reads them): the windowed copy drops them, so that
    vLLM's seq_lens_cpu derives them from the windowed device lengths; the shared metadata keeps its own."""
    torch = pytest.importorskip("torch")
    from attention_metadata import Metadata

    from wmtp.plugin.hook import windowed_with_drops

    seq_lens = torch.tensor([5000, 700, 40], dtype=torch.int32)
    query_start = torch.tensor([0, 1, 5, 45], dtype=torch.int32)
    cm = Metadata(
        query_start,
        query_start.clone(),
        seq_lens,
        40,
        5000,
        torch.arange(120, dtype=torch.int32).reshape(3, 40),
        seq_lens.clone(),
        seq_lens.clone(),
        seq_lens.clone() - 1,
    )
    windowed, _ = windowed_with_drops(cm, win.WindowConfig(16, 256), 128)
    assert windowed._seq_lens_cpu is None and windowed._num_computed_tokens_cpu is None
    assert cm._seq_lens_cpu.tolist() == [5000, 700, 40]
    assert windowed.seq_lens.tolist() == [
        win.windowed_seq_len(s, q, 16, 256, 128) for s, q in ((5000, 1), (700, 4), (40, 40))
    ]


def anchored_cases(n: int, seed: int = 1):
    """A decode cycle: its first draft forward (k + 1 queries at most) and a later forward j tokens on, after
    the rejected drafts were taken back (``seq_lens -= rejected``, then one token a forward)."""
    rng = random.Random(seed)
    for _ in range(n):
        block_size = rng.choice([1, 16, 128, 544])
        k = rng.choice([2, 3, 5, 7])
        query_len = rng.randint(1, k + 1)
        seq_len = rng.randint(query_len, 30 * block_size + 5000)
        sink = rng.choice([0, 4, 16, block_size, rng.randint(0, 3000)])
        window = rng.choice([1, 64, block_size, rng.randint(1, 6000)])
        rejected = rng.randint(0, query_len - 1)
        step = rng.randint(1, k - 1)
        yield seq_len, query_len, sink, window, block_size, k, seq_len - rejected + step, step


def test_a_later_forward_of_a_cycle_reads_its_own_window_and_a_bounded_few_tokens_more():
    for seq_len, query_len, sink, window, block_size, k, later_len, step in anchored_cases(5000):
        assert win.anchors_cycle(query_len, k)
        drop = win.dropped_blocks(seq_len, query_len, sink, window, block_size)
        read = tokens_of(win.kept_blocks_after(later_len, drop, sink, block_size), later_len, block_size)
        first_query = later_len - 1
        must = set(range(min(sink, later_len))) | set(range(max(first_query - window, 0), later_len))
        assert must <= read, (seq_len, query_len, sink, window, block_size, k, later_len)
        # Never less than the forward's own window would read, and at most 2k - 1 tokens more.
        own = tokens_of(win.kept_blocks(later_len, 1, sink, window, block_size), later_len, block_size)
        assert own <= read and len(read) - len(own) <= max(block_size, 2 * k - 1 + block_size)
        n_sink = win.sink_blocks(sink, block_size)
        beyond_sink = len(read - set(range(n_sink * block_size)))
        assert beyond_sink <= window + block_size - 1 + 2 * k - 1 + 1
        length = later_len - block_size * drop
        assert length == len(read)
        assert length <= win.seq_len_bound(query_len, sink, window, block_size, later=step)
        assert -(-length // block_size) <= win.anchored_table_width(sink, window, block_size, k)


def test_only_decode_cycles_of_more_than_one_draft_step_keep_a_window():
    assert win.anchors_cycle(4, 3) and win.anchors_cycle(1, 3)
    assert not win.anchors_cycle(5, 3)  # a prefill's chunk: each forward windows on its own
    assert not win.anchors_cycle(1, 1)  # k = 1 has no later forward
