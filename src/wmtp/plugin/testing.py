"""Test-only instruments of the plugin, inert unless ``WMTP_PLUGIN_TEST_DIR`` names a directory.

The engine tests (tests/test_plugin_vllm.py) use them to keep server starts few and to look inside:

- ``control.json`` in that directory, re-read whenever it changes, overrides the window
  (``{"sink": S, "window": W}``) so that one server covers several (S, W); it also carries a
  ``tag`` copied into every record, and optionally ``"poison": {"sink": S', "window": W', "region": R}``:
  before each draft forward, the draft layer's KV is overwritten with large random values, written
  through the attention backend's own cache-write path (``do_kv_cache_update``) at the slots of
  ``R = "outside"`` (default): the blocks the plugin drops for (S', W') (for a later forward of a decode cycle,
  those its first forward dropped, as the plugin keeps them), a draft that reads them changes; under the ring,
  a dropped block it gave back and the pool handed to another owner is spared (the worker's block table still
  names it, but its memory is now that owner's KV or state: poisoning it would move the target, not the draft),
  and the record counts the slots spared and those poisoned in blocks the pool holds free;
  ``R = "sink"``: the first S' tokens; ``R = "window"``: the W' tokens before the forward's first query
  (both chosen by token position alone, so a window that failed to read them would show);
  ``"skip_window": true`` makes the hooked build hand the metadata through unwindowed (a hook that
  does nothing), so the cell's check of the plugin's counters can be shown to fail;
- ``records.jsonl`` receives one line per windowed metadata build (full and windowed block tables
  and sequence lengths), one per ``propose()`` call (the draft tokens) and, under the ring, one per call of its
  KV cache manager that gave blocks back to the pool (in the engine core, where freeing happens: the worker's
  block table keeps the freed ids).

Nothing here runs in a normal server: every entry point returns at once when the variable is unset.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import weakref
from pathlib import Path
from typing import Any

from wmtp.plugin import window as win

ENV = "WMTP_PLUGIN_TEST_DIR"
_control: dict[str, Any] = {}
_control_stamp: tuple[int, int, int] | None = None
_cycle_start: tuple[list[int], list[int]] = ([], [])  # the current cycle's first forward: seq_lens, query_lens
# The ring's KV cache manager of this process's engine, when the ring runs; weak, so that it keeps no dead
# engine's pool alive.
_ring_manager: weakref.ref | None = None


def _dir() -> Path | None:
    value = os.environ.get(ENV)
    return Path(value) if value else None


def _read_control() -> dict[str, Any]:
    global _control, _control_stamp
    directory = _dir()
    if directory is None:
        return {}
    path = directory / "control.json"
    try:
        stat = path.stat()
    except FileNotFoundError:
        _control, _control_stamp = {}, None
        return _control
    stamp = (stat.st_mtime_ns, stat.st_ino, stat.st_size)  # the tests replace the file atomically
    if stamp != _control_stamp:
        _control, _control_stamp = json.loads(path.read_text()), stamp
    return _control


def _record(entry: dict[str, Any]) -> None:
    directory = _dir()
    if directory is None:
        return
    entry["tag"] = _read_control().get("tag")
    with (directory / "records.jsonl").open("a") as out:
        out.write(json.dumps(entry) + "\n")


def skip_window() -> bool:
    return _dir() is not None and bool(_read_control().get("skip_window"))


def config(default: win.WindowConfig) -> win.WindowConfig:
    control = _read_control()
    if "sink" not in control:
        return default
    return win.WindowConfig(sink=int(control["sink"]), window=int(control["window"]))


def install(proposer: Any) -> None:
    """Record the draft tokens of every propose() call of this proposer."""
    global _ring_manager
    if _dir() is None:
        return
    _ring_manager = None  # a new engine; its ring, if any, registers when its KV cache manager starts
    original = proposer.propose

    def propose(*args, **kwargs):
        draft = original(*args, **kwargs)
        _record({"kind": "propose", "draft": draft.tolist()})
        return draft

    proposer.propose = propose


def observe_ring(manager: Any) -> None:
    """Know the ring's KV cache manager, whose pool says who owns each block the poison would write."""
    global _ring_manager
    if _dir() is not None:
        _ring_manager = weakref.ref(manager)


