"""The GPU studies say what their sources say: each resolved exactly as Snakemake runs it, item by item.

``wmtp.config.load_study`` resolves a study file as ``--configfile`` hands it to Snakemake (the embedded default
is not merged in). The tables below are written by hand: the Spark study's from its Method section, the
Windowed-MTP paper's from the paper's public artifact (its B200 reproduction package), point by point; where the
paper's study cannot do what the artifact does, its file says so beside the value, and a test checks that it
does. The last test dry-runs the Spark profile in a copy of the working tree, as a fresh clone on a machine without
a GPU, a checkpoint or an engine.
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


# The Windowed-MTP paper's public artifact (its B200 reproduction package: scripts, configuration, README),
# written down point by point. Where the study cannot follow a point, the point is not here but in
# PAPER_DEVIATIONS: the study file states it beside the value, and the test below checks that it does.
YARN_4 = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144}
Q35, Q122, NEMOTRON = "qwen3.6-35b-a3b-nvfp4", "qwen3.5-122b-a10b-nvfp4", "nemotron-3-super-120b-a12b-nvfp4"
PAPER_PROTOCOL = {
    # Hardware and engine: one GPU, SGLang; FlashInfer for the target's attention.
    "server kind and device": ("sglang", "cuda"),
    "one GPU per server": True,
    "--attention-backend": "flashinfer",
    "--page-size": "1",
    "--kv-cache-dtype": "bfloat16",
    "--mem-fraction-static": "0.85",
    "--trust-remote-code": True,
    "SGLANG_ENABLE_SPEC_V2": "1",
    "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1",
    # The draft's attention: Triton in the windowed arm, FlashInfer in the native one.
    "draft attention backend": {"mtp": "flashinfer", "wmtp": "triton"},
    # Checkpoints: NVFP4 builds of two families (Gated DeltaNet MoE 35B and 122B, a Mamba2 hybrid 120B).
    "checkpoints": {
        Q35: "RedHatAI/Qwen3.6-35B-A3B-NVFP4",
        Q122: "nvidia/Qwen3.5-122B-A10B-NVFP4",
        NEMOTRON: "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-NVFP4",
    },
    "families": {Q35: "GDN", Q122: "GDN", NEMOTRON: "Mamba2"},
    # The Qwen models reach 1M by YaRN factor 4 written into a copy of their config; Nemotron is NoPE.
    "YaRN in the config": {Q35: YARN_4, Q122: YARN_4, NEMOTRON: None},
    # Recurrent-state memory and prefix cache: (strategy, --mamba-full-memory-ratio, radix cache off).
    "mamba settings": {
        Q35: ("extra_buffer", "0.1", False),
        Q122: ("extra_buffer", "0.1", False),
        NEMOTRON: ("no_buffer", "0", True),
    },
    # Geometry: d draft tokens a verify (d - 1 draft steps at top-k 1), d 7 the headline with d 3 and 5 beside.
    "d, draft steps, k": {(3, 2, 2), (5, 4, 4), (7, 6, 6)},
    "top-k": {"1"},
    "W": {"4032"},
    "S": {"64"},
    # The window is the only change between the two drafting arms' speculative flags.
    "window and sink on the draft only": True,
    "batch 1 and a batch sweep": (1, True),
    # Prompts of 1,040,000 tokens, in a context of 1,040,000 + 512 + 64.
    "prompt tokens": 1_040_000,
    "--context-length": {"1040576"},
    # Seeded synthetic RULER tasks: 48 keys all asked for, the top 30 words, common words.
    "RULER tasks": {"niah_multiquery", "fwe", "cwe"},
    "NIAH keys and queries": (48, 48),
    "FWE top words": 30,
    # One user message through the model's chat template, with the template's own defaults (None: raw text).
    "chat template arguments": {Q35: {}, Q122: {}, NEMOTRON: {}},
    # QA mode for every task: EOS honoured, at most 512 new tokens, penalty 1.15 on draft and target alike, greedy.
    "QA mode": {(False, 512, 1.15, 0.0)},
    # The statistic: TPOT × accept length from the scheduler's decode lines, logged at every step.
    "--decode-log-interval": "1",
    # One timed run per point after a tiny warm-up (one 64-token prompt, 8 new tokens).
    "timed runs at 1M": 1,
    "warm-up": (1, 64, 8),
}


def _paper_argv(study, cell) -> list[str]:
    engine, model = study.engine(cell.engine), study.model(cell.model)
    request = ServeRequest(
        python="python",
        model_dir=study.model_dir(model.name),
        served_name=model.name,
        port=8000,
        max_model_len=model.max_model_len,
        draft=cell,
        engine_args=tuple(engine.serve_args),
        model_args=tuple(model.serve_args),
        arm_args=tuple(study.arm_args(cell)),
    )
    return adapter(engine.kind).serve_argv(request)


def _speculative(argv: list[str]) -> list[str]:
    return argv[argv.index("--speculative-algorithm") :] if "--speculative-algorithm" in argv else []


def _qa_requests(study, tmp_path: Path) -> set[tuple]:
    """What a cell's client sends for each workload: (ignore_eos, max_tokens, repetition_penalty, temperature)."""
    from wmtp.measure import cell as cell_mod
    from wmtp.measure.client import Completion
    from wmtp.measure.tasks import PromptTask

    cell = next(c for c in study.cells() if c.arm == "wmtp")
    run = cell_mod.CellRun(study, cell, tmp_path, {}, tmp_path)
    sent: list[dict] = []

    def fake_complete(base_url, model, prompt, max_tokens, **kwargs):
        sent.append({"max_tokens": max_tokens, **kwargs})
        return Completion("answer", 1_040_000, 5, 0.1, 0.5, 0, 0.1, 0.5)

    class Meter:
        available = False

    engine = adapter("sglang")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cell_mod, "complete", fake_complete)
        # No server: its metrics read as none.
        patch.setattr(engine, "read_counters", lambda base_url: {})
        for workload in study.protocol.workloads:
            task = PromptTask("question", answer=("answer",))
            cell_mod._measure(
                run,
                Meter(),
                "http://s",
                cell.model,
                [task],
                workload,
                1_040_000,
                0,
                study.protocol.output_tokens,
                False,
                None,
                engine,
            )
    for request in sent:  # the counts a drafting SGLang response carries are asked for alongside
        assert request["extra_body"]["return_spec_tokens_details"] is True
        assert request["chat"] == {}
    return {(r["ignore_eos"], r["max_tokens"], r["extra_body"]["repetition_penalty"], r["temperature"]) for r in sent}


