"""The vLLM version table: the build's hook check run on sources read out of wheels by HTTP range requests."""

from __future__ import annotations

import http.server
import io
import json
import random
import re
import threading
import zipfile
from pathlib import Path

import pytest
from test_plugin_vllm import FAKE_BACKEND, FAKE_PROPOSER

from wmtp.engines import vllm_versions as vv
from wmtp.engines.vllm import WindowUnsupported, check_cell
from wmtp.engines.vllm_hooks import ring_points, runner_switch
from wmtp.plugin.hookpoints import HookPointError

REPO = Path(__file__).resolve().parents[1]


def _wheel_bytes(
    backend: str = FAKE_BACKEND, envs: str | None = "VLLM_USE_V2_MODEL_RUNNER: bool | None = None\n"
) -> bytes:
    """A wheel-shaped zip: the members the check reads, plus bulk it must not read."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as wheel:
        wheel.writestr("vllm/_version.py", "__version__ = '9.9.9'\n")
        wheel.writestr("vllm/v1/spec_decode/llm_base_proposer.py", FAKE_PROPOSER)
        wheel.writestr("vllm/v1/spec_decode/eagle.py", "class EagleProposer:\n    pass\n")
        wheel.writestr("vllm/v1/attention/backend.py", backend)
        wheel.writestr("vllm/v1/worker/gpu/model_runner.py", "class GPUModelRunner:\n    pass\n")
        if envs is not None:
            wheel.writestr("vllm/envs.py", envs)
        wheel.writestr("vllm/_C.abi3.so", random.Random(0).randbytes(1 << 20))  # 1 MB the check never needs
        wheel.writestr("vllm/v1/spec_decode/kernels/deep.py", "x = 1\n")
    return out.getvalue()


class _RangeServer(http.server.BaseHTTPRequestHandler):
    """Serves one file, honouring single byte ranges as PyPI's file host does; counts bytes sent."""

    body = b""
    sent = 0

    ranges = True

    def do_GET(self) -> None:
        start, end = 0, len(self.body) - 1
        wanted = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", "")) if self.ranges else None
        if wanted:
            start, end = int(wanted.group(1)), min(int(wanted.group(2)), end)
        chunk = self.body[start : end + 1]
        self.send_response(206 if wanted else 200)
        self.send_header("Content-Length", str(len(chunk)))
        if wanted:
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(self.body)}")
        self.end_headers()
        self.wfile.write(chunk)
        type(self).sent += len(chunk)

    def log_message(self, *args) -> None:
        pass


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        pass  # a client that refuses a reply closes the connection mid-body: expected here


@pytest.fixture
def wheel_server():
    servers = []

    def serve(body: bytes, ranges: bool = True) -> str:
        handler = type("Handler", (_RangeServer,), {"body": body, "sent": 0, "ranges": ranges})
        server = _QuietServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/vllm.whl", handler

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def _check_served(serve, tmp_path: Path, body: bytes) -> tuple[dict, type]:
    import httpx

    url, handler = serve(body)
    with httpx.Client() as client:
        remote = vv.RangeFile(url, len(body), client.stream)
        root = vv.unpack_sources(zipfile.ZipFile(io.BufferedReader(remote, buffer_size=1 << 16)), tmp_path)
    return vv.check_sources(root, "9.9.9"), handler


def test_a_served_wheel_is_checked_from_a_few_members(wheel_server, tmp_path):
    body = _wheel_bytes()
    result, handler = _check_served(wheel_server, tmp_path, body)
    ring = result.pop("ring")
    assert result == {
        "version": "9.9.9",
        "status": "checked",
        "runner": "V1 (VLLM_USE_V2_MODEL_RUNNER=0)",
        "reason": "",
    }
    # the fake wheel has none of the ring's modules: the windowed draft passes, the ring alone is refused
    assert ring.startswith("refused: vLLM 9.9.9 lacks vllm.v1.kv_cache_interface.KVCacheSpec.max_memory_usage_bytes")
    assert handler.sent < len(body) / 4  # the 1 MB library was never fetched
    unpacked = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.py"))
    assert "vllm/v1/spec_decode/kernels/deep.py" not in unpacked and "vllm/envs.py" in unpacked


