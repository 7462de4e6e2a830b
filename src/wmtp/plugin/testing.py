"""Test-only instruments of the plugin, inert unless ``WMTP_PLUGIN_TEST_DIR`` names a directory.

The engine tests (tests/test_plugin_vllm.py) use them to keep server starts few and to look inside:

- ``control.json`` in that directory, re-read whenever it changes, overrides the window
  (``{"sink": S, "window": W}``) so that one server covers several (S, W); it also carries a
  ``tag`` copied into every record, and optionally ``"poison": {"sink": S', "window": W'}``: before
  each draft forward, the draft layer's KV blocks outside the sink ∪ window of (S', W') are
  overwritten with large random values (the read-set proof: a draft that reads them changes);
- ``records.jsonl`` receives one line per windowed metadata build (full and windowed block tables
  and sequence lengths) and one per ``propose()`` call (the draft tokens).

Nothing here runs in a normal server: every entry point returns at once when the variable is unset.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from wmtp.plugin import window as win

ENV = "WMTP_PLUGIN_TEST_DIR"
_control: dict[str, Any] = {}
_control_stamp: tuple[int, int, int] | None = None


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


def config(default: win.WindowConfig) -> win.WindowConfig:
    control = _read_control()
    if "sink" not in control:
        return default
    return win.WindowConfig(sink=int(control["sink"]), window=int(control["window"]))


def install(proposer: Any) -> None:
    """Record the draft tokens of every propose() call of this proposer."""
    if _dir() is None:
        return
    original = proposer.propose

    def propose(*args, **kwargs):
        draft = original(*args, **kwargs)
        _record({"kind": "propose", "draft": draft.tolist()})
        return draft

    proposer.propose = propose


def observe(proposer: Any, full: Any, windowed: Any, config: win.WindowConfig, block_size: int) -> None:
    if _dir() is None:
        return
    n = full.seq_lens.shape[0]
    query_lens = (full.query_start_loc[1 : n + 1] - full.query_start_loc[:n]).tolist()
    seq_lens = full.seq_lens.tolist()
    windowed_lens = windowed.seq_lens.tolist()

    def rows(table, lens):
        return [table[r, : -(-length // block_size)].tolist() for r, length in enumerate(lens)]

    _record(
        {
            "kind": "build",
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
        }
    )
    poison = _read_control().get("poison")
    if poison:
        _poison(proposer, full, seq_lens, query_lens, int(poison["sink"]), int(poison["window"]), block_size)


def _poison(
    proposer: Any, full: Any, seq_lens: list[int], query_lens: list[int], sink: int, window: int, block_size: int
) -> None:
    """Overwrite the draft layer's KV outside sink ∪ window of (sink, window) with large random values."""
    import torch

    n_sink = win.sink_blocks(sink, block_size)
    blocks: list[int] = []
    for r, (length, query) in enumerate(zip(seq_lens, query_lens, strict=True)):
        drop = win.dropped_blocks(length, query, sink, window, block_size)
        blocks += full.block_table_tensor[r, n_sink : n_sink + drop].tolist()
    if not blocks:
        return
    context = proposer.vllm_config.compilation_config.static_forward_context
    generator = torch.Generator().manual_seed(0)
    for group in proposer.draft_attn_groups:
        for name in group.layer_names:
            kv = context[name].kv_cache
            if kv.dim() != 4:
                raise NotImplementedError(f"poisoning knows the CPU KV layout only (got {tuple(kv.shape)})")
            per_block = block_size // kv.shape[2]  # kernel blocks per KV block
            for block in blocks:
                target = kv[block * per_block : (block + 1) * per_block]
                garbage = torch.randn(target.shape, generator=generator) * 30
                target.copy_(garbage.to(device=target.device, dtype=target.dtype))
    _record({"kind": "poison", "blocks": blocks})
