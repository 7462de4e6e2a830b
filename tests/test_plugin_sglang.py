"""The SGLang plugin on a stand-in of SGLang's FlashAttention multi-step draft backend, on the CPU.

The stand-in builds each draft step's metadata as SGLang 0.5.17 does for a chain draft (``topk`` 1): eagerly as
fresh tensors, and for CUDA graphs into persistent buffers whose live prefix alone is refilled before each replay,
padding rows at length 1. A reference reader then lists the KV slots the kernel would read through each step's
metadata, which must be exactly the sink's pages and the window's (wmtp.plugin.window), whatever the path.
"""

from __future__ import annotations

import importlib
import json
import sys
import tomllib
import types
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from wmtp.plugin import ImportHook
from wmtp.plugin import sglang as plugin
from wmtp.plugin import sglang_hookpoints as hp
from wmtp.plugin import stats as wstats
from wmtp.plugin import window as win

REPO = Path(__file__).resolve().parents[1]
POOL_WIDTH = 4096  # req_to_token's columns: the longest context a request may reach


@dataclass
class Metadata:
    cache_seqlens_int32: torch.Tensor = None
    cu_seqlens_q: torch.Tensor = None
    cu_seqlens_k: torch.Tensor = None
    page_table: torch.Tensor = None
    max_seq_len_k: int = 0
    swa_page_table: torch.Tensor = None
    pa_swa_page_table: torch.Tensor = None
    local_attn_metadata: object = None
    scheduler_metadata: torch.Tensor = None


