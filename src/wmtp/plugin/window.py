"""Index math of the windowed draft, on plain integers: no torch, no vLLM, unit-testable alone.

One request's draft attention reads a paged KV cache through its block table. Windowed-MTP keeps

- the *sink*: the first ``ceil(S / B)`` blocks (S rounded up to whole blocks), and
- the *window*: every block from the one holding token ``p0 - W`` to the last, where ``p0`` is the
  request's first query position in this forward (``seq_len - query_len``),

and drops the blocks in between. The kept blocks are handed to the kernel as one contiguous table,
so the request's sequence shrinks by ``B`` tokens per dropped block. Keys sit in the cache post-RoPE
at their true positions and the paged kernels align causality to the end of the sequence, so the
queries still see exactly the kept keys up to themselves.

A decode cycle's draft forwards share one window start: the first forward (the k + 1 verified tokens
at most) sets the dropped blocks, and the k - 1 later forwards (one query each, each a token further)
keep them, so each later forward reads its window plus the tokens the cycle has advanced, fewer than
2k more, and the windowed table is gathered once a cycle instead of once a forward. The start moves by
at most one block a cycle either way; a first forward of more queries (a prefill's) windows each of
its cycle's forwards on its own, so no later forward reads a whole chunk more than W.

``plugin/hook.py`` applies the same formulas to whole batches with tensor operations; the engine
tests check it against these functions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

CONFIG_KEY = "wmtp"


class WindowConfigError(ValueError):
    """The window's settings are malformed (vLLM's ``--additional-config wmtp``, SGLang's environment variable)."""


@dataclass(frozen=True)
class WindowConfig:
    sink: int
    window: int
    ring: bool = False


def parse_config(additional_config: Mapping[str, Any] | None) -> WindowConfig | None:
    """The plugin's settings from vLLM's ``additional_config``; None when there is no ``wmtp`` key."""
    if not additional_config or CONFIG_KEY not in additional_config:
        return None
    return parse_settings(additional_config[CONFIG_KEY], f"--additional-config {CONFIG_KEY}")


def parse_settings(raw: Any, where: str) -> WindowConfig:
    """``{"sink": S, "window": W, "ring": false}`` checked; ``where`` names the setting in the error."""
    if not isinstance(raw, Mapping):
        raise WindowConfigError(f'{where} must be an object like {{"sink": 16, "window": 128}} (got {raw!r})')
    unknown = sorted(set(raw) - {"sink", "window", "ring"})
    if unknown:
        raise WindowConfigError(f"{where} has unknown keys {unknown}; allowed: sink, window, ring")
    values: dict[str, int] = {}
    for key, minimum in (("sink", 0), ("window", 1)):
        value = raw.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise WindowConfigError(f"{where}.{key} must be an integer ≥ {minimum} (got {value!r})")
        values[key] = value
    ring = raw.get("ring", False)
    if not isinstance(ring, bool):
        raise WindowConfigError(f"{where}.ring must be true or false (got {ring!r})")
    return WindowConfig(sink=values["sink"], window=values["window"], ring=ring)


def sink_blocks(sink: int, block_size: int) -> int:
    """Blocks holding the sink: S rounded up to whole blocks."""
    return -(-sink // block_size)


def dropped_blocks(seq_len: int, query_len: int, sink: int, window: int, block_size: int) -> int:
    """Blocks between the sink and the window, left out of the draft's table."""
    first_query = seq_len - query_len
    window_start = max(first_query - window, 0)
    return max(window_start // block_size - sink_blocks(sink, block_size), 0)


def windowed_seq_len(seq_len: int, query_len: int, sink: int, window: int, block_size: int) -> int:
    """The sequence length the draft's kernel sees."""
    return seq_len - block_size * dropped_blocks(seq_len, query_len, sink, window, block_size)


def kept_blocks(seq_len: int, query_len: int, sink: int, window: int, block_size: int) -> list[int]:
    """Indices (into the request's full block table) of the blocks the draft reads, in order."""
    return kept_blocks_after(seq_len, dropped_blocks(seq_len, query_len, sink, window, block_size), sink, block_size)


def anchors_cycle(max_query_len: int, draft_steps: int) -> bool:
    """Whether the later forwards of a cycle whose first draft forward has ``max_query_len`` queries keep its
    window start: in decode, where the first forward holds at most the ``draft_steps + 1`` verified tokens."""
    return draft_steps > 1 and max_query_len <= draft_steps + 1


def anchored_table_width(sink: int, window: int, block_size: int, draft_steps: int) -> int:
    """The windowed table's columns for every forward of an anchored cycle, whatever its first forward's queries:
    at most ``draft_steps + 1`` of them, and ``draft_steps - 1`` tokens more by its last forward."""
    return table_width_bound(2 * draft_steps, sink, window, block_size)


def kept_blocks_after(seq_len: int, drop: int, sink: int, block_size: int) -> list[int]:
    """``kept_blocks`` for a later forward of an anchored cycle: the cycle's ``drop``, this forward's length."""
    n_blocks = -(-seq_len // block_size)
    n_sink = sink_blocks(sink, block_size)
    return [j if j < n_sink else j + drop for j in range(n_blocks - drop)]


def gather_index(column: int, drop: int, n_sink: int) -> int:
    """Column of the full table that column ``column`` of the windowed table copies."""
    return column if column < n_sink else column + drop


def table_width_bound(max_query_len: int, sink: int, window: int, block_size: int, later: int = 0) -> int:
    """Columns enough for every row of the windowed table, whatever the context length, also ``later`` tokens
    on (the later forwards of an anchored cycle)."""
    return sink_blocks(sink, block_size) + 1 + -(-(max_query_len + later + window) // block_size)


def seq_len_bound(max_query_len: int, sink: int, window: int, block_size: int, later: int = 0) -> int:
    """An upper bound of every windowed sequence length, whatever the context length.

    A windowed row holds the sink blocks, at most ``B - 1`` tokens of the block holding ``p0 - W``
    before the window, the window and the queries; a row too short to window is shorter than that. A
    later forward of an anchored cycle, ``later`` tokens on, holds that many more.
    """
    return sink_blocks(sink, block_size) * block_size + max_query_len + later + window + block_size - 1


def needs_window(max_seq_len: int, sink: int, window: int) -> bool:
    """False when no context in the batch is longer than S + W: the draft reads everything anyway."""
    return max_seq_len > sink + window
