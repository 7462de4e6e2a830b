"""The SGLang proofs' instrument on a stand-in of SGLang's draft worker, on the CPU.

The stand-in worker drafts from what its draft steps read: each step's token is a function of the draft layer's
keys at the slots the step's (windowed) metadata lists, so a poisoned slot that a step reads changes its token and
one it does not read cannot. The metadata comes from test_plugin_sglang's stand-in backend, wrapped by the plugin.
"""

from __future__ import annotations

import json
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from test_plugin_sglang import POOL_WIDTH, _configure, _pool, _slots_read, backend_module  # noqa: F401

from wmtp.plugin import sglang as plugin
from wmtp.plugin import sglang_testing as instrument
from wmtp.plugin import testing
from wmtp.plugin import window as win

SINK, WINDOW, STEPS = 8, 32, 3
HEADS, DIM = 2, 4


class Pool:
    """The draft's KV pool as SGLang's hybrid pool presents it: one full-attention layer, id 0."""

    def __init__(self, slots: int):
        generator = torch.Generator().manual_seed(1)
        self.k = torch.randn(slots, HEADS, DIM, generator=generator)
        self.v = torch.randn(slots, HEADS, DIM, generator=generator)
        self.full_attention_layer_id_mapping = {0: 0}

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        assert layer == 0
        return self.k

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        assert layer == 0
        return self.v


def _worker_module(backend_module) -> types.ModuleType:  # noqa: F811
    class EagleDraftWorker:
        def __init__(self, req_to_token: torch.Tensor):
            self.req_to_token_pool = SimpleNamespace(req_to_token=req_to_token)
            self.draft_attn_backend = backend_module.FlashAttentionMultiStepBackend(req_to_token, 1, STEPS)
            self.pool = Pool(int(req_to_token.max()) + 1)
            for step in self.draft_attn_backend.attn_backends:
                step.token_to_kv_pool = self.pool

        def draft(self, batch):
            self.draft_attn_backend.init_forward_metadata(batch)
            rows = []
            for r in range(len(batch.reqs)):
                tokens = [7]  # the bonus token, then the first draft (from the draft-extend, not windowed)
                tokens.append(11)
                for step in self.draft_attn_backend.attn_backends:
                    read = _slots_read(step.forward_metadata, r, 1)
                    tokens.append(int(self.pool.k[read].sum() * 1000) % 50_000)
                rows.append(tokens)
            return SimpleNamespace(draft_token=torch.tensor(rows).flatten())

    module = types.ModuleType(instrument.DRAFT_WORKER_MODULE)
    module.EagleDraftWorker = EagleDraftWorker
    return module


@pytest.fixture
def instrumented(backend_module, monkeypatch, tmp_path):  # noqa: F811
    module = _worker_module(backend_module)
    monkeypatch.setitem(sys.modules, instrument.DRAFT_WORKER_MODULE, module)
    _configure(monkeypatch, tmp_path, SINK, WINDOW)
    test_dir = tmp_path / "instrument"
    test_dir.mkdir()
    monkeypatch.setenv(testing.ENV, str(test_dir))
    plugin.register()
    worker = module.EagleDraftWorker(_pool(4))
    return worker, test_dir


def _control(test_dir, tag: str, window=(SINK, WINDOW), poison: str | None = None, seed: int = 0) -> None:
    body = {"tag": tag, "sink": window[0], "window": window[1]}
    if poison:
        body["poison"] = {"sink": SINK, "window": WINDOW, "region": poison, "seed": seed}
    (test_dir / "control.json").write_text(json.dumps(body))


def _batch(seq_lens: list[int], pool_rows: list[int]):
    return SimpleNamespace(
        reqs=[SimpleNamespace(rid=f"r{i}") for i in range(len(seq_lens))],
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        req_pool_indices=torch.tensor(pool_rows, dtype=torch.int64),
        forward_mode=SimpleNamespace(is_idle=lambda: False),
    )