def test_a_server_that_ignores_ranges_is_refused_before_its_body_is_read(wheel_server, tmp_path):
    import httpx

    body = _wheel_bytes()
    url, _ = wheel_server(body, ranges=False)
    with httpx.Client() as client, pytest.raises((OSError, zipfile.BadZipFile)) as err:
        vv.unpack_sources(zipfile.ZipFile(io.BufferedReader(vv.RangeFile(url, len(body), client.stream))), tmp_path)
    # zipfile wraps the refusal of its first read
    cause = err.value if isinstance(err.value, OSError) else err.value.__context__
    assert "got HTTP 200 without a Content-Range: the server does not serve byte ranges" in str(cause)


def test_a_wheel_with_an_unclassified_length_field_is_refused(wheel_server, tmp_path):
    body = _wheel_bytes(backend=FAKE_BACKEND + "    _context_lens_cpu: object = None\n")
    result, _ = _check_served(wheel_server, tmp_path, body)
    assert result["status"] == "refused"
    assert "fields ['_context_lens_cpu'] that the wmtp plugin neither windows, keeps nor refuses" in result["reason"]


def test_a_v2_runner_without_the_switch_is_refused(wheel_server, tmp_path):
    result, _ = _check_served(wheel_server, tmp_path, _wheel_bytes(envs=""))
    assert result["status"] == "refused" and "no VLLM_USE_V2_MODEL_RUNNER switch" in result["reason"]


def test_a_vllm_without_a_v2_runner_needs_no_switch(tmp_path):
    (tmp_path / "vllm").mkdir()
    assert runner_switch(tmp_path / "vllm", "0.1") == {"runner": "V1 (no V2 runner)"}
    gpu = tmp_path / "vllm" / "v1" / "worker" / "gpu"
    gpu.mkdir(parents=True)
    (gpu / "model_runner.py").write_text("")
    with pytest.raises(HookPointError, match="cannot be held on the V1 runner"):
        runner_switch(tmp_path / "vllm", "0.1")


def test_wheel_url_picks_the_x86_64_linux_wheel():
    index = {
        "files": [
            {"filename": "vllm-0.24.0.tar.gz", "url": "s", "size": 1},
            {"filename": "vllm-0.24.0-cp38-abi3-manylinux_2_28_aarch64.whl", "url": "a", "size": 2},
            {"filename": "vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl", "url": "x", "size": 3},
            {"filename": "vllm-0.24.01-cp38-abi3-manylinux_2_28_x86_64.whl", "url": "y", "size": 4},
        ]
    }
    assert vv.wheel_url(index, "0.24.0") == ("x", 3)
    with pytest.raises(LookupError, match=r"0\.25\.0"):
        vv.wheel_url(index, "0.25.0")


def test_status_rows_mark_only_passing_pinned_versions_tested():
    checks = [
        {"version": "0.9.0", "status": "refused", "reason": "r"},
        {"version": "0.32.0", "status": "checked", "runner": "V1", "reason": ""},
        {"version": "0.10.0", "status": "checked", "runner": "V1", "reason": ""},
    ]
    rows = vv.status_rows(checks, tested={"0.32.0", "0.9.0"})
    assert [(r["version"], r["status"]) for r in rows] == [
        ("0.9.0", "refused"),
        ("0.10.0", "checked"),
        ("0.32.0", "tested"),
    ]
    table = vv.render_table(rows)
    assert "| 0.9.0 | refused | — | — | r |" in table and "| 0.32.0 | tested | V1 | — | — |" in table


