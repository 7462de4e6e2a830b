"""The window of a decode cycle in one kernel launch per draft forward, on a GPU.

The plugin's hook runs on the host before every draft forward, where each PyTorch operation costs a launch: windowing
a cycle's first forward took eleven of them and the dropped-block count two more. These two Triton kernels do the same
integer work (``wmtp.plugin.window``'s formulas) in one launch each, into buffers kept for the proposer's life:

- ``first``: a cycle's first forward, one program per row of the block table: the blocks it drops, ⌊(p0 − W − n_sink
  B) / B⌋ at least 0 with p0 = seq_len − query_len; the windowed length; the windowed table (the sink's columns, then
  the window's, gathered); and the dropped blocks added to the proposer's running total;
- ``later``: a later forward of the same cycle, which keeps the first one's window: its lengths less the same
  dropped blocks, and those blocks added to the total again.

Both are enqueued on the current stream and never wait for the device. ``TRITON_INTERPRET=1`` runs them on CPU tensors
(the tests do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Every integer is passed unspecialised and every length is looped over in fixed chunks, so that each kernel compiles
# once (at the proposer's start, ``CycleBuffers.warm_up``), never inside a request whose decode is being timed.
CHUNK = 64


@triton.jit(do_not_specialize=["table_stride", "rows", "cols", "n_seqs", "shift", "n_sink", "block_size", "width"])
def _first_kernel(
    seq_lens, query_start, table, table_stride, rows, cols, out_table, out_seq_lens, out_drop, total,
    n_seqs, shift, n_sink, block_size, width, CHUNK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    is_seq = row < n_seqs
    seq_len = tl.load(seq_lens + row, mask=is_seq, other=0).to(tl.int64)
    first = tl.load(query_start + row, mask=is_seq, other=0).to(tl.int64)
    last = tl.load(query_start + row + 1, mask=is_seq, other=0).to(tl.int64)
    # Clamped before the division, so that it floors a number at least 0.
    drop = tl.maximum(seq_len - (last - first) - shift, 0) // block_size
    for start in range(0, width, CHUNK):
        column = start + tl.arange(0, CHUNK)
        inside = (column < width) & (column * 0 + row < rows)
        source = tl.minimum(tl.where(column >= n_sink, column + drop, column), cols - 1)
        values = tl.load(table + row * table_stride + source, mask=inside, other=0)
        tl.store(out_table + row * width + column, values, mask=inside)
    tl.store(out_seq_lens + row, (seq_len - drop * block_size).to(out_seq_lens.dtype.element_ty), mask=is_seq)
    tl.store(out_drop + row, drop, mask=is_seq)
    tl.atomic_add(total, drop, mask=is_seq)


@triton.jit(do_not_specialize=["n_seqs", "block_size"])
def _later_kernel(seq_lens, drop, out_seq_lens, total, n_seqs, block_size, CHUNK: tl.constexpr):
    dropped_sum = tl.zeros((), dtype=tl.int64)
    for start in range(0, n_seqs, CHUNK):
        row = start + tl.arange(0, CHUNK)
        is_seq = row < n_seqs
        seq_len = tl.load(seq_lens + row, mask=is_seq, other=0).to(tl.int64)
        dropped = tl.load(drop + row, mask=is_seq, other=0)
        out = (seq_len - dropped * block_size).to(out_seq_lens.dtype.element_ty)
        tl.store(out_seq_lens + row, out, mask=is_seq)
        dropped_sum += tl.sum(dropped, axis=0)
    tl.atomic_add(total, dropped_sum)


class CycleBuffers:
    """One proposer's outputs of the window kernels, allocated once per shape and written in place every cycle; the
    running total of dropped blocks over its windowed forwards (``total``, a 0-d int64 on the device, as the counters'
    pinned host copy is)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.total = torch.zeros((), dtype=torch.int64, device=device)
        self._buffers: dict[tuple, torch.Tensor] = {}

    def warm_up(self, seq_dtype: torch.dtype = torch.int32, table_dtype: torch.dtype = torch.int32) -> None:
        """Compile both kernels on a one-row batch of the engine's dtypes, counting into a scratch total."""
        kept = self.total
        self.total = torch.zeros((), dtype=torch.int64, device=self.device)
        try:
            seq_lens = torch.full((1,), 8, dtype=seq_dtype, device=self.device)
            query_start = torch.tensor([0, 1], dtype=seq_dtype, device=self.device)
            table = torch.zeros((1, 4), dtype=table_dtype, device=self.device)
            _, _, drop = self.first(seq_lens, query_start, table, 1, 2, 2, 3)
            self.later(seq_lens, drop, 2, 1)
        finally:
            self.total = kept
        self._buffers.clear()

    def _get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        key = (name, shape, dtype)
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = torch.empty(shape, dtype=dtype, device=self.device)
        return buffer

    def first(
        self,
        seq_lens: torch.Tensor,
        query_start: torch.Tensor,
        table: torch.Tensor,
        sink_blocks: int,
        window: int,
        block_size: int,
        width: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A cycle's first forward: (windowed table, windowed lengths, dropped blocks per sequence)."""
        n = seq_lens.shape[0]
        rows, cols = table.shape
        out_table = self._get("table", (rows, width), table.dtype)
        out_seq_lens = self._get("seq_lens 0", (n,), seq_lens.dtype)
        out_drop = self._get("drop", (n,), torch.int64)
        _first_kernel[(max(rows, n),)](
            seq_lens, query_start, table, table.stride(0), rows, cols, out_table, out_seq_lens, out_drop, self.total,
            n, window + sink_blocks * block_size, sink_blocks, block_size, width, CHUNK=CHUNK,
        )  # fmt: skip
        return out_table, out_seq_lens, out_drop

    def later(self, seq_lens: torch.Tensor, drop: torch.Tensor, block_size: int, step: int) -> torch.Tensor:
        """A later forward, ``step`` of its cycle, keeping the first one's window: its windowed lengths (a buffer of
        its own, so that no forward's lengths change under an earlier one's attention)."""
        n = seq_lens.shape[0]
        out_seq_lens = self._get(f"seq_lens {step}", (n,), seq_lens.dtype)
        _later_kernel[(1,)](seq_lens, drop, out_seq_lens, self.total, n, block_size, CHUNK=CHUNK)
        return out_seq_lens
