"""One draft-decode step's paged attention metadata windowed in place: torch only, no engine.

SGLang's FlashAttention backend hands its kernel, per draft step, a page table (``[bs, cols]`` int32: token
slots with pages of one token, page ids otherwise), each request's key count ``cache_seqlens`` (``[bs]``
int32) and their cumulative sum ``cu_seqlens_k`` (``[bs + 1]`` int32, leading 0); one query a request, the
step's own token, whose key is the row's last. Under CUDA graphs these are buffers the captured kernels
read, refilled before every replay: the window must be written into the same storage, and from the host
only, never waiting on the device (no ``.item()``, no shape that depends on a value).

Per row the math is ``wmtp.plugin.window``'s with the page as block and one query: the sink's pages, then
the window's, gathered to the front of the row; the row's length shrinks by a page per dropped page. A row
no longer than S + W keeps everything. Only the first ``table_width_bound`` columns are rewritten: that is
all a windowed row reads, and a row too short to window keeps its own columns there, while the columns
beyond keep whatever they held (nothing reads past the row's length).
"""

from __future__ import annotations

import functools

import torch

from wmtp.plugin import window as win

QUERY_LEN = 1


def window_draft_step(
    page_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    sink: int,
    window: int,
    page_size: int,
) -> torch.Tensor:
    """Window one draft step's metadata in place; returns the pages dropped per row (int32, on the device).

    ``page_table`` may hold more rows than ``cache_seqlens`` (they are left alone) and fewer columns than
    the window needs (the gather stays inside the row). ``cu_seqlens_k`` is rewritten from entry 1 to ``bs``.
    """
    bs = cache_seqlens.shape[0]
    rows, cols = page_table.shape
    if rows < bs or cu_seqlens_k.shape[0] < bs + 1:
        raise ValueError(
            f"metadata of {bs} requests with a page table of {rows} rows and {cu_seqlens_k.shape[0]} cumulative lengths"
        )
    n_sink = win.sink_blocks(sink, page_size)
    # ⌊(p0 − W) / B⌋ − n_sink with p0 = seq_len − 1, at least 0, the sink folded into the shift: where
    # window.dropped_blocks clamps p0 − W at 0 first, this is negative and clamps to 0 too.
    drop = torch.sub(cache_seqlens, QUERY_LEN + window + n_sink * page_size)
    drop = drop.div_(page_size, rounding_mode="floor").clamp_(min=0)

    width = min(cols, win.table_width_bound(QUERY_LEN, sink, window, page_size))
    if width > 0 and bs > 0:
        column, after_sink = _columns(width, n_sink, page_table.device)
        index = torch.mul(drop.to(torch.int64)[:, None], after_sink).add_(column).clamp_(max=cols - 1)
        table = page_table[:bs]
        # Sources lie right of their destinations in the same row: gather into a temporary, then copy back.
        table[:, :width].copy_(torch.gather(table, 1, index))

    cache_seqlens.sub_(drop * page_size)
    cu_seqlens_k[1 : bs + 1].copy_(torch.cumsum(cache_seqlens, dim=0, dtype=cu_seqlens_k.dtype))
    return drop


@functools.lru_cache(maxsize=64)
def _columns(width: int, n_sink: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rewritten columns' numbers and which of them lie past the sink (int64, as gather indexes)."""
    column = torch.arange(width, device=device, dtype=torch.int64)
    return column, (column >= n_sink).to(torch.int64)
