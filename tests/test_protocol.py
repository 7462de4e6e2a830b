"""The GPU studies say what their sources say: each resolved exactly as Snakemake runs it, item by item.

``wmtp.config.load_study`` resolves a study file as ``--configfile`` hands it to Snakemake (the embedded default
is not merged in). The tables below are written by hand: the Spark study's from its Method section, the
Windowed-MTP paper's from what the paper states; what the paper leaves open is listed in the study file's own
comments and not checked here. The last test dry-runs the Spark profile in a copy of the working tree, as a fresh
clone on a machine without a GPU, a checkpoint or an engine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from wmtp.config import load_study
from wmtp.engines import ServeRequest, adapter
from wmtp.layout import Draft
from wmtp.measure.workload import chat_settings

SPARK = REPO / "config" / "studies" / "spark-128k.yaml"
PAPER = REPO / "config" / "studies" / "paper-1m.yaml"

# The Spark study's Method, written down from its text.
SPARK_PROTOCOL = {
    "model": "unsloth/Qwen3.6-35B-A3B-NVFP4-Fast",
    "engine": ("vllm", "cuda", ["vllm==0.24.0"]),
    "--max-model-len": "262144",
    "--kv-cache-memory-bytes": "4294967296",
    "--gpu-memory-utilization": "0.85",
    "--max-num-seqs": "4",
    "--max-num-batched-tokens": "8192",
    "arms": [("none", []), ("mtp", [3])],
    "speculative config": {"method": "mtp", "num_speculative_tokens": 3},
    "rungs": [2040, 32779, 131290],
    "repeats": [6, 4, 5],
    "warm-up requests": 3,
    "output tokens": 256,
    "temperature": 0.0,
    "thinking": {"enable_thinking": False},
    "concurrency": [1],
    "workloads": ["code"],
    "counters": "vllm:spec_decode_",
}


def _spark_argv(study, arm: str, k: int) -> list[str]:
    engine, model = study.engines[0], study.models[0]
    request = ServeRequest(
        python="python",
        model_dir=model.path,
        served_name=model.name,
        port=8000,
        max_model_len=model.max_model_len,
        draft=Draft(arm=arm, k=k),
        engine_args=tuple(engine.serve_args),
        model_args=tuple(model.serve_args),
    )
    return adapter(engine.kind).serve_argv(request)


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def _spark_resolved() -> dict:
    """The Spark study as the pipeline will run it, in the table's terms."""
    study = load_study(SPARK, base_dir=REPO)
    engine, model, protocol = study.engines[0], study.models[0], study.protocol
    none = _spark_argv(study, "none", 0)
    mtp = _spark_argv(study, "mtp", 3)
    flags = [key for key in SPARK_PROTOCOL if key.startswith("--")]
    # Two servers, one variable between them: the mtp server's argv is the baseline's plus --speculative-config.
    assert mtp[: len(none)] == none and mtp[len(none)] == "--speculative-config" and len(mtp) == len(none) + 2
    from wmtp.engines import vllm

    return {
        "model": model.hf_id,
        "engine": (engine.kind, engine.device, engine.packages),
        **{flag: _flag(none, flag) for flag in flags},
        "arms": [(arm.name, arm.k) for arm in study.arms],
        "speculative config": json.loads(_flag(mtp, "--speculative-config")),
        "rungs": protocol.rungs,
        "repeats": protocol.repeats,
        "warm-up requests": protocol.warmup_requests,
        "output tokens": protocol.output_tokens,
        "temperature": protocol.temperature,
        "thinking": chat_settings(study, model.name),
        "concurrency": protocol.concurrency,
        "workloads": protocol.workloads,
        "counters": vllm.COUNTER_PREFIX,
    }


@pytest.mark.parametrize("item", list(SPARK_PROTOCOL))
def test_spark_study_matches_its_method(item):
    assert _spark_resolved()[item] == SPARK_PROTOCOL[item]


def test_spark_study_is_one_cell_per_arm_and_warms_up_short():
    study = load_study(SPARK, base_dir=REPO)
    assert [c.cell_id for c in study.cells()] == [
        "model~qwen3.6-35b-a3b-nvfp4/engine~vllm/arm~none/c~1",
        "model~qwen3.6-35b-a3b-nvfp4/engine~vllm/arm~mtp/k~3/c~1",
    ]
    # "three short requests": short beside the shortest rung.
    assert study.protocol.warmup_prompt_tokens < min(study.protocol.rungs) // 10
    # Pinned: the checkpoint is fetched at a commit, not a moving branch.
    assert re.fullmatch(r"[0-9a-f]{40}", study.models[0].revision or "")