def _paper_resolved(tmp_path: Path) -> dict:
    """The paper study as the pipeline will run it, in the table's terms."""
    from wmtp.config import FWE_TOP, NIAH_KEYS, NIAH_QUERIES, RULER_WORKLOADS

    study = load_study(PAPER, base_dir=REPO)
    engine, protocol = study.engines[0], study.protocol
    cells = study.cells()
    argv = {c.cell_id: _paper_argv(study, c) for c in cells}
    drafting = [c for c in cells if c.arm in ("mtp", "wmtp")]
    windowed = [c for c in cells if c.arm == "wmtp"]
    every = [a for c in cells for a in argv[c.cell_id]]

    def values(flag: str, among=cells) -> set[str]:
        return {_flag(argv[c.cell_id], flag) for c in among}

    def one(flag: str) -> str:
        (value,) = values(flag)
        return value

    family = {"qwen": "GDN", "nemotron": "Mamba2"}
    natives = {(c.model, c.k, c.concurrency): argv[c.cell_id] for c in cells if c.arm == "mtp"}
    only_the_window = all(
        [a for a in _speculative(argv[c.cell_id]) if a not in ("triton", "flashinfer")]
        == [a for a in _speculative(natives[(c.model, c.k, c.concurrency)]) if a not in ("triton", "flashinfer")]
        + ["--speculative-draft-window-size", str(c.window), "--speculative-draft-sink-size", str(c.sink)]
        for c in windowed
    )
    mamba = {}
    for m in study.models:
        (cell,) = [c for c in cells if c.model == m.name and c.arm == "none" and c.concurrency == 1]
        args = argv[cell.cell_id]
        mamba[m.name] = (
            _flag(args, "--mamba-radix-cache-strategy"),
            _flag(args, "--mamba-full-memory-ratio"),
            "--disable-radix-cache" in args,
        )
    return {
        "server kind and device": (engine.kind, engine.device),
        "one GPU per server": not any(
            flag in every for flag in ("--tp", "--tp-size", "--tensor-parallel-size", "--dp", "--dp-size")
        ),
        "--attention-backend": one("--attention-backend"),
        "--page-size": one("--page-size"),
        "--kv-cache-dtype": one("--kv-cache-dtype"),
        "--mem-fraction-static": one("--mem-fraction-static"),
        "--trust-remote-code": all("--trust-remote-code" in argv[c.cell_id] for c in cells),
        "SGLANG_ENABLE_SPEC_V2": engine.env.get("SGLANG_ENABLE_SPEC_V2"),
        "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": engine.env.get("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"),
        "draft attention backend": {
            arm: one_of
            for arm in ("mtp", "wmtp")
            for (one_of,) in [values("--speculative-draft-attention-backend", [c for c in cells if c.arm == arm])]
        },
        "checkpoints": {m.name: m.hf_id for m in study.models},
        "families": {m.name: family[m.name.split("-")[0].rstrip("0123456789.")] for m in study.models},
        "YaRN in the config": {m.name: m.rope_scaling for m in study.models},
        "mamba settings": mamba,
        "d, draft steps, k": {
            (
                int(_flag(argv[c.cell_id], "--speculative-num-draft-tokens")),
                int(_flag(argv[c.cell_id], "--speculative-num-steps")),
                c.k,
            )
            for c in drafting
        },
        "top-k": values("--speculative-eagle-topk", drafting),
        "W": values("--speculative-draft-window-size", windowed),
        "S": values("--speculative-draft-sink-size", windowed),
        "window and sink on the draft only": only_the_window
        and not any("--speculative-draft-window-size" in argv[c.cell_id] for c in cells if c.arm != "wmtp"),
        "batch 1 and a batch sweep": (min(protocol.concurrency), any(c.concurrency > 1 for c in cells)),
        "prompt tokens": max(protocol.rungs),
        "--context-length": values("--context-length"),
        "RULER tasks": set(protocol.workloads) & set(RULER_WORKLOADS),
        "NIAH keys and queries": (NIAH_KEYS, NIAH_QUERIES),
        "FWE top words": FWE_TOP,
        "chat template arguments": {m.name: chat_settings(study, m.name) for m in study.models},
        "QA mode": _qa_requests(study, tmp_path),
        "--decode-log-interval": one("--decode-log-interval"),
        "timed runs at 1M": dict(zip(protocol.rungs, protocol.repeats, strict=True))[max(protocol.rungs)],
        "warm-up": (protocol.warmup_requests, protocol.warmup_prompt_tokens, protocol.warmup_output_tokens),
    }


