"""The in-place window of one draft-decode step's paged metadata, against wmtp.plugin.window's formulas."""

from __future__ import annotations

import random

import pytest
import torch

from wmtp.plugin import window as win
from wmtp.plugin.paged_window import window_draft_step


def _metadata(lengths: list[int], page_size: int, cols: int, rows: int | None = None, seed: int = 0):
    """A page table of distinct page ids (each row its own), key counts and their cumulative sum, as SGLang builds
    them for a draft step; ``rows`` beyond the requests stand for rows the step does not own."""
    rows = len(lengths) if rows is None else rows
    generator = torch.Generator().manual_seed(seed)
    table = torch.randperm(rows * cols * 4, generator=generator)[: rows * cols].view(rows, cols).to(torch.int32)
    seq = torch.tensor(lengths, dtype=torch.int32)
    cu = torch.nn.functional.pad(torch.cumsum(seq, 0, dtype=torch.int32), (1, 0))
    return table, seq, cu


def _expected_row(full_row: list[int], length: int, sink: int, window: int, page_size: int) -> tuple[list[int], int]:
    """The pages the kernel reads and the row's length after the window, from window.py alone."""
    kept = win.kept_blocks(length, 1, sink, window, page_size)
    return [full_row[j] for j in kept], win.windowed_seq_len(length, 1, sink, window, page_size)


def _check(lengths, sink, window, page_size, cols=None, rows=None, seed=0):
    cols = cols if cols is not None else max(-(-n // page_size) for n in lengths)
    table, seq, cu = _metadata(lengths, page_size, cols, rows, seed)
    before = table.clone()
    pointers = (table.data_ptr(), seq.data_ptr(), cu.data_ptr())

    dropped = window_draft_step(table, seq, cu, sink, window, page_size)

    assert (table.data_ptr(), seq.data_ptr(), cu.data_ptr()) == pointers
    assert dropped.tolist() == [win.dropped_blocks(n, 1, sink, window, page_size) for n in lengths]
    for r, n in enumerate(lengths):
        pages, new_len = _expected_row(before[r].tolist(), n, sink, window, page_size)
        assert seq[r].item() == new_len
        assert table[r, : len(pages)].tolist() == pages, (r, n)
    assert cu.tolist() == [0, *torch.cumsum(seq, 0).tolist()]
    if rows is not None:
        assert torch.equal(table[len(lengths) :], before[len(lengths) :])
    return table, before, seq, dropped


@pytest.mark.parametrize("page_size", [1, 2, 16, 64])
def test_random_batches_match_the_index_math(page_size):
    rng = random.Random(page_size)
    for case in range(60):
        sink, window = rng.choice([0, 1, 4, 16, 33]), rng.choice([1, 7, 32, 100])
        lengths = [rng.randint(1, sink + window + 6 * page_size + 200) for _ in range(rng.randint(1, 6))]
        _check(lengths, sink, window, page_size, seed=case)


def test_rows_no_longer_than_sink_plus_window_are_untouched():
    sink, window = 4, 8
    lengths = [1, 5, sink + window, sink + window + 1]
    table, before, seq, dropped = _check(lengths, sink, window, 1)
    assert dropped.tolist() == [0, 0, 0, 0]  # S + W + 1 keys: the query's own reaches back exactly W
    assert torch.equal(table, before) and seq.tolist() == lengths
    _, _, _, dropped = _check([sink + window + 2], sink, window, 1)
    assert dropped.tolist() == [1]


def test_one_token_pages_keep_the_sink_and_exactly_w_keys_before_the_query():
    # 30 keys, the query at position 29: keys 0..3 (sink) and 21..29 (W = 8 before it, and itself).
    table = torch.arange(100, 130, dtype=torch.int32).view(1, 30)
    seq = torch.tensor([30], dtype=torch.int32)
    cu = torch.tensor([0, 30], dtype=torch.int32)
    dropped = window_draft_step(table, seq, cu, 4, 8, 1)
    assert dropped.tolist() == [17] and seq.tolist() == [13] and cu.tolist() == [0, 13]
    assert table[0, :13].tolist() == [100, 101, 102, 103, *range(121, 130)]


def test_pages_are_kept_whole_from_the_page_holding_p0_minus_w():
    # Pages of 4: 40 keys, query at 39, window start 39 - 8 = 31 lies in page 7; sink 5 tokens → 2 pages.
    table = torch.arange(10, dtype=torch.int32).view(1, 10) * 7
    seq = torch.tensor([40], dtype=torch.int32)
    cu = torch.tensor([0, 40], dtype=torch.int32)
    dropped = window_draft_step(table, seq, cu, 5, 8, 4)
    assert dropped.tolist() == [5] and seq.tolist() == [20]
    assert table[0, :5].tolist() == [0, 7, 49, 56, 63]


def test_an_off_by_one_in_the_window_start_would_be_caught():
    # At S + W + 2 keys one key drops; one more key of slack (p0 − W − 1) would drop none, one less (p0 − W + 1) two.
    sink, window = 2, 5
    for n, drops in ((sink + window + 1, 0), (sink + window + 2, 1), (sink + window + 3, 2)):
        _, _, _, dropped = _check([n], sink, window, 1)
        assert dropped.tolist() == [drops]


def test_padding_rows_of_a_graph_batch_stay_valid():
    # A CUDA-graph batch pads with length 1 (+ the step): those rows keep their length and first page.
    sink, window, page_size = 16, 64, 16
    lengths = [700, 2, 3, 1]
    table, before, seq, _ = _check(lengths, sink, window, page_size, cols=64)
    assert seq[1:].tolist() == [2, 3, 1] and torch.equal(table[1:, :1], before[1:, :1])


def test_rows_beyond_the_requests_are_left_alone():
    _check([300, 40], 8, 32, 4, cols=80, rows=5)


def test_a_table_narrower_than_the_window_stays_in_bounds():
    # 4 columns, but the window alone would ask for more: the gather clamps to the row, lengths still shrink.
    table, seq, cu = _metadata([400], 1, 4)
    dropped = window_draft_step(table, seq, cu, 2, 100, 1)
    assert dropped.tolist() == [win.dropped_blocks(400, 1, 2, 100, 1)]
    assert seq.tolist() == [400 - dropped.item()]


def test_only_the_windows_columns_are_rewritten():
    sink, window, page_size = 0, 8, 1
    cols = 200
    table, before, _, _ = _check([150], sink, window, page_size, cols=cols)
    width = win.table_width_bound(1, sink, window, page_size)
    assert torch.equal(table[:, width:], before[:, width:])


def test_a_wider_cumulative_buffer_keeps_its_tail():
    table, seq, _ = _metadata([90, 10], 1, 90)
    cu = torch.full((6,), -7, dtype=torch.int32)
    cu[0] = 0
    window_draft_step(table, seq, cu, 4, 16, 1)
    assert cu.tolist() == [0, seq[0].item(), seq[0].item() + 10, -7, -7, -7]


def test_an_empty_batch_and_mismatched_shapes():
    table, seq, cu = _metadata([], 1, 8, rows=2)
    assert window_draft_step(table, seq, cu, 4, 16, 1).tolist() == []
    table, seq, cu = _metadata([50, 60], 1, 60)
    with pytest.raises(ValueError, match="2 requests with a page table of 1 rows"):
        window_draft_step(table[:1], seq, cu, 4, 16, 1)