# What the Windowed-MTP paper states, written down from its text.
PAPER_PROTOCOL = {
    "engine": ("sglang", "cuda"),
    "families": {"qwen3.6-35b-a3b": "GDN", "qwen3.5-122b-a10b-fp8": "GDN", "nemotron-3-super-120b-a12b-fp8": "Mamba2"},
    "sizes": ["35B", "122B", "120B"],
    # Native against windowed MTP, and no speculation: the paper says native MTP at 1M is slower than none.
    "arms": {"none", "mtp", "wmtp"},
    "window and sink on the draft only": True,
    "longest rung": 1048576,
    # Seeded synthetic RULER tasks in QA mode: at most 512 new tokens, repetition penalty 1.15.
    "RULER tasks": {"niah_multiquery", "fwe", "cwe"},
    "QA mode": (512, 1.15),
    "one GPU per cell": True,
    "batch sweep": True,
}


def _paper_resolved() -> dict:
    study = load_study(PAPER, base_dir=REPO)
    family = {"qwen": "GDN", "nemotron": "Mamba2"}
    wmtp = next(arm for arm in study.arms if arm.name == "wmtp")
    cells = study.cells()
    return {
        "engine": (study.engines[0].kind, study.engines[0].device),
        "families": {m.name: family[m.name.split("-")[0].rstrip("0123456789.")] for m in study.models},
        "sizes": [re.search(r"(\d+)B-A", m.hf_id or "").group(1) + "B" for m in study.models],
        "arms": {arm.name for arm in study.arms},
        # The windowed arm windows the draft (S, W given) and the engine's draft window is the only change.
        "window and sink on the draft only": bool(wmtp.sink and wmtp.window) and wmtp.k == study.arms[1].k,
        "longest rung": max(study.protocol.rungs),
        "RULER tasks": set(study.protocol.workloads),
        "QA mode": (study.protocol.output_tokens, study.protocol.repetition_penalty),
        # A cell is one server on one device: the study gives no tensor or data parallelism.
        "one GPU per cell": not any(
            flag in " ".join(study.engines[0].serve_args + m.serve_args)
            for m in study.models
            for flag in ("--tp", "--tensor-parallel-size", "--dp", "--data-parallel-size")
        ),
        "batch sweep": max(study.protocol.concurrency) > 1 and any(c.concurrency > 1 for c in cells),
    }


@pytest.mark.parametrize("item", list(PAPER_PROTOCOL))
def test_paper_study_matches_what_the_paper_states(item):
    assert _paper_resolved()[item] == PAPER_PROTOCOL[item]


def test_paper_study_lists_what_the_paper_leaves_open():
    head = PAPER.read_text().split("\nstudy:")[0]
    assert "What it leaves open" in head
    for choice in ("γ", "S and W", "rungs", "repeats", "batch sizes", "prompt format", "revisions"):
        assert choice in head, choice


def _fresh_copy(dest: Path) -> Path:
    """The working tree's tracked and unignored files (a fresh clone of it): no results, models or engines."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        src, dst = REPO / name, dest / name
        if not src.is_symlink() and not src.exists():
            continue  # deleted in the working tree
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, dst)
    return dest


@pytest.mark.timeout(300)
def test_spark_profile_dry_run_on_a_fresh_clone(tmp_path):
    clone = _fresh_copy(tmp_path / "clone")
    assert (clone / "spark").resolve() == (clone / "profiles" / "spark").resolve()
    assert not (clone / "models").exists() and not (clone / "results").exists()
    snakemake = Path(sys.executable).parent / "snakemake"
    # A placeholder token: the plan must not need (or print) one.
    env = {**os.environ, "HF_TOKEN": "hf_placeholder_not_a_token"}
    proc = subprocess.run(
        [str(snakemake), "--profile", "spark", "-j1", "-n"],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    table = dict(re.findall(r"^(\w+)\s+(\d+)$", out, flags=re.M))
    assert table.get("model") == "1" and table.get("engine") == "1" and table.get("cell") == "2", out[-3000:]
    assert "models/Qwen3.6-35B-A3B-NVFP4-Fast/wmtp-download.json" in out
    assert "--revision 11fb65d632976b5f00cb42f157562238cf0c71e0" in out
    assert "hf_placeholder" not in out
    assert not (clone / "models").exists()  # a dry run fetches nothing