@pytest.fixture(scope="module")
def paper_resolved(tmp_path_factory) -> dict:
    return _paper_resolved(tmp_path_factory.mktemp("paper"))


@pytest.mark.parametrize("item", list(PAPER_PROTOCOL))
def test_paper_study_follows_the_papers_artifact(item, paper_resolved):
    assert paper_resolved[item] == PAPER_PROTOCOL[item]


def test_paper_study_fits_its_longest_prompt_with_the_answer_and_a_draft():
    study = load_study(PAPER, base_dir=REPO)
    longest, answer = max(study.protocol.rungs), study.protocol.output_tokens
    depth = max(k for arm in study.arms for k in arm.k)
    for model in study.models:
        assert longest + answer + depth <= model.max_model_len == longest + answer + 64
        # YaRN's stretched length holds the context: 262,144 × 4.
        if model.rope_scaling:
            rope = model.rope_scaling
            assert rope["original_max_position_embeddings"] * rope["factor"] >= model.max_model_len


# Where the study cannot do what the artifact does: the line the value sits on, and words its comment must say.
PAPER_DEVIATIONS = {
    # The GPU is not a study value; the artifact's is a B200.
    "study: paper-1m": ("Deviation", "B200", "H200"),
    # The artifact's engine is a patched NVIDIA container; public SGLang's own draft window is used.
    'packages: ["sglang==0.5.21"]': ("Deviation", "container", "patch"),
    # Serve arguments are one list per engine: graphs are captured up to the sweep's largest batch.
    '- "--cuda-graph-max-bs-decode"': ("Deviation", "batch"),
    # The artifact's ring buffer exists only in this project's vLLM plugin.
    "- name: wmtp": ("Deviation", "ring", "vLLM"),
    # The artifact's deeper Triton pipeline for the draft's attention has no setting in public SGLang.
    'serve_args: ["--speculative-draft-attention-backend", "triton"]': ("Deviation", "pipeline"),
    # The tasks' text comes from this project's own generators.
    "workloads:": ("Deviation", "text", "cwe"),
    # The artifact's batch sweep ran on the 35B only.
    "concurrency:": ("Deviation", "35B"),
    # The artifact warms a batch and flushes the prefix cache.
    "warmup_requests:": ("Deviation", "flush"),
}