def _drafts(test_dir, tag: str) -> list:
    lines = [json.loads(line) for line in (test_dir / "records.jsonl").read_text().splitlines()]
    return [r["draft"] for r in lines if r["kind"] == "propose" and r["tag"] == tag]


def test_the_regions_lie_where_the_cycles_first_windowed_step_reads_and_does_not():
    for page_size in (1, 16):
        for length in (40, 700, 3000):
            kept = win.kept_blocks(length + 1, 1, SINK, WINDOW, page_size)
            read = {b * page_size + t for b in kept for t in range(page_size)} & set(range(length))
            poison = {"sink": SINK, "window": WINDOW}
            outside = set(range(*instrument.region_spans([length], {**poison, "region": "outside"}, page_size)[0]))
            sink = set(range(*instrument.region_spans([length], {**poison, "region": "sink"}, page_size)[0]))
            window = set(range(*instrument.region_spans([length], {**poison, "region": "window"}, page_size)[0]))
            # Outside is exactly what the step leaves out of the committed positions; the sink and window it reads.
            assert outside == set(range(length)) - read, (page_size, length)
            assert sink <= read and window <= read and len(window) == min(WINDOW, length)
    with pytest.raises(ValueError, match="poison region 'middle'"):
        instrument.region_spans([100], {"sink": 1, "window": 2, "region": "middle"}, 1)


def test_poison_outside_the_window_leaves_the_drafts_and_the_cache_as_they_were(instrumented):
    worker, test_dir = instrumented
    batch = _batch([3000, 1500], [1, 2])
    keys, values = worker.pool.k.clone(), worker.pool.v.clone()
    for tag, window, region, seed in (
        ("clean", (SINK, WINDOW), None, 0),
        ("outside", (SINK, WINDOW), "outside", 1),
        ("outside again", (SINK, WINDOW), "outside", 2),
        ("sink", (SINK, WINDOW), "sink", 1),
        ("window", (SINK, WINDOW), "window", 1),
        ("all, clean", (0, 10**6), None, 0),
        ("all, outside", (0, 10**6), "outside", 1),
    ):
        _control(test_dir, tag, window, region, seed)
        worker.draft(batch)
        # Restored after each cycle: the draft-extend that follows reads the whole context.
        assert torch.equal(worker.pool.k, keys) and torch.equal(worker.pool.v, values), tag
    clean = _drafts(test_dir, "clean")
    assert clean and _drafts(test_dir, "outside") == clean and _drafts(test_dir, "outside again") == clean
    assert _drafts(test_dir, "sink") != clean and _drafts(test_dir, "window") != clean
    # A draft that reads everything reads the poison: the check bites.
    assert _drafts(test_dir, "all, outside") != _drafts(test_dir, "all, clean")
    poisons = [json.loads(line) for line in (test_dir / "records.jsonl").read_text().splitlines()]
    poisons = [p for p in poisons if p["kind"] == "poison"]
    assert [p["region"] for p in poisons] == ["outside", "outside", "sink", "window", "outside"]
    assert poisons[0]["slots"] == sum(end - start for start, end in poisons[0]["spans"]) > 0


def test_the_instrument_is_off_without_its_directory(backend_module, monkeypatch, tmp_path):  # noqa: F811
    module = _worker_module(backend_module)
    monkeypatch.setitem(sys.modules, instrument.DRAFT_WORKER_MODULE, module)
    _configure(monkeypatch, tmp_path, SINK, WINDOW)
    monkeypatch.delenv(testing.ENV, raising=False)
    original = module.EagleDraftWorker.draft
    plugin.register()
    assert module.EagleDraftWorker.draft is original
    monkeypatch.setenv(testing.ENV, str(tmp_path))
    plugin.register()
    plugin.register()
    wrapped = module.EagleDraftWorker.draft
    assert wrapped is not original and getattr(wrapped, instrument._ORIGINAL) is original
    assert POOL_WIDTH >= 3000 + STEPS