def test_versions_whose_gpu_proofs_all_passed_are_tested_on_the_gpu(tmp_path):
    checks = [{"version": v, "status": "checked", "runner": "V1", "reason": ""} for v in ("0.24.0", "0.25.0", "0.32.0")]
    proofs = {"engine": {"vllm": "0.24.0"}, "passed": True, "proofs": {"patched": True, "windowed": True}}
    (tmp_path / "ok.json").write_text(json.dumps(proofs))
    (tmp_path / "failed.json").write_text(
        json.dumps(
            {**proofs, "engine": {"vllm": "0.25.0"}, "passed": False, "proofs": {"patched": True, "windowed": False}}
        )
    )
    gpu = vv.gpu_tested_versions([tmp_path / "ok.json", tmp_path / "failed.json", tmp_path / "missing.json"])
    assert gpu == {"0.24.0"}
    rows = vv.status_rows(checks, tested={"0.32.0"}, gpu_tested=gpu | {"0.32.0"})
    assert [r["status"] for r in rows] == ["tested (GPU)", "checked", "tested (CPU and GPU)"]


def test_the_committed_gpu_proofs_name_a_version_the_table_lists_as_tested_on_the_gpu():
    gpu = vv.gpu_tested_versions([vv.GPU_PROOFS])
    assert gpu == {"0.24.0"}
    table = (REPO / "docs" / "vllm-versions.md").read_text()
    assert "| 0.24.0 | tested (GPU) |" in table


def test_the_embedded_engine_pin_is_the_tested_version():
    assert vv.tested_versions([REPO / "config" / "config.yaml"]) == {"0.32.0"}


def test_the_readme_shows_the_committed_table():
    table = (REPO / "docs" / "vllm-versions.md").read_text().split("\n\n")[-1]
    readme = (REPO / "README.md").read_text()
    assert vv.replace_block(readme, table) == readme, "README's vLLM table differs from docs/vllm-versions.md"
    tested = [line for line in table.splitlines() if "| tested |" in line or "| tested (CPU and GPU) |" in line]
    assert [line.split("|")[1].strip() for line in tested] == sorted(
        vv.tested_versions([REPO / "config" / "config.yaml"])
    )


RING_SOURCES = {
    "kv_cache_interface.py": (
        "class KVCacheSpec:\n"
        "    def max_memory_usage_bytes(self, vllm_config):\n        pass\n"
        "    def is_uniform_with_collection(self, s):\n        pass\n"
        "class AttentionSpec(KVCacheSpec):\n    pass\n"
        "class FullAttentionSpec(AttentionSpec):\n    pass\n"
    ),
    "core/single_type_kv_cache_manager.py": (
        "class BaseManager:\n"
        "    def __init__(self, kv_cache_spec, block_pool, max_admission_blocks_per_request=None):\n"
        "        self.block_pool = block_pool\n"
        "        self.req_to_blocks = {}\n"
        "class SingleTypeKVCacheManager(BaseManager):\n"
        "    def __init__(self, kv_cache_spec, block_pool, max_admission_blocks_per_request=None):\n"
        "        super().__init__(kv_cache_spec, block_pool, max_admission_blocks_per_request)\n"
        "        self._null_block = block_pool.null_block\n"
        "    @classmethod\n    def find_longest_cache_hit(cls):\n        pass\n"
        "    def remove_skipped_blocks(self, request_id, total_computed_tokens):\n"
        "        pass\n"
    ),
    "core/block_pool.py": "class BlockPool:\n    def free_blocks(self, blocks):\n        pass\n",
    "core/kv_cache_utils.py": (
        "def create_kv_cache_group_specs(kv_cache_spec, grouped_layer_names):\n    pass\n"
        "def _get_kv_cache_groups_uniform_page_size(kv_cache_spec):\n    pass\n"
    ),
    "kv_cache_spec_registry.py": (
        "class KVCacheSpecRegistry:\n"
        "    @classmethod\n    def register(cls):\n        pass\n"
        "    @classmethod\n    def _ensure_registered(cls, vllm_config=None):\n        pass\n"
    ),
    "worker/gpu_model_runner.py": "class GPUModelRunner:\n    def get_kv_cache_spec(self):\n        pass\n",
}
PROPOSER_WITH_LAYERS = FAKE_PROPOSER + "\n    def load_model(self):\n        self._draft_attn_layer_names = set()\n"


