"""Test-only instrument of the SGLang plugin, inert unless ``WMTP_PLUGIN_TEST_DIR`` names a directory.

It shares ``wmtp.plugin.testing``'s control file and records (``control.json``: ``tag``, a ``sink``/``window`` that
overrides the window, ``poison``; ``records.jsonl``), and adds what SGLang needs:

- ``install()`` wraps SGLang's draft worker's ``draft(batch)`` (one decode cycle's draft forwards, eager or from a
  CUDA graph), so that each call records its requests' draft tokens (``kind`` propose: per request its bonus token
  then the k drafted, as SGLang hands them to the verify);
- with ``"poison": {"sink": S', "window": W', "region": R, "seed": N}`` in the control file, the draft layer's KV is
  overwritten with large random values for that one call and restored after it, at the token positions of ``R``:
  ``"outside"`` (default) the positions the window (S', W') leaves out of the cycle's first windowed step, the one
  that reads the most; ``"sink"`` the first S' positions; ``"window"`` the W' positions before the cycle's first
  query. The restore matters: the draft-extend after the verify reads the whole context and is not windowed.

SGLang's draft KV is a pool of its own beside the target's (the draft's one attention layer), indexed by the same token
slots as the target's through the shared ``req_to_token`` table; a position ``p`` of request ``r`` is slot
``req_to_token[r, p]``. The first draft token of a cycle comes from the draft-extend before it, so only the later
ones show what the windowed steps read.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from wmtp.plugin import patch_on_import, testing
from wmtp.plugin import window as win

DRAFT_WORKER_MODULE = "sglang.srt.speculative.eagle_worker_v2"
DRAFT_WORKER_CLASS = "EagleDraftWorker"
DRAFT_METHOD = "draft"
_ORIGINAL = "__wmtp_test_original__"
POISON_SCALE = 30.0


def install() -> None:
    """Where the instrument is on, wrap the draft worker's ``draft`` (once) as SGLang imports its module, or at once
    where it is loaded; nothing otherwise."""
    if testing._dir() is None:
        return
    patch_on_import({DRAFT_WORKER_MODULE: _wrap_worker})


def _wrap_worker(module: Any) -> None:
    cls = getattr(module, DRAFT_WORKER_CLASS)
    method = cls.__dict__[DRAFT_METHOD]
    if getattr(method, _ORIGINAL, None) is None:
        setattr(cls, DRAFT_METHOD, _wrap(method))


def _wrap(original):
    @functools.wraps(original)
    def draft(self, batch):
        poison = testing._read_control().get("poison")
        idle = batch.forward_mode.is_idle()
        saved = None if idle or not poison else poison_draft_kv(self, batch, poison)
        out = original(self, batch)
        if saved is not None:
            restore(*saved)
        if not idle:
            rows = len(batch.reqs)
            testing._record(
                {
                    "kind": "propose",
                    "rids": [req.rid for req in batch.reqs],
                    "seq_lens": batch.seq_lens[:rows].tolist(),
                    "draft": out.draft_token.view(rows, -1).tolist(),
                }
            )
        return out

    setattr(draft, _ORIGINAL, original)
    return draft


def region_spans(seq_lens: Sequence[int], poison: dict[str, Any], page_size: int) -> list[tuple[int, int]]:
    """Per request, the positions [start, end) to poison before a cycle whose committed lengths are ``seq_lens``: the
    cycle's first windowed step has its query at ``seq_len`` and reads ``seq_len + 1`` keys."""
    sink, window, region = int(poison["sink"]), int(poison["window"]), poison.get("region", "outside")
    spans = []
    for length in seq_lens:
        if region == "sink":
            spans.append((0, min(sink, length)))
        elif region == "window":
            spans.append((max(length - window, 0), length))
        elif region == "outside":
            n_sink = win.sink_blocks(sink, page_size)
            dropped = win.dropped_blocks(length + 1, 1, sink, window, page_size)
            spans.append((n_sink * page_size, (n_sink + dropped) * page_size))
        else:
            raise ValueError(f"poison region {region!r}: expected outside, sink or window")
    return spans


def _draft_pool(worker: Any) -> tuple[Any, int]:
    """The draft's KV pool and its page size, from the multi-step backend's first step."""
    step = worker.draft_attn_backend.attn_backends[0]
    return step.token_to_kv_pool, int(step.page_size)


def _layer_ids(pool: Any) -> list[int]:
    mapping = getattr(pool, "full_attention_layer_id_mapping", None)
    if mapping:
        return sorted(mapping)
    start = int(getattr(pool, "start_layer", 0) or 0)
    return list(range(start, start + int(pool.layer_num)))


def poison_draft_kv(worker: Any, batch: Any, poison: dict[str, Any]) -> tuple[list, Any]:
    """Overwrite the draft's KV at the region's slots with large random keys and values; returns what ``restore``
    needs to put the originals back."""
    import torch

    pool, page_size = _draft_pool(worker)
    rows = len(batch.reqs)
    seq_lens = batch.seq_lens[:rows].tolist()
    pool_rows = batch.req_pool_indices[:rows].tolist()
    spans = region_spans(seq_lens, poison, page_size)
    table = worker.req_to_token_pool.req_to_token
    slots = torch.cat(
        [table[row, start:end].long() for row, (start, end) in zip(pool_rows, spans, strict=True) if end > start]
        or [torch.empty(0, dtype=torch.long, device=table.device)]
    )
    generator = torch.Generator().manual_seed(int(poison.get("seed", 0)))
    saved = []
    for layer in _layer_ids(pool):
        for buffer in (pool.get_key_buffer(layer), pool.get_value_buffer(layer)):
            original = buffer[slots].clone()
            noise = torch.randn(original.shape, generator=generator) * POISON_SCALE
            buffer[slots] = noise.to(buffer.device, buffer.dtype)
            saved.append((buffer, original))
    testing._record({"kind": "poison", "region": poison.get("region", "outside"), "spans": spans, "slots": len(slots)})
    return saved, slots


def restore(saved: list, slots: Any) -> None:
    """Put back what ``poison_draft_kv`` overwrote, on the same stream after the draft's forwards."""
    for buffer, original in saved:
        buffer[slots] = original