def ring_spared(manager: Any, positions: list[tuple[int, int]], block_size: int) -> tuple[list[bool], list[bool]]:
    """For each (kernel block id, token position) the poison would write, whether to spare it, and whether its block
    is free in the pool of the ring's KV cache manager (given back, not yet handed out); nothing spared and nothing
    free without the ring (``manager`` None).

    A block is poisoned where the pool holds it free, or where the draft's group holds it at that very position (a
    block the ring has not yet given back); spared where the pool handed it to another owner, or gave it back to the
    draft's group for another position. The manager counts in its own blocks, which the attention kernel may split
    into smaller ones. The draft group's blocks count as the draft's whichever request holds them: the proofs that
    poison run one request at a time."""
    if manager is None:
        return [False] * len(positions), [False] * len(positions)
    per = manager.block_size // block_size  # kernel blocks per manager block
    held_at = {
        (index, block.block_id) for blocks in manager.req_to_blocks.values() for index, block in enumerate(blocks)
    }
    pool = manager.block_pool.blocks
    spared, free = [], []
    for block, position in positions:
        own = block // per
        is_free = pool[own].ref_cnt == 0
        free.append(is_free)
        spared.append(not is_free and (position // manager.block_size, own) not in held_at)
    return spared, free


def observe_free(
    request_id: str, computed_tokens: int, committed: int, first: int, last: int, taken: int, block_size: int
) -> None:
    """Record the ring's manager giving ``taken`` blocks back: the count it was handed, the committed tokens it
    freed behind, and the block range [first, last) it freed."""
    if _dir() is None:
        return
    _record(
        {
            "kind": "free",
            "request": request_id,
            "computed_tokens": computed_tokens,
            "committed": committed,
            "first": first,
            "last": last,
            "taken": taken,
            "block_size": block_size,
        }
    )


def observe(
    proposer: Any,
    full: Any,
    windowed: Any,
    config: win.WindowConfig,
    block_size: int,
    draft_index: int = 0,
    anchored: bool = False,
) -> None:
    """Record one hooked build and poison before its forward; ``anchored`` when it kept its cycle's window."""
    global _cycle_start
    if _dir() is None:
        return
    n = full.seq_lens.shape[0]
    query_lens = (full.query_start_loc[1 : n + 1] - full.query_start_loc[:n]).tolist()
    seq_lens = full.seq_lens.tolist()
    windowed_lens = windowed.seq_lens.tolist()
    if draft_index == 0:
        _cycle_start = (seq_lens, query_lens)

    def rows(table, lens):
        return [table[r, : -(-length // block_size)].tolist() for r, length in enumerate(lens)]

    _record(
        {
            "kind": "build",
            "draft_index": draft_index,
            "anchored": anchored,
            "cycle_seq_lens": _cycle_start[0],
            "cycle_query_lens": _cycle_start[1],
            "sink": config.sink,
            "window": config.window,
            "block_size": block_size,
            "seq_lens": seq_lens,
            "query_lens": query_lens,
            "max_query_len": full.max_query_len,
            "windowed_seq_lens": windowed_lens,
            "windowed_max_seq_len": windowed.max_seq_len,
            "table_width": int(windowed.block_table_tensor.shape[1]),
            "full_width": int(full.block_table_tensor.shape[1]),
            "full_blocks": rows(full.block_table_tensor, seq_lens),
            "windowed_blocks": rows(windowed.block_table_tensor, windowed_lens),
            "lengths": _length_fields(windowed),
            "set_fields": sorted(f.name for f in dataclasses.fields(windowed) if getattr(windowed, f.name) is not None),
        }
    )
    poison = _read_control().get("poison")
    if poison:
        # A later forward of an anchored cycle drops what its cycle's first forward dropped.
        starts = _cycle_start if anchored else (seq_lens, query_lens)
        spans = _poison_spans(poison, seq_lens, query_lens, block_size, starts)
        _poison(proposer, full, spans, block_size, poison.get("region", "outside"))


def _length_fields(cm: Any) -> dict[str, Any]:
    """Every length-like value the windowed copy hands the draft's kernels, host and device copies."""
    return {
        "seq_lens": cm.seq_lens.tolist(),
        "max_seq_len": cm.max_seq_len,
        "seq_lens_cpu_upper_bound": None
        if cm.seq_lens_cpu_upper_bound is None
        else cm.seq_lens_cpu_upper_bound.tolist(),
        # On a shallow copy: vLLM's own derivation, without caching it on metadata that may be shared.
        "num_computed_tokens": copy.copy(cm).compute_num_computed_tokens().tolist(),
    }


def _poison_spans(
    poison: dict[str, Any],
    seq_lens: list[int],
    query_lens: list[int],
    block_size: int,
    window_starts: tuple[list[int], list[int]],
) -> list[tuple[int, int]]:
    """Per row, the token positions [start, end) to poison; the dropped blocks are those of the forward whose
    lengths ``window_starts`` holds (this one, or its cycle's first)."""
    sink, window, region = int(poison["sink"]), int(poison["window"]), poison.get("region", "outside")
    spans = []
    for row, (length, query) in enumerate(zip(seq_lens, query_lens, strict=True)):
        first_query = length - query
        if region == "sink":
            spans.append((0, min(sink, first_query)))
        elif region == "window":
            spans.append((max(first_query - window, 0), first_query))
        else:  # the blocks the plugin drops
            n_sink = win.sink_blocks(sink, block_size)
            start_len, start_query = window_starts[0][row], window_starts[1][row]
            drop = win.dropped_blocks(start_len, start_query, sink, window, block_size)
            spans.append((n_sink * block_size, (n_sink + drop) * block_size))
    return spans


def _poison(proposer: Any, full: Any, spans: list[tuple[int, int]], block_size: int, region: str) -> None:
    """Write large random keys and values at those positions through the draft layers' own cache writer."""
    import torch

    table = full.block_table_tensor
    positions = [(int(table[r, p // block_size]), p) for r, (start, end) in enumerate(spans) for p in range(start, end)]
    if not positions:
        return
    manager = _ring_manager() if _ring_manager is not None and region == "outside" else None
    spared, free = ring_spared(manager, positions, block_size)
    slots = [
        block * block_size + p % block_size for (block, p), skip in zip(positions, spared, strict=True) if not skip
    ]
    # A free block is never spared: its slots are among those written.
    record = {"kind": "poison", "region": region, "spans": spans, "slots": len(slots), "spared": sum(spared)}
    record["free"] = sum(free)
    if not slots:
        _record(record)
        return
    context = proposer.vllm_config.compilation_config.static_forward_context
    generator = torch.Generator().manual_seed(0)
    for group in proposer.draft_attn_groups:
        for name in group.layer_names:
            layer = context[name]
            kv = layer.kv_cache
            slot_mapping = torch.tensor(slots, dtype=torch.int64, device=kv.device)
            shape = (len(slots), layer.num_kv_heads, layer.head_size)
            dtype = proposer.vllm_config.model_config.dtype  # what the layer hands its cache writer
            key, value = ((torch.randn(shape, generator=generator) * 30).to(kv.device, dtype) for _ in range(2))
            layer.impl.do_kv_cache_update(layer, key, value, kv, slot_mapping)
    _record(record)
