"""The SGLang plugin's source check: on a minimal tree, on SGLang's own release read out of its wheel, and on
copies with one hook point taken away (0.5.21 has the same hook points as 0.5.17, so the failures are made here)."""

from __future__ import annotations

import io
import random
import re
import shutil
import threading
import zipfile
from pathlib import Path

import pytest
from test_vllm_versions import _QuietServer, _RangeServer

from wmtp.engines import sglang, sglang_hooks
from wmtp.engines import vllm_versions as vv
from wmtp.plugin import sglang_hookpoints as hp

REPO = Path(__file__).resolve().parents[1]

PLUGINS = """
GENERAL_PLUGINS_GROUP = "sglang.srt.plugins"


def load_plugins():
    pass
"""
BACKEND = """
class FlashAttentionMetadata:
    cache_seqlens_int32: object = None
    cu_seqlens_k: object = None
    page_table: object = None
    swa_page_table: object = None


class FlashAttentionBackend:
    def __init__(self, model_runner):
        self.page_size = model_runner.page_size

    def init_forward_metadata(self, forward_batch):
        self.forward_metadata = FlashAttentionMetadata()

    def forward_decode(self, q, k, v, layer, forward_batch):
        metadata = self.forward_metadata
        return metadata.page_table, metadata.cache_seqlens_int32, metadata.cu_seqlens_k


class FlashAttentionMultiStepBackend:
    def __init__(self, model_runner, topk, speculative_num_steps):
        self.topk = topk
        self.attn_backends = [FlashAttentionBackend(model_runner) for _ in range(speculative_num_steps - 1)]

    def init_forward_metadata(self, forward_batch):
        pass

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        pass
"""
VERSION = "__version__ = version = '9.9.9'\n"


def _tree(root: Path, plugins: str = PLUGINS, backend: str = BACKEND) -> Path:
    package = root / "sglang"
    for relative, text in (
        ("srt/plugins/__init__.py", plugins),
        ("srt/layers/attention/flashattention_backend.py", backend),
        ("_version.py", VERSION),
    ):
        (package / relative).parent.mkdir(parents=True, exist_ok=True)
        (package / relative).write_text(text)
    return package


def test_a_minimal_tree_with_every_hook_point_passes(tmp_path):
    result = sglang_hooks.check_hook_points(_tree(tmp_path))
    assert result["ok"] and result["missing"] == [] and result["version"] == "9.9.9"
    where = f"{hp.BACKEND_MODULE}.{hp.MULTI_STEP_CLASS}"
    assert f"{where}.init_forward_metadata_out_graph(forward_batch, in_capture)" in result["found"]
    assert f"{hp.BACKEND_MODULE}.{hp.METADATA_CLASS}.swa_page_table (refused when set)" in result["found"]


# (what is changed in the minimal tree's backend or plugins module, the line the check then reports missing)
MUTATIONS = [
    ("backend", "class FlashAttentionMultiStepBackend:", "class MultiStepBackend:", f"class {hp.BACKEND_MODULE}."),
    ("backend", "forward_batch, in_capture=False", "forward_batch, capture=False", "init_forward_metadata_out_graph("),
    (
        "backend",
        "    def init_forward_metadata(self, forward_batch):\n        pass",
        "",
        ".init_forward_metadata(forward_b",
    ),
    ("backend", "self.page_size = ", "self.block_size = ", "FlashAttentionBackend: self.page_size"),
    ("backend", "self.attn_backends = ", "self.step_backends = ", "FlashAttentionMultiStepBackend: self.attn_backends"),
    ("backend", "metadata.page_table,", "metadata.block_table,", "forward_decode reads .page_table"),
    ("backend", "    cache_seqlens_int32: object = None\n", "", "FlashAttentionMetadata.cache_seqlens_int32"),
    ("plugins", '"sglang.srt.plugins"', '"sglang.plugins"', "GENERAL_PLUGINS_GROUP = 'sglang.srt.plugins'"),
    ("plugins", "def load_plugins", "def load_general_plugins", "sglang.srt.plugins.load_plugins()"),
]


@pytest.mark.parametrize(("where", "old", "new", "reported"), MUTATIONS, ids=[m[3] for m in MUTATIONS])
def test_each_missing_hook_point_is_named(tmp_path, where, old, new, reported):
    texts = {"plugins": PLUGINS, "backend": BACKEND}
    assert old in texts[where]
    texts[where] = texts[where].replace(old, new)
    result = sglang_hooks.check_hook_points(_tree(tmp_path, **texts))
    assert not result["ok"]
    assert [line for line in result["missing"] if reported in line], result["missing"]