def _ring_tree(root: Path, replace: tuple[str, str] = ("", ""), proposer: str = PROPOSER_WITH_LAYERS) -> Path:
    vllm = root / "vllm"
    for name, text in RING_SOURCES.items():
        path = vllm / "v1" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.replace(*replace) if replace[0] else text)
    (vllm / "utils").mkdir(parents=True, exist_ok=True)
    (vllm / "utils" / "math_utils.py").write_text("def cdiv(a, b):\n    return -(-a // b)\n")
    path = vllm / "v1" / "spec_decode" / "llm_base_proposer.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(proposer)
    return vllm


def test_the_rings_hook_points_are_checked_one_by_one(tmp_path):
    # __init__'s parameters and self.block_pool come from a base class in the same module: that counts
    assert ring_points(_ring_tree(tmp_path / "all"), "9.9.9") == {
        "ring": "ok",
        "ring_grouping": "vllm.v1.core.kv_cache_utils",
    }
    gone = ring_points(_ring_tree(tmp_path / "gone", ("def remove_skipped_blocks(", "def drop_blocks(")), "9.9.9")
    assert gone == {
        "ring_refused": "vLLM 9.9.9 lacks vllm.v1.core.single_type_kv_cache_manager.SingleTypeKVCacheManager."
        "remove_skipped_blocks (the method), which arm wmtp-ring relies on"
    }
    renamed = ring_points(
        _ring_tree(tmp_path / "params", ("max_admission_blocks_per_request=None", "admission_cap=None")), "9.9.9"
    )
    assert (
        "SingleTypeKVCacheManager.__init__ (parameters ['max_admission_blocks_per_request'])" in renamed["ring_refused"]
    )
    no_pool = ring_points(_ring_tree(tmp_path / "pool", ("def free_blocks(", "def release(")), "9.9.9")
    assert "vllm.v1.core.block_pool.BlockPool.free_blocks (the method)" in no_pool["ring_refused"]
    # without the grouping the ring knows, it still runs, in vLLM's own grouping
    regrouped = ring_points(_ring_tree(tmp_path / "groups", ("def create_kv_cache_group_specs", "def groups")), "9")
    assert regrouped == {"ring": "ok", "ring_grouping": None}
    unlisted = _ring_tree(tmp_path / "blocks", ("self.req_to_blocks =", "blocks ="))
    assert "SingleTypeKVCacheManager: self.req_to_blocks" in ring_points(unlisted, "9")["ring_refused"]
    # a name in a comment is not an attribute the proposer sets
    commented = _ring_tree(tmp_path / "comment", proposer=FAKE_PROPOSER + "\n# self._draft_attn_layer_names = {}\n")
    assert "SpecDecodeBaseProposer: self._draft_attn_layer_names" in ring_points(commented, "9")["ring_refused"]


def test_an_engine_without_the_rings_hook_points_refuses_only_the_ring():
    manifest = {"versions": {"hook_points": {"ring_refused": "vLLM 9.9.9 lacks X"}}}
    for arm in ("none", "mtp", "wmtp"):
        check_cell(_Spec(), manifest, _Cell(arm))
    with pytest.raises(WindowUnsupported, match=r"cannot serve arm 'wmtp-ring': vLLM 9\.9\.9 lacks X"):
        check_cell(_Spec(), manifest, _Cell("wmtp-ring"))


class _Spec:
    name = "vllm-old"


class _Cell:
    def __init__(self, arm: str) -> None:
        self.arm = arm