class StepBackend:
    """One draft step's backend: what FlashAttentionBackend does for a draft decode with topk 1."""

    def __init__(self, req_to_token: torch.Tensor, page_size: int, step: int):
        self.req_to_token, self.page_size, self.step = req_to_token, page_size, step
        self.forward_metadata = None
        self.graph = None

    def eager(self, batch) -> None:
        m = Metadata()
        m.cache_seqlens_int32 = (batch.seq_lens + self.step + 1).to(torch.int32)
        m.max_seq_len_k = int(batch.seq_lens.max()) + self.step + 1
        m.cu_seqlens_q = torch.arange(0, len(batch.seq_lens) + 1, dtype=torch.int32)
        m.cu_seqlens_k = torch.nn.functional.pad(torch.cumsum(m.cache_seqlens_int32, 0, dtype=torch.int32), (1, 0))
        m.page_table = self.req_to_token[batch.req_pool_indices, : m.max_seq_len_k]
        if self.page_size > 1:
            strided = torch.arange(0, m.page_table.shape[1], self.page_size)
            m.page_table = m.page_table[:, strided] // self.page_size
        self.forward_metadata = m

    def out_graph(self, batch, in_capture: bool) -> None:
        bs = len(batch.seq_lens)
        if self.graph is None:
            pages = POOL_WIDTH // self.page_size
            self.graph = {
                "cache_seqlens": torch.zeros(8, dtype=torch.int32),
                "cu_seqlens_k": torch.zeros(9, dtype=torch.int32),
                "page_table": torch.zeros(8, pages, dtype=torch.int32),
            }
        if in_capture or bs not in self.graph:
            self.graph[bs] = Metadata(
                cache_seqlens_int32=self.graph["cache_seqlens"][:bs],
                cu_seqlens_q=torch.arange(0, bs + 1, dtype=torch.int32),
                cu_seqlens_k=self.graph["cu_seqlens_k"][: bs + 1],
                page_table=self.graph["page_table"][:bs, :],
            )
        m = self.graph[bs]
        m.cache_seqlens_int32.copy_(batch.seq_lens + self.step + 1)
        m.cu_seqlens_k[1:].copy_(torch.cumsum(m.cache_seqlens_int32, 0, dtype=torch.int32))
        for r in range(bs):  # only the live prefix of each row, as SGLang's fused kernel writes it
            n_pages = -(-int(m.cache_seqlens_int32[r]) // self.page_size)
            slots = self.req_to_token[batch.req_pool_indices[r], : n_pages * self.page_size : self.page_size]
            m.page_table[r, :n_pages].copy_(slots // self.page_size)
        self.forward_metadata = m


class FlashAttentionMultiStepBackend:
    def __init__(self, req_to_token: torch.Tensor, page_size: int, num_steps: int, topk: int = 1):
        self.topk = topk
        self.speculative_num_steps = num_steps
        self.attn_backends = [StepBackend(req_to_token, page_size, i) for i in range(num_steps - 1)]

    def init_forward_metadata(self, forward_batch):
        for step in self.attn_backends:
            step.eager(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        for step in self.attn_backends:
            step.out_graph(forward_batch, in_capture)


@pytest.fixture
def backend_module(monkeypatch):
    """A fresh stand-in of SGLang's backend module where the plugin imports it."""
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # the plugin's import hooks go with the test
    module = types.ModuleType(hp.BACKEND_MODULE)
    # A copy of the class, its methods its own as in SGLang: each test wraps a fresh one.
    own = {k: v for k, v in vars(FlashAttentionMultiStepBackend).items() if k not in ("__dict__", "__weakref__")}
    module.FlashAttentionMultiStepBackend = type(hp.MULTI_STEP_CLASS, (), {**own, "__module__": hp.BACKEND_MODULE})
    monkeypatch.setitem(sys.modules, hp.BACKEND_MODULE, module)
    return module


def _configure(monkeypatch, tmp_path, sink: int = 8, window: int = 32) -> Path:
    monkeypatch.setenv(plugin.ENV, json.dumps({"sink": sink, "window": window}))
    directory = tmp_path / "stats"
    monkeypatch.setenv(wstats.ENV, str(directory))
    return directory


def _pool(rows: int, seed: int = 0) -> torch.Tensor:
    """req_to_token: each request's token slots, pages of slots kept whole (page-aligned, as SGLang allocates)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(rows * POOL_WIDTH, generator=generator).view(rows, POOL_WIDTH).to(torch.int32)


def _paged_pool(rows: int, page_size: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    pages = torch.randperm(rows * POOL_WIDTH // page_size, generator=generator).view(rows, -1).to(torch.int32)
    return (pages.repeat_interleave(page_size, 1) * page_size + torch.arange(page_size).repeat(pages.shape[1])).to(
        torch.int32
    )


def _slots_read(m: Metadata, row: int, page_size: int) -> list[int]:
    """The KV slots the kernel reads for ``row``: its first cache_seqlens tokens through the page table."""
    n = int(m.cache_seqlens_int32[row])
    return [int(m.page_table[row, t // page_size]) * page_size + t % page_size for t in range(n)]


def _expected(pool_row: torch.Tensor, length: int, sink: int, window: int, page_size: int) -> list[int]:
    pages = win.kept_blocks(length, 1, sink, window, page_size)
    return [int(pool_row[p * page_size + t]) for p in pages for t in range(page_size) if p * page_size + t < length]


def _batch(seq_lens: list[int], pool_rows: list[int]):
    return SimpleNamespace(
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64), req_pool_indices=torch.tensor(pool_rows, dtype=torch.int64)
    )


@pytest.mark.parametrize("page_size", [1, 16])
def test_eager_steps_read_exactly_the_sink_and_the_window(backend_module, monkeypatch, tmp_path, page_size):
    sink, window, steps = 8, 32, 4
    directory = _configure(monkeypatch, tmp_path, sink, window)
    plugin.register()
    pool = _pool(4) if page_size == 1 else _paged_pool(4, page_size)
    backend = backend_module.FlashAttentionMultiStepBackend(pool, page_size, steps)
    seq_lens, rows = [30, 700, 41, 2000], [2, 0, 3, 1]
    backend.init_forward_metadata(_batch(seq_lens, rows))
    dropped = 0
    for i, step in enumerate(backend.attn_backends):
        m = step.forward_metadata
        for r, (n, pool_row) in enumerate(zip(seq_lens, rows, strict=True)):
            length = n + i + 1
            assert _slots_read(m, r, page_size) == _expected(pool[pool_row], length, sink, window, page_size)
            dropped += win.dropped_blocks(length, 1, sink, window, page_size)
        assert m.cu_seqlens_k.tolist() == [0, *torch.cumsum(m.cache_seqlens_int32, 0).tolist()]
    assert dropped > 0
    getattr(backend, plugin.STATE_ATTR).stats.write()  # as every 32 builds or once a second
    [written] = wstats.read(directory)
    assert written["engine"] == "SGLang" and written["builds"] == written["windowed_forwards"] == steps - 1
    assert written["blocks_skipped"] == dropped and written["longest_decode_context"] == 2000 + steps - 1
    assert written["block_size"] == page_size


def test_graph_replays_window_the_same_buffers_and_leave_padding_valid(backend_module, monkeypatch, tmp_path):
    sink, window, page_size, steps = 4, 16, 1, 3
    directory = _configure(monkeypatch, tmp_path, sink, window)
    plugin.register()
    pool = _pool(4, seed=1)
    backend = backend_module.FlashAttentionMultiStepBackend(pool, page_size, steps)
    backend.init_forward_metadata_out_graph(_batch([1, 1, 1, 1], [0, 0, 0, 0]), in_capture=True)
    # A capture serves no request: it counts as no draft forward, so counters cannot show a window before one ran.
    getattr(backend, plugin.STATE_ATTR).stats.write()
    [captured] = wstats.read(directory)
    assert captured["builds"] == captured["windowed_forwards"] == 0
    buffers = [(s.graph["page_table"].data_ptr(), s.graph["cache_seqlens"].data_ptr()) for s in backend.attn_backends]
    # Two real requests padded to the captured four with length 1 and pool row 0, then other lengths.
    for seq_lens in ([500, 90, 1, 1], [120, 900, 1, 1], [3, 2000, 1, 1]):
        rows = [1, 3, 0, 0]
        backend.init_forward_metadata_out_graph(_batch(seq_lens, rows))
        for i, step in enumerate(backend.attn_backends):
            m = step.forward_metadata
            assert m is step.graph[4]
            assert (m.page_table.data_ptr(), m.cache_seqlens_int32.data_ptr()) == buffers[i]
            for r, (n, pool_row) in enumerate(zip(seq_lens, rows, strict=True)):
                assert _slots_read(m, r, page_size) == _expected(pool[pool_row], n + i + 1, sink, window, page_size)
            assert m.cache_seqlens_int32[2:].tolist() == [i + 2, i + 2]
    getattr(backend, plugin.STATE_ATTR).stats.write()
    [replayed] = wstats.read(directory)
    assert replayed["windowed_forwards"] == 3 * (steps - 1) and replayed["window_anchor"] == "forward"


def test_without_the_variable_nothing_is_wrapped_or_imported(monkeypatch):
    monkeypatch.delenv(plugin.ENV, raising=False)
    monkeypatch.delitem(sys.modules, hp.BACKEND_MODULE, raising=False)
    plugin.register()  # the backend module does not exist here: not even looked for
    assert hp.BACKEND_MODULE not in sys.modules


def test_registering_twice_wraps_once(backend_module, monkeypatch, tmp_path):
    _configure(monkeypatch, tmp_path)
    plugin.register()
    cls = backend_module.FlashAttentionMultiStepBackend
    first = {name: cls.__dict__[name] for name in hp.WRAPPED_METHODS}
    plugin.register()
    for name in hp.WRAPPED_METHODS:
        assert cls.__dict__[name] is first[name]
        assert first[name].__wmtp_original__ is getattr(FlashAttentionMultiStepBackend, name)


def test_a_missing_class_or_method_is_refused_by_name(backend_module, monkeypatch, tmp_path):
    _configure(monkeypatch, tmp_path)
    cls = backend_module.FlashAttentionMultiStepBackend
    del backend_module.FlashAttentionMultiStepBackend
    with pytest.raises(hp.HookPointError, match=f"has no {hp.BACKEND_MODULE}.{hp.MULTI_STEP_CLASS}"):
        plugin.register()
    backend_module.FlashAttentionMultiStepBackend = type(
        hp.MULTI_STEP_CLASS, (), {"init_forward_metadata": cls.init_forward_metadata}
    )
    with pytest.raises(
        hp.HookPointError, match=r"has no FlashAttentionMultiStepBackend\.init_forward_metadata_out_graph"
    ):
        plugin.register()


def test_a_method_with_other_parameters_is_refused(backend_module, monkeypatch, tmp_path):
    _configure(monkeypatch, tmp_path)

    def out_graph(self, batch, capture=False):
        pass

    backend_module.FlashAttentionMultiStepBackend.init_forward_metadata_out_graph = out_graph
    with pytest.raises(hp.HookPointError, match=r"\('batch', 'capture'\), expected \('forward_batch', 'in_capture'\)"):
        plugin.register()


STAND_IN_BACKEND = """
class FlashAttentionMultiStepBackend:
    def init_forward_metadata(self, forward_batch):
        pass

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        pass
"""


@pytest.fixture
def importable_backend(monkeypatch, tmp_path):
    """A stand-in of SGLang's backend module that only an import loads, as in SGLang's processes; returns a function
    that writes the module's source."""
    site, parts = tmp_path / "site", hp.BACKEND_MODULE.split(".")
    for depth in range(1, len(parts)):
        site.joinpath(*parts[:depth]).mkdir(parents=True)
        site.joinpath(*parts[:depth], "__init__.py").touch()
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # the plugin's import hook goes with the test
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    yield lambda source: site.joinpath(*parts[:-1], f"{parts[-1]}.py").write_text(source)
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        del sys.modules[name]


def test_register_imports_nothing_and_wraps_the_backend_when_sglang_imports_it(
    importable_backend, monkeypatch, tmp_path
):
    importable_backend(STAND_IN_BACKEND)
    _configure(monkeypatch, tmp_path)
    plugin.register()
    assert hp.BACKEND_MODULE not in sys.modules  # SGLang's main process, which never needs it, never loads it
    cls = importlib.import_module(hp.BACKEND_MODULE).FlashAttentionMultiStepBackend
    for name in hp.WRAPPED_METHODS:
        assert getattr(cls.__dict__[name], "__wmtp_original__", None) is not None, name


def test_a_backend_module_without_the_class_is_refused_as_sglang_imports_it(importable_backend, monkeypatch, tmp_path):
    importable_backend(STAND_IN_BACKEND.replace("FlashAttentionMultiStepBackend", "SomethingElse"))
    _configure(monkeypatch, tmp_path)
    plugin.register()  # nothing to check until SGLang imports the module
    with pytest.raises(hp.HookPointError, match=f"has no {hp.BACKEND_MODULE}.{hp.MULTI_STEP_CLASS}"):
        importlib.import_module(hp.BACKEND_MODULE)


def test_a_later_registration_windows_with_its_own_settings(importable_backend, monkeypatch, tmp_path):
    importable_backend(STAND_IN_BACKEND)
    _configure(monkeypatch, tmp_path, sink=8, window=32)
    plugin.register()
    _configure(monkeypatch, tmp_path, sink=16, window=64)
    plugin.register()
    [hook] = [f for f in sys.meta_path if isinstance(f, ImportHook) and hp.BACKEND_MODULE in f.patches]
    config = hook.patches[hp.BACKEND_MODULE].keywords["config"]
    assert (config.sink, config.window) == (16, 64)


def test_a_tree_draft_is_refused(backend_module, monkeypatch, tmp_path):
    _configure(monkeypatch, tmp_path)
    plugin.register()
    backend = backend_module.FlashAttentionMultiStepBackend(_pool(1), 1, 3, topk=4)
    with pytest.raises(NotImplementedError, match=r"chain draft .* topk=4"):
        backend.init_forward_metadata(_batch([100], [0]))


def test_a_step_with_a_second_page_table_is_refused(backend_module, monkeypatch, tmp_path):
    _configure(monkeypatch, tmp_path)
    plugin.register()
    backend = backend_module.FlashAttentionMultiStepBackend(_pool(1), 1, 2)
    original = StepBackend.eager

    def with_swa(self, batch):
        original(self, batch)
        self.forward_metadata.swa_page_table = self.forward_metadata.page_table.clone()

    monkeypatch.setattr(StepBackend, "eager", with_swa)
    with pytest.raises(NotImplementedError, match="sets swa_page_table"):
        backend.init_forward_metadata(_batch([100], [0]))


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{sink: 1}", "must be JSON"),
        ('{"sink": 4}', "WMTP_SGLANG_WINDOW.window must be an integer ≥ 1"),
        ('{"sink": 4, "window": 64, "size": 1}', "unknown keys"),
        ('{"sink": 4, "window": 64, "ring": true}', "the ring is built for vLLM only"),
    ],
)
def test_malformed_settings_are_refused(monkeypatch, value, message):
    monkeypatch.setenv(plugin.ENV, value)
    with pytest.raises(win.WindowConfigError, match=message):
        plugin.register()


def test_the_entry_point_is_declared_beside_vllms():
    entry_points = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    assert entry_points[hp.PLUGINS_GROUP] == {"wmtp": "wmtp.plugin.sglang:register"}
    assert entry_points["vllm.general_plugins"] == {"wmtp": "wmtp.plugin:register"}