def test_a_tree_without_the_backend_module_says_so(tmp_path):
    package = _tree(tmp_path)
    (package / "srt/layers/attention/flashattention_backend.py").unlink()
    result = sglang_hooks.check_hook_points(package)
    assert result["missing"] == [f"module {hp.BACKEND_MODULE}"]


def test_the_target_release_has_every_hook_point(sglang_sources):
    result = sglang_hooks.check_hook_points(sglang_sources)
    assert result["version"] == hp.TARGET_VERSION
    assert result["ok"], result["missing"]
    # The sliding-window, local-attention and scheduler fields the plugin refuses all exist there.
    assert sum("(refused when set)" in line for line in result["found"]) == len(hp.REFUSED_FIELDS)


@pytest.mark.parametrize(
    ("old", "new", "reported"),
    [
        (
            "forward_batch: ForwardBatch,\n        in_capture: bool = False",
            "forward_batch: ForwardBatch,\n        capture: bool = False",
            "FlashAttentionMultiStepBackend.init_forward_metadata_out_graph(forward_batch, in_capture)",
        ),
        (
            "class FlashAttentionMultiStepBackend:",
            "class FlashAttentionDraftBackend:",
            "FlashAttentionMultiStepBackend",
        ),
        ("        self.attn_backends = []", "        self.step_backends = []", "self.attn_backends"),
    ],
)
def test_the_target_release_with_a_hook_point_taken_away_fails(sglang_sources, tmp_path, old, new, reported):
    copy = tmp_path / "sglang"
    shutil.copytree(sglang_sources, copy)
    backend = sglang_hooks.module_path(copy, hp.BACKEND_MODULE)
    # Changed in the multi-step class only: the step backend has a method of the same name.
    head, cls, tail = backend.read_text().partition(f"class {hp.MULTI_STEP_CLASS}:")
    changed = (cls + tail).replace(old, new, 1)
    assert changed != cls + tail
    backend.write_text(head + changed)
    result = sglang_hooks.check_hook_points(copy)
    assert not result["ok"] and [line for line in result["missing"] if reported in line], result["missing"]


def test_the_target_release_declares_the_server_metrics_the_adapter_reads(sglang_sources, tmp_path):
    assert sglang_hooks.check_metrics(sglang_sources)["ok"], sglang_hooks.check_metrics(sglang_sources)["missing"]
    copy = tmp_path / "sglang"
    shutil.copytree(sglang_sources, copy)
    collector = sglang_hooks.module_path(copy, sglang.METRICS_MODULE)
    text = collector.read_text()
    assert text.count('"sglang:spec_verify_calls_total"') == 1
    collector.write_text(text.replace('"sglang:spec_verify_calls_total"', '"sglang:spec_verify_calls"'))
    result = sglang_hooks.check_metrics(copy)
    assert not result["ok"] and result["missing"] == [f"{sglang.METRICS_MODULE}: metric sglang:spec_verify_calls_total"]


def test_the_sources_are_read_out_of_a_served_wheel_member_by_member(tmp_path, monkeypatch):
    """The check's three files come out of the wheel by range requests; the rest of the wheel is never read."""
    wheel = io.BytesIO()
    package = _tree(tmp_path / "tree")
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(package.rglob("*.py")):
            archive.writestr(f"sglang/{path.relative_to(package)}", path.read_text())
        archive.writestr("sglang/srt/models/big.py", random.Random(0).randbytes(1 << 20))  # never needed
        archive.writestr("sglang-9.9.9.dist-info/entry_points.txt", "")
    body = wheel.getvalue()
    handler = type("Handler", (_RangeServer,), {"body": body, "sent": 0, "ranges": True})
    server = _QuietServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/sglang.whl"
    name = "sglang-9.9.9-cp310-cp310-manylinux_2_34_x86_64.whl"
    asked = []

    def index(client, package):
        asked.append(package)
        return {"files": [{"filename": name, "url": url, "size": len(body)}]}

    monkeypatch.setattr(vv, "release_index", index)
    try:
        found = sglang_hooks.fetch_sources("9.9.9", tmp_path / "out")
    finally:
        server.shutdown()
        server.server_close()
    assert asked == ["sglang"] and found["package"] == "sglang" and found["members"] == 3
    assert found["hook_points"]["ok"] and found["hook_points"]["version"] == "9.9.9"
    unpacked = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*.py"))
    assert unpacked == [
        "sglang/_version.py",
        "sglang/srt/layers/attention/flashattention_backend.py",
        "sglang/srt/plugins/__init__.py",
    ]
    assert handler.sent < len(body) / 4


def test_the_makefile_reads_the_target_release():
    makefile = (REPO / "Makefile").read_text()
    assert re.search(
        rf"^SGLANG_SOURCES := results/engines/sources/sglang-{re.escape(hp.TARGET_VERSION)}/", makefile, re.M
    )