def test_an_engine_that_failed_the_hook_check_serves_no_windowed_arm():
    manifest = {"versions": {"vllm": "0.24.0", "hook_points_refused": "vLLM 0.24.0: … has fields ['_seq_lens_cpu']"}}
    for arm in ("none", "mtp"):
        check_cell(_Spec(), manifest, _Cell(arm))
    for arm in ("wmtp", "wmtp-ring"):
        with pytest.raises(WindowUnsupported, match=r"engine 'vllm-old' cannot serve arm .*_seq_lens_cpu"):
            check_cell(_Spec(), manifest, _Cell(arm))
    check_cell(_Spec(), {"versions": {"hook_points": {}}}, _Cell("wmtp"))
    # a manifest written before the ring's points were checked proves nothing about them
    with pytest.raises(WindowUnsupported, match="never checked the ring's hook points"):
        check_cell(_Spec(), {"versions": {"hook_points": {}}}, _Cell("wmtp-ring"))
    check_cell(_Spec(), {"versions": {"hook_points": {"ring": "ok"}}}, _Cell("wmtp-ring"))


@pytest.mark.engine
def test_the_tested_row_is_what_the_engine_itself_reports(engine_python):
    """The engine the suite runs passes the same check in its own interpreter, as the table says."""
    import json
    import subprocess

    probe = "import json; from wmtp.engines.vllm_hooks import check_hook_points; print(json.dumps(check_hook_points()))"
    out = subprocess.run([engine_python, "-c", probe], capture_output=True, text=True, check=True, timeout=300)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    rows = {
        line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:4]]
        for line in (REPO / "docs" / "vllm-versions.md").read_text().splitlines()
        if line.startswith("| 0.")
    }
    assert rows[found["vllm_version"]] == ["tested", found["runner"]]


def test_the_ring_column_names_the_strongest_test_its_version_passed(tmp_path):
    checks = [
        {"version": v, "status": "checked", "runner": "V1", "ring": "checked", "reason": ""}
        for v in ("0.23.0", "0.24.0", "0.32.0")
    ] + [{"version": "0.22.0", "status": "checked", "runner": "V1", "ring": "refused: lacks X", "reason": ""}]
    passed = {"engine": {"vllm": "0.24.0"}, "verdict": "ring admits one more", "same_output": True}
    (tmp_path / "passed.json").write_text(json.dumps(passed))
    # admitted one more, but its outputs were not wmtp's: not a pass
    (tmp_path / "differs.json").write_text(json.dumps({**passed, "engine": {"vllm": "0.23.0"}, "same_output": False}))
    gpu = vv.gpu_ring_versions([tmp_path / "passed.json", tmp_path / "differs.json"])
    assert gpu == {"0.24.0"}
    before = vv.status_rows(checks, tested={"0.32.0"}, ring_scheduler_tested={"0.24.0"})
    assert [(r["version"], r["ring"]) for r in before] == [
        ("0.22.0", "refused: lacks X"),
        ("0.23.0", "checked"),
        ("0.24.0", "tested (scheduler)"),
        ("0.32.0", "tested"),
    ]
    after = vv.status_rows(checks, tested={"0.32.0"}, ring_scheduler_tested={"0.24.0"}, ring_gpu_tested=gpu)
    assert [r["ring"] for r in after][2] == "tested (GPU)"


def test_the_rings_scheduler_is_tested_on_the_carried_vllm():
    from conftest import gpu_vllm_version

    assert vv.scheduler_tested_versions(vv.MAKEFILE) == {gpu_vllm_version()}
    table = (REPO / "docs" / "vllm-versions.md").read_text()
    assert f"| {gpu_vllm_version()} | tested (GPU) | V1 (VLLM_USE_V2_MODEL_RUNNER=0) | tested (scheduler) |" in table


def test_a_ring_in_vllms_own_grouping_says_so():
    row = {"version": "9.9.9", "status": "checked", "runner": "V1", "ring": "checked", "reason": ""}
    assert "| checked (vLLM's grouping: groups of one layer) |" in vv.render_table([{**row, "ring_grouping": None}])
    assert "| checked |" in vv.render_table([{**row, "ring_grouping": "vllm.v1.core.kv_cache_utils"}])