def _comment_above(text: str, anchor: str) -> str:
    """The comment lines right above the first line that starts with ``anchor``, as one string."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(anchor))
    block: list[str] = []
    for line in reversed(lines[:at]):
        if not line.strip().startswith("#"):
            break
        block.insert(0, line.strip().lstrip("#").strip())
    return " ".join(block)


@pytest.mark.parametrize("anchor", list(PAPER_DEVIATIONS))
def test_paper_study_states_each_deviation_beside_its_value(anchor):
    comment = _comment_above(PAPER.read_text(), anchor)
    for word in PAPER_DEVIATIONS[anchor]:
        assert word in comment, (anchor, word, comment)


def test_the_artifacts_reference_results_are_of_the_papers_study():
    """Each of the artifact's numbers names a model, task, arm, depth and rung the paper's study measures, so the
    report sets it beside that series and no other."""
    import pandas as pd

    study = load_study(PAPER, base_dir=REPO)
    published = pd.read_csv(REPO / "config" / "published" / "paper-1m.csv", keep_default_na=False)
    assert set(published["study"]) == {study.study} and set(published["source"]) == {"artifact README"}
    assert set(published["model"]) == {m.name for m in study.models}
    assert set(published["workload"]) <= set(study.protocol.workloads)
    assert set(published["rung"]) == {max(study.protocol.rungs)}
    ks = {k for arm in study.arms for k in arm.k}
    assert {int(k) for k in published["k"] if k != ""} == {6} <= ks
    assert set(published["arm"]) <= {arm.name for arm in study.arms}
    # The headline, d 7 on the needle task: the step native → windowed, and the step win their ratio, within the
    # point or so by which the artifact's single steps and the paper's fit over depths differ.
    headline = published[(published["workload"] == "niah_multiquery") & (published["quantity"] == "cycle_ms")]
    steps = headline.pivot(index="model", columns="arm", values="value")
    wins = published[(published["workload"] == "niah_multiquery") & (published["quantity"] == "cost_side_wedge_pct")]
    for model, win in wins.set_index("model")["value"].items():
        assert 100 * (steps.at[model, "mtp"] / steps.at[model, "wmtp"] - 1) == pytest.approx(win, abs=1.5)


def test_paper_study_states_how_its_k_is_the_artifacts_d():
    head = PAPER.read_text().split("\nstudy:")[0]
    assert "d = k + 1" in head and "d 7 is k 6" in head


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
