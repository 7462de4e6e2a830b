"""scripts/device/h200_background.sh follow: what a call brings back of runs it did not start itself."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "device" / "h200_background.sh"


def _follow(
    tmp_path: Path, root: Path, done: bool, cache: str | None = None
) -> tuple[subprocess.CompletedProcess, Path]:
    state, out = tmp_path / "state", tmp_path / "out"
    state.mkdir(exist_ok=True)
    out.mkdir(exist_ok=True)
    (state / "root").write_text(f"{root}\n")
    if cache:  # as start records the engine's cache
        (state / "cache").write_text(f"{cache}\n")
    (state / "progress.log").write_text("h200_background: piece: …\n")
    (state / "targets").write_text("results/s/raw/rung~1/a/manifest.json\n")
    (state / "snakemake.log").write_text("Finished jobid: 0\n")
    if done:
        (state / "done").touch()
    env = {**os.environ, "OUT": str(out), "WMTP_BACKGROUND_STATE": str(state)}
    env.pop("ENGINE_CACHE", None)
    result = subprocess.run(
        ["bash", str(SCRIPT), "follow", "0"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    return result, out


def test_follow_packs_the_step_files_whose_names_the_way_back_refuses(tmp_path):
    root = tmp_path / "tree"
    raw = root / "results" / "s" / "raw" / "rung~1" / "a"
    raw.mkdir(parents=True)
    (raw / "manifest.json").write_text("{}")
    steps = root / "results" / "s" / "steps" / "m~vllm.csv"
    steps.parent.mkdir(parents=True)
    steps.write_text("arm,step_ms\nnone,5.3\n")
    result, out = _follow(tmp_path, root, done=True)
    assert result.returncode == 0, result.stderr
    # nothing under $OUT carries a "~": the step file travels inside steps.tar.gz, the raw files inside raw.tar.gz
    assert not [p for p in out.rglob("*") if "~" in p.name]
    with tarfile.open(out / "steps.tar.gz") as tar:
        assert tar.getnames() == ["results/s/steps/m~vllm.csv"]
        assert tar.extractfile("results/s/steps/m~vllm.csv").read() == steps.read_bytes()
    with tarfile.open(out / "raw.tar.gz") as tar:
        assert "results/s/raw/rung~1/a/manifest.json" in tar.getnames()
    assert (out / "progress.log").read_text().startswith("h200_background: piece")


def _kernel(folder: Path, name: str) -> None:
    (folder / "key").mkdir(parents=True)
    (folder / "key" / "kernel.so").write_bytes(b"\x7fELF" + name.encode())


def test_follow_brings_back_the_kernels_an_sglang_server_caches_and_not_torch_compiles(tmp_path):
    from wmtp.engines import sglang

    root = tmp_path / "tree"
    cache = "results/engines/sglang/cache"
    # Where an SGLang server of a cell keeps its kernels, its cache folder being the engine's.
    env = sglang.server_env({}, root / cache, tmp_path / "t")
    for variable in ("TRITON_CACHE_DIR", "TVM_FFI_CACHE_DIR"):
        _kernel(Path(env[variable]), variable)
    (root / cache / "torch_compile").mkdir()
    result, out = _follow(tmp_path, root, done=True, cache=cache)
    assert result.returncode == 0, result.stderr
    with tarfile.open(out / "compile-cache.tar.gz") as tar:
        names = tar.getnames()
        assert {name.split("/")[0] for name in names} == {"triton", "tvm-ffi"}
        assert tar.extractfile("tvm-ffi/key/kernel.so").read() == b"\x7fELFTVM_FFI_CACHE_DIR"


def test_follow_brings_back_triton_alone_where_no_sglang_kernel_was_built(tmp_path):
    root = tmp_path / "tree"
    _kernel(root / "results" / "engines" / "vllm" / "cache" / "triton", "triton")
    result, out = _follow(tmp_path, root, done=True)
    assert result.returncode == 0, result.stderr
    with tarfile.open(out / "compile-cache.tar.gz") as tar:
        assert {name.split("/")[0] for name in tar.getnames()} == {"triton"}


def test_follow_says_the_runs_go_on_and_brings_no_step_file_before_one_is_made(tmp_path):
    root = tmp_path / "tree"
    (root / "results" / "s" / "raw").mkdir(parents=True)
    result, out = _follow(tmp_path, root, done=False)
    assert result.returncode == 3, result.stderr
    assert not (out / "steps.tar.gz").exists() and (out / "load.txt").exists()


def test_start_empties_no_folder_but_one_of_earlier_runs(tmp_path):
    state = tmp_path / "mine"
    state.mkdir()
    (state / "precious.txt").write_text("not the runs'")
    env = {**os.environ, "WMTP_BACKGROUND_STATE": str(state)}
    result = subprocess.run(
        ["bash", str(SCRIPT), "start", "10", "config/studies/h200-vllm.yaml"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode != 0
    assert "holds files of no earlier runs" in result.stderr
    assert (state / "precious.txt").read_text() == "not the runs'"
