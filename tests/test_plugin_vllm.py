"""Windowed-MTP inside the real vLLM CPU build: lossless, read set, bound, acceptance.

Engine tests run the engine's own interpreter, the one ``make engine`` builds (fixture ``engine_python`` of
tests/conftest.py): without it they skip on a developer's machine and fail under ``CI=true``.

A server start costs 80–160 s on a 2-core box (three processes each import torch and vLLM), so the
file starts one server and runs everything else through vLLM's in-process engine (``LLM`` with the
engine core and worker in one interpreter: one import, ≈ 6 s per engine), each a module-scoped fixture
that finishes its requests and stops before the tests read its results:

- ``engines``: one interpreter, one engine per arm and window, sequentially: none and mtp on the
  random-weight model, wmtp at each (S, W) on it, wmtp on the all-zero lm_head model;
- ``server_run``: arm wmtp on the all-zero lm_head model as a real OpenAI server (API server,
  EngineCore and worker processes; counters from /metrics).

The plugin's test instruments (wmtp.plugin.testing, inert unless WMTP_PLUGIN_TEST_DIR is set) tag
records per request, record the block tables handed to the draft and its proposals, and poison KV
blocks for the read-set proof.

The random-weight model has its MTP layer's o_proj scaled ×30 so that the draft is attention-dominated
(docs/design.md): the target is untouched, so none's outputs are those of the plain random model, while the
draft's proposals react to what its attention reads.

Read-set proof used here: KV poisoning. Before every draft forward the draft layer's KV blocks outside
sink ∪ window are overwritten with large random values. The windowed draft's proposals stay identical
to an unpoisoned run, while a draft that reads the whole context (W beyond the context, i.e. mtp)
under the same poisoning changes its proposals: the poison is visible to any reader, and the windowed
draft reads none of it.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import build_tiny_model

from wmtp.plugin import hookpoints as hp
from wmtp.plugin import window as win

K = 3
MAX_TOKENS = 24
PROMPT_LENGTHS = (330, 700, 1100)  # > --max-num-batched-tokens from 700 on: prefill comes in chunks
CHUNK_TOKENS = 512
# (S, W): the design point, no sink, a window smaller than a KV block with a sink smaller than one,
# and a larger sink + window.
WINDOWS = ((16, 128), (0, 64), (4, 8), (130, 170))
WIDE_OPEN = (0, 1_000_000)  # W beyond every context: the wrapper hands the metadata through (= mtp)
POISON_LENGTH = 1100
EPS = 0.05
PENALTY = 1.15  # the Windowed-MTP artifact's repetition penalty
SERVER_TIMEOUT_S = 420
ENGINE_ARGS = [
    "--dtype",
    "bfloat16",
    "--enforce-eager",
    "--no-enable-prefix-caching",
    "--max-num-batched-tokens",
    str(CHUNK_TOKENS),
]
ACTIVE_LINE = "wmtp: windowed MTP draft active"


def _run_engine(python: str, code: str, timeout_s: float = 300, env: dict | None = None) -> str:
    out = subprocess.run(
        [python, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, f"engine script failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    return out.stdout


# --------------------------------------------------------------------------------------------------
# check_hook_points against fake vLLM source trees (no engine needed)

FAKE_PROPOSER = """
class SpecDecodeBaseProposer:
    def propose(self):
        self.build_per_group_and_layer_attn_metadata(cm)
        for i in range(3):
            self.build_per_group_and_layer_attn_metadata(cm, draft_index=i + 1)

    def build_per_group_and_layer_attn_metadata(self, common_attn_metadata, draft_index=0):
        pass
"""
FAKE_BACKEND = """
class CommonAttentionMetadata:
    query_start_loc: object
    seq_lens: object
    max_query_len: int
    max_seq_len: int
    block_table_tensor: object
    seq_lens_cpu_upper_bound: object = None
    dcp_local_seq_lens: object = None
    _num_computed_tokens_cache: object = None
"""


def _fake_vllm(root: Path, proposer: str = FAKE_PROPOSER, backend: str = FAKE_BACKEND) -> Path:
    pkg = root / "vllm"
    (pkg / "v1" / "spec_decode").mkdir(parents=True)
    (pkg / "v1" / "attention").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_version.py").write_text("__version__ = version = '9.9.9'\n")
    (pkg / "v1" / "spec_decode" / "llm_base_proposer.py").write_text(proposer)
    (pkg / "v1" / "attention" / "backend.py").write_text(backend)
    return root


def _check_fake(tmp_path, monkeypatch, **kwargs):
    from wmtp.engines.vllm_hooks import check_hook_points

    monkeypatch.syspath_prepend(str(_fake_vllm(tmp_path, **kwargs)))
    return check_hook_points()


def test_check_hook_points_accepts_the_expected_shape(tmp_path, monkeypatch):
    found = _check_fake(tmp_path, monkeypatch)
    assert found["vllm_version"] == "9.9.9"
    assert found["method_params"] == ["common_attn_metadata", "draft_index"]
    assert found["calls_in_propose"] == 2


@pytest.mark.parametrize(
    ("proposer", "backend", "message"),
    [
        (
            FAKE_PROPOSER.replace("SpecDecodeBaseProposer", "BaseProposer"),
            FAKE_BACKEND,
            "vLLM 9.9.9: vllm.v1.spec_decode.llm_base_proposer has no class SpecDecodeBaseProposer",
        ),
        (
            FAKE_PROPOSER.replace("def build_per_group_and_layer_attn_metadata", "def build_metadata"),
            FAKE_BACKEND,
            "vLLM 9.9.9: vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer has no method "
            "build_per_group_and_layer_attn_metadata",
        ),
        (
            FAKE_PROPOSER.replace("common_attn_metadata, draft_index=0", "cm, draft_index=0"),
            FAKE_BACKEND,
            "takes ['cm', 'draft_index']",
        ),
        (
            FAKE_PROPOSER,
            FAKE_BACKEND.replace("seq_lens_cpu_upper_bound", "seq_lens_cpu"),
            "vLLM 9.9.9: vllm.v1.attention.backend.CommonAttentionMetadata has no field seq_lens_cpu_upper_bound",
        ),
        (
            FAKE_PROPOSER,
            FAKE_BACKEND + "    draft_kv_lens: object = None\n",
            "CommonAttentionMetadata has fields ['draft_kv_lens'] that the wmtp plugin neither windows, keeps nor "
            "refuses",
        ),
    ],
)
def test_check_hook_points_names_what_is_missing(tmp_path, monkeypatch, proposer, backend, message):
    from wmtp.plugin.hookpoints import HookPointError

    with pytest.raises(HookPointError) as err:
        _check_fake(tmp_path, monkeypatch, proposer=proposer, backend=backend)
    assert message in str(err.value)


FAKE_V2_RUNNER = """
class GPUModelRunner:
    def __init__(self, vllm_config, device=None):
        self.started = True
"""


def test_model_runner_v2_refuses_a_wmtp_engine_and_serves_others(tmp_path, monkeypatch):
    """V2's speculators bypass the hooked proposer: a wmtp-configured V2 runner must not start."""
    import importlib

    import wmtp.plugin as plugin
    from wmtp.plugin.hookpoints import HookPointError

    root = _fake_vllm(tmp_path)
    gpu = root / "vllm" / "v1" / "worker" / "gpu"
    gpu.mkdir(parents=True)
    for package in (root / "vllm" / "v1" / "worker", gpu):
        (package / "__init__.py").write_text("")
    (gpu / "model_runner.py").write_text(FAKE_V2_RUNNER)
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(plugin, "_registered", False)
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    plugin.register()
    runner = importlib.import_module("vllm.v1.worker.gpu.model_runner").GPUModelRunner
    assert runner(SimpleNamespace(additional_config={})).started  # unconfigured: untouched
    with pytest.raises(HookPointError) as err:
        runner(SimpleNamespace(additional_config={"wmtp": {"sink": 16, "window": 128}}))
    assert str(err.value) == (
        "wmtp plugin: vLLM 9.9.9 runs Model Runner V2 (vllm.v1.worker.gpu.model_runner), whose speculators "
        "bypass SpecDecodeBaseProposer, so the draft would never be windowed; start the server with "
        "VLLM_USE_V2_MODEL_RUNNER=0 (the V1 runner)"
    )


def test_a_missing_engine_fails_under_ci_and_skips_otherwise(tmp_path, monkeypatch):
    from conftest import find_engine_python

    monkeypatch.setenv("WMTP_ENGINES_DIR", str(tmp_path / "no-engines"))
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="make engine"):
        find_engine_python()
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception, match="make engine"):
        find_engine_python()


def test_an_engine_that_runs_another_checkouts_plugin_fails(tmp_path, monkeypatch):
    """A stand-in engine whose wmtp lives elsewhere: its results would not test this checkout's code."""
    from conftest import find_engine_python

    other = tmp_path / "other" / "wmtp"
    (other / "engines").mkdir(parents=True)
    (other / "__init__.py").write_text("")
    (other / "engines" / "__init__.py").write_text("")
    (other / "engines" / "vllm_hooks.py").write_text("def check_hook_points():\n    return {}\n")
    engine = tmp_path / "engines" / "vllm-cpu"
    (engine / "venv" / "bin").mkdir(parents=True)
    (engine / "manifest.json").write_text("{}")
    python = engine / "venv" / "bin" / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={other.parent} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    monkeypatch.setenv("WMTP_ENGINES_DIR", str(tmp_path / "engines"))
    with pytest.raises(pytest.fail.Exception, match=r"not .*src/wmtp"):
        find_engine_python()


# --------------------------------------------------------------------------------------------------
# Inside the engine interpreter, without a server

IN_ENGINE = r"""
import dataclasses, importlib, json, random, sys, time, types
started = time.monotonic()
import wmtp.plugin as plugin
from wmtp.plugin import hookpoints as hp, window as win

# register() is idempotent and patches the class when its module is first imported.
plugin.register(); plugin.register()
assert sum(getattr(f, "wmtp_import_hook", False) for f in sys.meta_path) == 1
assert hp.PROPOSER_MODULE not in sys.modules
module = importlib.import_module(hp.PROPOSER_MODULE)
cls = module.SpecDecodeBaseProposer
method = getattr(cls, hp.BUILD_METHOD)
original = method.__wmtp_original__
assert not hasattr(original, "__wmtp_original__")
assert cls.__init__.__wmtp_original__ is not None
plugin._registered = False
plugin.register()  # a second registration in the same process (module already imported)
assert getattr(cls, hp.BUILD_METHOD) is method

from wmtp.engines.vllm_hooks import check_hook_points
deep = check_hook_points(deep=True)
assert deep["patched"], deep

# The tensor implementation against the integer reference, on random batches.
import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from wmtp.plugin.hook import window_metadata
rng = random.Random(0)
checked = 0
for trial in range(300):
    block = rng.choice([16, 128, 256])
    sink, window = rng.choice([0, 4, 16, 300]), rng.choice([1, 8, 128, 700])
    rows = rng.randint(1, 6)
    qlens = [rng.choice([1, 4, rng.randint(1, 900)]) for _ in range(rows)]
    seqs = [q + rng.randint(0, 6000) for q in qlens]
    if trial % 7 == 0:
        seqs[0] = 0; qlens[0] = 0  # a padding row
    cols = max(-(-s // block) for s in seqs) + rng.randint(0, 3)
    table = torch.randint(0, 100000, (rows + rng.randint(0, 2), max(cols, 1)), dtype=torch.int32)
    qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0).tolist()), dtype=torch.int32)
    seq_t = torch.tensor(seqs, dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_t, num_reqs=rows,
        num_actual_tokens=int(qsl[-1]), max_query_len=max(qlens), max_seq_len=max(seqs) + 5,
        block_table_tensor=table, slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq_t.clone() + 2)
    before = {f.name: (v.clone() if isinstance(v := getattr(cm, f.name), torch.Tensor) else v)
              for f in dataclasses.fields(cm)}
    config = win.WindowConfig(sink, window)
    out = window_metadata(cm, config, block)
    for name, value in before.items():  # the shared metadata is never mutated
        now = getattr(cm, name)
        assert (torch.equal(now, value) if isinstance(value, torch.Tensor) else now == value), name
    if not win.needs_window(cm.max_seq_len, sink, window):
        assert out is cm
        continue
    assert out is not cm
    for name in ("seq_lens", "block_table_tensor", "seq_lens_cpu_upper_bound"):
        assert getattr(out, name).data_ptr() != getattr(cm, name).data_ptr(), name
    assert out.slot_mapping is cm.slot_mapping and out.query_start_loc is cm.query_start_loc
    assert out._num_computed_tokens_cache is None
    assert out.block_table_tensor.dtype == torch.int32
    bound = win.seq_len_bound(max(qlens), sink, window, block)
    assert out.max_seq_len == min(cm.max_seq_len, bound)
    assert out.block_table_tensor.shape[1] <= win.table_width_bound(max(qlens), sink, window, block)
    expected = [win.windowed_seq_len(seqs[r], qlens[r], sink, window, block) for r in range(rows)]
    for r in range(rows):
        assert int(out.seq_lens[r]) == expected[r], (r, seqs[r], qlens[r], sink, window, block)
        kept = win.kept_blocks(seqs[r], qlens[r], sink, window, block)
        assert out.block_table_tensor[r, :len(kept)].tolist() == table[r, kept].tolist()
        checked += 1
    # Every field, device and host copies: windowed ones consistent with the windowed lengths, kept ones
    # the very same objects, refused ones unset.
    for f in dataclasses.fields(out):
        value = getattr(out, f.name)
        if f.name in hp.KEPT_FIELDS:
            assert value is getattr(cm, f.name), f.name
        elif f.name in hp.REFUSED_FIELDS:
            assert value is None, f.name
        elif f.name == "seq_lens":
            assert value.device == cm.seq_lens.device and value.dtype == cm.seq_lens.dtype
        elif f.name == "seq_lens_cpu_upper_bound":
            assert value.device.type == "cpu"
            assert all(expected[r] <= int(value[r]) <= bound for r in range(rows)), f.name
        elif f.name == "max_seq_len":
            assert max(expected) <= value <= bound
        elif f.name == "_num_computed_tokens_cache":
            derived = out.compute_num_computed_tokens().tolist()
            assert derived == [e - q for e, q in zip(expected, qlens)], f.name
        elif f.name == "block_table_tensor":
            assert value.shape[0] == table.shape[0]
        else:
            raise AssertionError(f"field {f.name} of CommonAttentionMetadata is not checked here")
fields_seen = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
assert not hp.unclassified_fields(fields_seen), hp.unclassified_fields(fields_seen)
# Length-like names must be windowed or refused, never silently kept (encoder lengths are another cache's).
for name in fields_seen:
    if any(word in name for word in ("seq_len", "num_computed", "context")) and "encoder" not in name:
        assert name in hp.WINDOWED_FIELDS + hp.REFUSED_FIELDS, name
# A metadata object with a refused field set is not windowed (each refused field this vLLM has).
refused = []
present = [name for name in hp.REFUSED_FIELDS if name in fields_seen]
for name in present:
    seq_t = torch.tensor([5000], dtype=torch.int32)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq_t, num_reqs=1, num_actual_tokens=1,
        max_query_len=1, max_seq_len=5000, block_table_tensor=torch.zeros((1, 40), dtype=torch.int32),
        slot_mapping=torch.zeros(1, dtype=torch.int64),
        **{name: {0: [(0, 1)]} if name == "mm_req_doc_ranges" else seq_t})
    try:
        window_metadata(cm, win.WindowConfig(16, 128), 128)
    except NotImplementedError as err:
        assert name in str(err), err
        refused.append(name)
assert refused == present and present, refused

# A decode cycle, as propose() runs it: the first forward sets the window, the later ones (cm mutated in place:
# rejected drafts taken back, then one query token a forward) keep its table and drop the same blocks.
from wmtp.plugin import hook
from wmtp.plugin import stats as wstats
anchored_rows = 0
for trial in range(200):
    block = rng.choice([16, 128, 256])
    sink, window = rng.choice([0, 16, 300]), rng.choice([8, 128, 700])
    k, rows = rng.choice([2, 3, 5]), rng.randint(1, 4)
    q0 = k + 1
    seqs = [q0 + rng.randint(0, 6000) for _ in range(rows)]
    table = torch.randint(0, 100000, (rows, max(-(-(s + k) // block) for s in seqs) + 1), dtype=torch.int32)
    qsl = torch.arange(0, (rows + 1) * q0, q0, dtype=torch.int32)
    seq_t = torch.tensor(seqs, dtype=torch.int32)
    cm = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_t, num_reqs=rows,
        num_actual_tokens=rows * q0, max_query_len=q0, max_seq_len=max(seqs), block_table_tensor=table,
        slot_mapping=torch.zeros(rows * q0, dtype=torch.int64), seq_lens_cpu_upper_bound=seq_t.clone())
    config = win.WindowConfig(sink, window)
    state = hook._State(config, wstats.DraftStats(sink, window, "test"), k)
    first, dropped, reused = hook.window_forward(state, cm, config, block, 0)
    assert not reused
    if dropped is None:
        continue
    drops = [win.dropped_blocks(s, q0, sink, window, block) for s in seqs]
    assert dropped.tolist() == drops
    assert first.block_table_tensor.shape[1] == min(table.shape[1], win.anchored_table_width(sink, window, block, k))
    cm.seq_lens -= torch.tensor([rng.randint(0, k) for _ in range(rows)], dtype=torch.int32)
    cm.max_query_len, cm.num_actual_tokens = 1, rows
    cm.query_start_loc = torch.arange(rows + 1, dtype=torch.int32)
    for step in range(1, k):
        cm.seq_lens += 1
        cm.seq_lens_cpu_upper_bound += 1
        cm.max_seq_len += 1
        out, again, reused = hook.window_forward(state, cm, config, block, step)
        assert reused and again is dropped and out.block_table_tensor is first.block_table_tensor
        now = cm.seq_lens.tolist()
        for r in range(rows):
            assert int(out.seq_lens[r]) == now[r] - block * drops[r]
            kept = win.kept_blocks_after(now[r], drops[r], sink, block)
            assert out.block_table_tensor[r, :len(kept)].tolist() == table[r, kept].tolist()
            assert int(out.seq_lens[r]) <= int(out.seq_lens_cpu_upper_bound[r])
            anchored_rows += 1
        assert max(out.seq_lens.tolist()) <= out.max_seq_len
        assert out.max_seq_len <= win.seq_len_bound(q0, sink, window, block, later=step)
    # The next cycle's block table is another tensor: a later forward with it windows on its own.
    next_cycle = dataclasses.replace(cm, block_table_tensor=table.clone())
    _, _, reused = hook.window_forward(state, next_cycle, config, block, 1)
    assert not reused

# A vLLM without the hook point: a configured proposer refuses to start, naming what is missing.
from wmtp.plugin.hookpoints import HookPointError
fake = types.ModuleType(hp.PROPOSER_MODULE)
class SpecDecodeBaseProposer:
    def __init__(self, vllm_config, device=None):
        self.vllm_config = vllm_config
fake.SpecDecodeBaseProposer = SpecDecodeBaseProposer
hook.patch(fake)
plain = types.SimpleNamespace(additional_config={}, parallel_config=types.SimpleNamespace())
assert getattr(SpecDecodeBaseProposer(plain), hook.STATE_ATTR) is None  # unconfigured: no-op
asked = types.SimpleNamespace(additional_config={"wmtp": {"sink": 16, "window": 128}},
                              parallel_config=types.SimpleNamespace())
try:
    SpecDecodeBaseProposer(asked)
    raise SystemExit("a configured proposer started without its hook point")
except HookPointError as err:
    refusal = str(err)
print(json.dumps({"checked_rows": checked, "anchored_rows": anchored_rows, "refusal": refusal, "deep": deep,
                  "seconds": time.monotonic() - started}))
"""


@pytest.mark.engine
def test_plugin_inside_the_engine(engine_python):
    """register() idempotent, import-hook patching, tensor math = reference, no mutation, refusal."""
    result = json.loads(_run_engine(engine_python, IN_ENGINE).strip().splitlines()[-1])
    assert result["checked_rows"] > 300 and result["anchored_rows"] > 300
    assert "build_per_group_and_layer_attn_metadata" in result["refusal"]
    assert f"vLLM {result['deep']['vllm_version']}" in result["refusal"]


# --------------------------------------------------------------------------------------------------
# Models


@pytest.fixture(scope="module")
def zero_model(engine_python, work) -> Path:
    return build_tiny_model(engine_python, work / "tiny-zero", "--zero-lm-head")


def _prompts() -> dict[int, list[int]]:
    rng = random.Random(3)
    return {n: [rng.randint(1, 4095) for _ in range(n)] for n in PROMPT_LENGTHS}


# --------------------------------------------------------------------------------------------------
# The in-process engines: every arm and window, one engine interpreter


DRIVER = r"""
import gc, json, os, sys, time
spec = json.load(open(sys.argv[1]))
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and worker in this process
from vllm import LLM, SamplingParams
from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

test_dir = os.environ["WMTP_PLUGIN_TEST_DIR"]
def params(penalty):
    return SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, logprobs=2,
                          repetition_penalty=penalty)
results, timings = [], {}
NAMES = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
         "vllm:spec_decode_num_accepted_tokens": "accepted"}

def control(tag, window=None, poison=None, region=None, skip_window=False):
    body = {"tag": tag, "skip_window": skip_window}
    if window:
        body.update(sink=window[0], window=window[1])
    if poison:
        body["poison"] = {"sink": poison[0], "window": poison[1], "region": region or "outside"}
    tmp = os.path.join(test_dir, "control.json.tmp")
    with open(tmp, "w") as out:
        json.dump(body, out)
    os.replace(tmp, os.path.join(test_dir, "control.json"))

def counters(llm):
    out = {}
    for metric in llm.get_metrics():
        name = metric.name.removesuffix("_total")
        if name in NAMES:
            out[NAMES[name]] = out.get(NAMES[name], 0) + metric.value
        elif name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            for pos, value in enumerate(metric.values):
                out[f"accepted_pos_{pos}"] = out.get(f"accepted_pos_{pos}", 0) + value
    return out

for engine in spec["engines"]:
    started = time.monotonic()
    os.environ["WMTP_PLUGIN_STATS_DIR"] = engine["stats_dir"]  # read when the proposer starts
    kwargs = {}
    if engine["arm"] != "none":
        kwargs["speculative_config"] = {"method": "mtp", "num_speculative_tokens": spec["k"]}
    if engine["arm"] == "wmtp":
        sink, window = engine["window"]
        kwargs["additional_config"] = {"wmtp": {"sink": sink, "window": window, "ring": engine.get("ring", False)}}
    try:
        llm = LLM(model=engine["model"], dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False,
                  max_model_len=4096, max_num_batched_tokens=spec["chunk"], distributed_executor_backend="uni",
                  disable_log_stats=False, seed=0, **kwargs)
    except Exception as err:
        if not engine.get("expect_error"):
            raise
        timings[engine["name"]] = {"error": f"{type(err).__name__}: {err}"}
        gc.collect()
        cleanup_dist_env_and_memory()
        continue
    assert not engine.get("expect_error"), engine["name"] + " started"
    timings[engine["name"]] = {"init_s": time.monotonic() - started}
    started = time.monotonic()
    for request in engine["requests"]:
        control(request["tag"], request.get("window"), request.get("poison"), request.get("region"),
                request.get("skip_window", False))
        before = counters(llm)
        out = llm.generate([{"prompt_token_ids": spec["prompts"][str(request["length"])]}],
                           params(request.get("repetition_penalty", 1.0)), use_tqdm=False)[0].outputs[0]
        after = counters(llm)
        gaps = []
        for top in out.logprobs:
            values = sorted((lp.logprob for lp in top.values()), reverse=True)
            gaps.append(values[0] - values[1] if len(values) > 1 else float("inf"))
        results.append({"engine": engine["name"], "tag": request["tag"], "length": request["length"],
                        "ids": list(out.token_ids), "gaps": gaps,
                        "counters": {key: after.get(key, 0) - before.get(key, 0) for key in after}})
    timings[engine["name"]]["requests_s"] = time.monotonic() - started
    control("idle")
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
json.dump({"results": results, "timings": timings}, open(sys.argv[2], "w"))
"""


def _engines(random_model: Path, zero_model: Path) -> list[dict]:
    every = [{"length": n} for n in PROMPT_LENGTHS]
    # The paper's protocol penalises repetition in the draft and the target alike.
    penalised = [{"length": n, "tag": f"penalty {n}", "repetition_penalty": PENALTY} for n in PROMPT_LENGTHS[1:]]
    engines = [
        {
            "name": "none",
            "arm": "none",
            "model": str(random_model),
            "requests": [{**r, "tag": f"none {r['length']}"} for r in every] + penalised,
        },
        {
            "name": "mtp",
            "arm": "mtp",
            "model": str(random_model),
            "requests": [{**r, "tag": f"mtp {r['length']}"} for r in every] + penalised,
        },
    ]
    for window in WINDOWS:
        requests = [{**r, "tag": f"lossless {window} {r['length']}"} for r in every]
        if window == WINDOWS[0]:
            requests += penalised
            # Read set: the same request clean and poisoned outside sink ∪ window of the design
            # point, read through that window and through a window wider than the context (= mtp).
            for read in (window, WIDE_OPEN):
                for poisoned in (False, True):
                    requests.append(
                        {
                            "length": POISON_LENGTH,
                            "tag": f"readset {read} {poisoned}",
                            "window": read,
                            "poison": window if poisoned else None,
                        }
                    )
            # And the other way: poison only inside the sink, or only inside the window; the draft reads it.
            for region in ("sink", "window"):
                requests.append(
                    {
                        "length": POISON_LENGTH,
                        "tag": f"readset {window} {region}",
                        "window": window,
                        "poison": window,
                        "region": region,
                    }
                )
        engines.append(
            {
                "name": f"wmtp {window}",
                "arm": "wmtp",
                "window": window,
                "model": str(random_model),
                "requests": requests,
            }
        )
    # The ring gives the draft's blocks behind the window back to the pool, which hands them to the next allocation
    # (the target's, as the prefill's chunks go on): its read set under the same poison.
    engines.append(
        {
            "name": "ring",
            "arm": "wmtp",
            "ring": True,
            "window": WINDOWS[0],
            "model": str(random_model),
            "requests": [
                {"length": POISON_LENGTH, "tag": f"ring readset {poisoned}", "window": WINDOWS[0], "poison": poison}
                for poisoned, poison in ((False, None), (True, WINDOWS[0]))
            ],
        }
    )
    for window in WINDOWS[:2]:
        engines.append(
            {
                "name": f"zero {window}",
                "arm": "wmtp",
                "window": window,
                "model": str(zero_model),
                "requests": [{"length": n, "tag": f"zero {window} {n}"} for n in PROMPT_LENGTHS[1:]],
            }
        )
    # A hook that does nothing (the test switch hands the metadata through): the cell's check must fail it.
    engines.append(
        {
            "name": "off",
            "arm": "wmtp",
            "window": WINDOWS[0],
            "model": str(zero_model),
            "requests": [{"length": POISON_LENGTH, "tag": "off", "skip_window": True}],
        }
    )
    # Last: a configuration the plugin refuses at start-up (a window of no tokens).
    engines.append(
        {
            "name": "refused",
            "arm": "wmtp",
            "window": (WINDOWS[0][0], 0),
            "model": str(zero_model),
            "requests": [],
            "expect_error": True,
        }
    )
    return engines


def _read_records(path: Path) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            out.setdefault(entry.get("tag") or "", []).append(entry)
    return out


@pytest.fixture(scope="module")
def engines(engine_python, random_model, zero_model, work, engine_env) -> dict:
    """Every arm and window through the real engine, in one interpreter (one import of vLLM)."""
    test_dir = work / "in-process"
    test_dir.mkdir()
    spec = {
        "k": K,
        "max_tokens": MAX_TOKENS,
        "chunk": CHUNK_TOKENS,
        "prompts": {str(n): p for n, p in _prompts().items()},
        "engines": _engines(random_model, zero_model),
    }
    for i, engine in enumerate(spec["engines"]):
        engine["stats_dir"] = str(test_dir / "stats" / str(i))
    (test_dir / "spec.json").write_text(json.dumps(spec))
    env = {
        **os.environ,
        **engine_env,
        "WMTP_PLUGIN_TEST_DIR": str(test_dir),
        # One thread, as vLLM's CPU worker sets itself in a server; spinning OpenMP threads on a
        # busy 2-core box slow the in-process engine several-fold.
        "OMP_NUM_THREADS": "1",
    }
    log = test_dir / "driver.log"
    with log.open("w") as out:
        proc = subprocess.run(
            [engine_python, "-c", DRIVER, str(test_dir / "spec.json"), str(test_dir / "out.json")],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=900,
            check=False,
        )
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, f"in-process engines failed ({proc.returncode}):\n{text[-5000:]}"
    done = json.loads((test_dir / "out.json").read_text())
    outputs = {(r["engine"], r["tag"]): r for r in done["results"]}
    return {
        "outputs": outputs,
        "records": _read_records(test_dir / "records.jsonl"),
        "log": text,
        "timings": done["timings"],
        "stats_dirs": {engine["name"]: engine["stats_dir"] for engine in spec["engines"]},
    }


# --------------------------------------------------------------------------------------------------
# The real server: API server, EngineCore and worker processes, /metrics


@pytest.fixture(scope="module")
def server_run(engine_python, zero_model, work, engine_env, engines) -> dict:
    """Arm wmtp on the all-zero lm_head model as a real OpenAI server; stopped before the tests read."""
    from wmtp.engines import ServeRequest
    from wmtp.engines import vllm as adapter
    from wmtp.layout import Draft
    from wmtp.measure.client import complete
    from wmtp.measure.counters import delta
    from wmtp.measure.server import ServerProcess, free_port, group_alive

    run_dir = work / "server"
    run_dir.mkdir()
    port = free_port()
    sink, window = WINDOWS[0]
    argv = adapter.serve_argv(
        ServeRequest(
            engine_python,
            zero_model,
            "tiny",
            port,
            max_model_len=4096,
            draft=Draft(arm="wmtp", k=K, sink=sink, window=window),
            engine_args=ENGINE_ARGS,
        )
    )
    env = {**engine_env, "WMTP_PLUGIN_TEST_DIR": str(run_dir), "WMTP_PLUGIN_STATS_DIR": str(run_dir / "stats")}
    server = ServerProcess(argv, env, run_dir / "server.log", f"http://127.0.0.1:{port}")
    prompts = _prompts()
    outputs, deltas = {}, {}
    started = time.monotonic()
    try:
        server.start()
        healthy_s = server.wait_healthy(SERVER_TIMEOUT_S)
        for n in PROMPT_LENGTHS[1:]:
            before = adapter.read_counters(server.base_url)
            outputs[n] = complete(server.base_url, "tiny", prompts[n], MAX_TOKENS, logprobs=2)  # type: ignore[arg-type]
            deltas[n] = delta(before, adapter.read_counters(server.base_url))
    finally:
        pgid = server.pid
        server.stop()
    deadline = time.monotonic() + 20  # SIGKILLed workers take a moment to be reaped
    while pgid is not None and group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    # The cell's own check, as run_cell calls it after the sweep.
    cell = SimpleNamespace(arm="wmtp", sink=sink, window=window, k=K)
    verified = adapter.VLLMAdapter().verify_cell(run_dir, env, cell, SimpleNamespace(rungs=PROMPT_LENGTHS[1:]))
    return {
        "verified": verified,
        "outputs": outputs,
        "deltas": deltas,
        "records": _read_records(run_dir / "records.jsonl"),
        "log": (run_dir / "server.log").read_text(errors="replace"),
        "pgid": pgid,
        "timings": {"healthy_s": healthy_s, "total_s": time.monotonic() - started},
    }


# --------------------------------------------------------------------------------------------------
# 1. Lossless


def _assert_equal_up_to_numerics(reference: dict, other: dict, what: str) -> None:
    from wmtp.analyze.equality import equal_up_to_numerics

    assert len(other["ids"]) == MAX_TOKENS, what
    verdict = equal_up_to_numerics(reference["ids"], reference["gaps"], other["ids"], eps=EPS)
    assert verdict.equal, f"{what}: {verdict.reason}"
    print(f"{what}: {verdict.reason}", file=sys.stderr)


@pytest.mark.engine
def test_mtp_equals_none(engines):
    out = engines["outputs"]
    for n in PROMPT_LENGTHS:
        _assert_equal_up_to_numerics(out[("none", f"none {n}")], out[("mtp", f"mtp {n}")], f"mtp vs none at {n}")


@pytest.mark.engine
@pytest.mark.parametrize("window", WINDOWS, ids=[f"S{s}-W{w}" for s, w in WINDOWS])
def test_wmtp_equals_none_and_mtp(engines, window):
    out = engines["outputs"]
    for n in PROMPT_LENGTHS:
        assert n > window[0] + window[1]
        mine = out[(f"wmtp {window}", f"lossless {window} {n}")]
        _assert_equal_up_to_numerics(out[("none", f"none {n}")], mine, f"wmtp {window} vs none at {n}")
        _assert_equal_up_to_numerics(out[("mtp", f"mtp {n}")], mine, f"wmtp {window} vs mtp at {n}")


@pytest.mark.engine
def test_wmtp_equals_mtp_and_none_under_a_repetition_penalty(engines):
    """With the paper's repetition penalty on every request the window still leaves the output as it was."""
    out = engines["outputs"]
    changed = 0
    for n in PROMPT_LENGTHS[1:]:
        none, mtp = out[("none", f"penalty {n}")], out[("mtp", f"penalty {n}")]
        mine = out[(f"wmtp {WINDOWS[0]}", f"penalty {n}")]
        changed += none["ids"] != out[("none", f"none {n}")]["ids"]
        _assert_equal_up_to_numerics(none, mtp, f"mtp vs none at {n}, penalty {PENALTY}")
        _assert_equal_up_to_numerics(none, mine, f"wmtp {WINDOWS[0]} vs none at {n}, penalty {PENALTY}")
        _assert_equal_up_to_numerics(mtp, mine, f"wmtp {WINDOWS[0]} vs mtp at {n}, penalty {PENALTY}")
    assert changed, f"a penalty of {PENALTY} changed no output: the engine did not apply it"


@pytest.mark.engine
def test_wide_open_window_is_mtp(engines):
    """W beyond the context: the wrapper passes the metadata through, the output is mtp's exactly."""
    out = engines["outputs"][(f"wmtp {WINDOWS[0]}", f"readset {WIDE_OPEN} False")]
    assert out["ids"] == engines["outputs"][("mtp", f"mtp {POISON_LENGTH}")]["ids"]
    builds = [e for e in engines["records"][f"readset {WIDE_OPEN} False"] if e["kind"] == "build"]
    assert builds and all(e["windowed_seq_lens"] == e["seq_lens"] for e in builds)


@pytest.mark.engine
def test_zero_lm_head_outputs_are_identical(engines, server_run):
    # Every logit is 0, so the greedy choice is token 0 at every step: none's and mtp's output by
    # construction, and what wmtp must produce in process and in the server.
    zero = [r for (name, _), r in engines["outputs"].items() if name.startswith("zero")]
    assert len(zero) == 2 * len(PROMPT_LENGTHS[1:])
    for result in zero:
        assert result["ids"] == [0] * MAX_TOKENS, result["tag"]
    for n, completion in server_run["outputs"].items():
        assert completion.token_ids == [0] * MAX_TOKENS, n


# --------------------------------------------------------------------------------------------------
# 2. Read set


def _proposals(records: list[dict]) -> list[list[int]]:
    return [row for entry in records if entry["kind"] == "propose" for row in entry["draft"]]


@pytest.mark.engine
def test_windowed_draft_reads_nothing_outside_sink_and_window(engines):
    records, outputs, design = engines["records"], engines["outputs"], WINDOWS[0]

    def run(read, poisoned):
        tag = f"readset {read} {poisoned}"
        entries = records[tag]
        return (
            _proposals(entries),
            [e for e in entries if e["kind"] == "poison"],
            outputs[(f"wmtp {design}", tag)]["ids"],
        )

    clean, _, clean_out = run(design, False)
    dirty, poisons, dirty_out = run(design, True)
    open_clean, _, open_clean_out = run(WIDE_OPEN, False)
    open_dirty, open_poisons, open_dirty_out = run(WIDE_OPEN, True)
    assert poisons and open_poisons, "nothing was poisoned: the context never outgrew the window"
    # Same prompt and target: identical draft inputs, so any change comes from what attention read.
    assert len(clean) == len(dirty) > 0
    assert clean == dirty, "the windowed draft changed when KV outside sink ∪ window was poisoned"
    changed = sum(a != b for a, b in zip(open_clean, open_dirty, strict=False))
    assert changed > len(open_clean) // 2, f"poison invisible to a full-context draft ({changed} changed)"
    # The target never reads the draft layer's KV: the output ignores the poison.
    assert clean_out == dirty_out and open_clean_out == open_dirty_out
    # With o_proj ×30 the window changes most proposals against the full-context draft.
    differ = sum(a != b for a, b in zip(clean, open_clean, strict=False))
    assert differ > len(clean) // 2, f"windowed proposals differ from mtp's in only {differ}/{len(clean)}"
    print(
        f"read set: {len(clean)} proposals; poisoned outside sink ∪ window: 0 changed (windowed), "
        f"{changed}/{len(open_clean)} changed (full context); windowed vs full: {differ} differ",
        file=sys.stderr,
    )


@pytest.mark.engine
def test_the_ring_draft_reads_none_of_the_blocks_it_gave_back(engines):
    """Poison outside sink ∪ window under the ring: what it gave back and nobody holds is poisoned and unread; what
    the pool already handed to another owner (the worker's block table still names it) is spared, or the poison
    would land in that owner's KV."""
    records, outputs, design = engines["records"], engines["outputs"], WINDOWS[0]
    clean = _proposals(records["ring readset False"])
    dirty = _proposals(records["ring readset True"])
    poisons = [e for e in records["ring readset True"] if e["kind"] == "poison"]
    frees = [e for e in records["ring readset True"] if e["kind"] == "free"]
    assert frees, "the ring gave nothing back"
    poisoned, spared, free = (sum(e[key] for e in poisons) for key in ("slots", "spared", "free"))
    # Poison where a draft reading a given-back block would meet it, and the pool's reuse seen and spared.
    assert free > 0 and spared > 0, (poisoned, spared, free)
    assert len(clean) == len(dirty) > 0 and clean == dirty, "the ring's draft read a block it gave back"
    assert outputs[("ring", "ring readset True")]["ids"] == outputs[("ring", "ring readset False")]["ids"]
    # The same read set as wmtp's at the design point: the same proposals.
    assert clean == _proposals(records[f"readset {design} False"])
    print(
        f"ring read set: {poisoned} slots poisoned ({free} in free blocks), {spared} spared, {len(clean)} proposals",
        file=sys.stderr,
    )


@pytest.mark.engine
def test_windowed_draft_reads_its_sink_and_its_window(engines):
    """Poison written through the backend's cache writer at the first S or the last W token positions."""
    records, outputs, design = engines["records"], engines["outputs"], WINDOWS[0]
    clean = _proposals(records[f"readset {design} False"])
    clean_out = outputs[(f"wmtp {design}", f"readset {design} False")]["ids"]
    changed = {}
    for region in ("sink", "window"):
        tag = f"readset {design} {region}"
        poisons = [e for e in records[tag] if e["kind"] == "poison"]
        assert poisons and all(e["region"] == region and e["slots"] > 0 for e in poisons), region
        dirty = _proposals(records[tag])
        assert len(dirty) == len(clean) > 0
        changed[region] = sum(a != b for a, b in zip(clean, dirty, strict=True))
        assert outputs[(f"wmtp {design}", tag)]["ids"] == clean_out, "the target read the draft's KV"
    # With o_proj ×30 the draft is attention-dominated: large keys at either place move most proposals.
    assert changed["window"] > len(clean) // 2 and changed["sink"] > len(clean) // 2, changed
    print(f"read set inside: {changed} of {len(clean)} proposals changed", file=sys.stderr)


# --------------------------------------------------------------------------------------------------
# 3. Bound


def _builds(records: dict[str, list[dict]]) -> list[dict]:
    # "off" hands the metadata through on purpose (the cell check's negative case).
    return [e for tag, entries in records.items() if tag != "off" for e in entries if e["kind"] == "build"]


@pytest.mark.engine
def test_draft_table_and_seq_lens_are_bounded_and_exact(engines, server_run):
    builds = _builds(engines["records"]) + _builds(server_run["records"])
    assert builds
    windowed = 0
    anchored = 0
    for b in builds:
        sink, window, block = b["sink"], b["window"], b["block_size"]
        # A later forward of a decode cycle keeps the window its cycle's first forward set.
        if b["anchored"]:
            assert b["draft_index"] > 0 and win.anchors_cycle(max(b["cycle_query_lens"]), K)
            first_queries, later = max(b["cycle_query_lens"]), b["draft_index"]
            assert b["table_width"] <= win.anchored_table_width(sink, window, block, K)
            drops = [
                win.dropped_blocks(s, q, sink, window, block)
                for s, q in zip(b["cycle_seq_lens"], b["cycle_query_lens"], strict=True)
            ]
            anchored += 1
        else:
            first_queries, later = b["max_query_len"], 0
            width = (
                win.anchored_table_width(sink, window, block, K)
                if b["draft_index"] == 0 and win.anchors_cycle(b["max_query_len"], K)
                else win.table_width_bound(b["max_query_len"], sink, window, block)
            )
            assert b["table_width"] <= width
            drops = [
                win.dropped_blocks(s, q, sink, window, block)
                for s, q in zip(b["seq_lens"], b["query_lens"], strict=True)
            ]
        bound = win.seq_len_bound(first_queries, sink, window, block, later=later)
        assert b["windowed_max_seq_len"] <= bound
        for full, kept_ids, seq, drop, length in zip(
            b["full_blocks"], b["windowed_blocks"], b["seq_lens"], drops, b["windowed_seq_lens"], strict=True
        ):
            assert length == seq - block * drop
            assert kept_ids == [full[j] for j in win.kept_blocks_after(seq, drop, sink, block)]
            windowed += length < seq
        # The host copies and derived lengths the draft's builders read agree with the windowed lengths.
        lengths = b["lengths"]
        assert lengths["seq_lens"] == b["windowed_seq_lens"]
        assert max(b["windowed_seq_lens"]) <= lengths["max_seq_len"] <= bound
        if lengths["seq_lens_cpu_upper_bound"] is not None:
            upper = lengths["seq_lens_cpu_upper_bound"][: len(b["windowed_seq_lens"])]
            assert all(w <= u for w, u in zip(b["windowed_seq_lens"], upper, strict=True)), (upper, b)
            if b["windowed_seq_lens"] != b["seq_lens"]:
                assert max(upper) <= bound
        computed = lengths["num_computed_tokens"][: len(b["windowed_seq_lens"])]
        assert computed == [w - q for w, q in zip(b["windowed_seq_lens"], b["query_lens"], strict=True)]
        assert not set(b["set_fields"]) & set(hp.REFUSED_FIELDS) and not hp.unclassified_fields(b["set_fields"])
    assert windowed > 0 and anchored > 0
    # A decode cycle's forwards get one table width at every context length.
    for window_cfg in WINDOWS:
        widths = {b["table_width"] for b in builds if (b["sink"], b["window"]) == window_cfg and b["anchored"]}
        assert len(widths) == 1, (window_cfg, widths)


# --------------------------------------------------------------------------------------------------
# Proof at run time: the plugin's counters, as the cell checks them


@pytest.mark.engine
def test_the_cell_check_fails_a_hook_that_never_windows(engines):
    from wmtp.engines.vllm import verify_windowed
    from wmtp.plugin import stats

    sink, window = WINDOWS[0]
    cell = SimpleNamespace(arm="wmtp", sink=sink, window=window, k=K)
    protocol = SimpleNamespace(rungs=[POISON_LENGTH])
    off = {stats.ENV: engines["stats_dirs"]["off"]}
    with pytest.raises(stats.WindowNotApplied) as err:
        verify_windowed(off, cell, protocol)
    message = str(err.value)
    assert message.startswith("the windowed draft never ran: prompts of up to 1100 tokens exceed S + W = 144")
    assert " 0 of " in message and "draft forwards windowed" in message and "wmtp plugin (pid" in message
    on = verify_windowed({stats.ENV: engines["stats_dirs"][f"wmtp {WINDOWS[0]}"]}, cell, protocol)["wmtp_plugin"]
    assert on["windowed_forwards"] > 0 and on["blocks_skipped"] > 0
    print(f"hook off: {message}", file=sys.stderr)


@pytest.mark.engine
def test_the_servers_counters_prove_the_window_and_name_the_effective_s_and_w(server_run):
    summary = server_run["verified"]["wmtp_plugin"]
    block = summary["block_size"]
    assert summary["proposers"] == 1 and summary["windowed_forwards"] > 0 and summary["blocks_skipped"] > 0
    assert summary["sink_tokens"] == -(-WINDOWS[0][0] // block) * block
    assert (summary["window_tokens_min"], summary["window_tokens_max"]) == (WINDOWS[0][1], WINDOWS[0][1] + block - 1)
    # The worker is killed at the stop, so the last report may predate the longest request.
    assert summary["longest_context"] >= PROMPT_LENGTHS[1]
    # S = 16 is no multiple of the block size: the start-up warning names what the draft reads.
    warning = [line for line in server_run["log"].splitlines() if "not both multiples of the KV block size" in line]
    assert len(warning) == 1 and f"sink of {summary['sink_tokens']} tokens" in warning[0], warning
    print(f"server: {summary['messages']}", file=sys.stderr)


# --------------------------------------------------------------------------------------------------
# 4. Acceptance on the all-zero lm_head model


def _assert_full_acceptance(d: dict, what: str) -> None:
    assert d["drafts"] > 0, what
    assert d["draft_tokens"] == K * d["drafts"], (what, d)
    assert d["accepted"] == d["draft_tokens"], (what, d)
    for pos in range(K):
        assert d[f"accepted_pos_{pos}"] == d["drafts"], (what, pos, d)


@pytest.mark.engine
def test_zero_lm_head_keeps_full_acceptance(engines, server_run):
    for (name, tag), result in engines["outputs"].items():
        if name.startswith("zero"):
            _assert_full_acceptance(result["counters"], tag)
    for n, d in server_run["deltas"].items():  # from the server's /metrics
        _assert_full_acceptance(d, f"server at {n}")
    assert any(e["windowed_seq_lens"] != e["seq_lens"] for e in _builds(server_run["records"]))


# --------------------------------------------------------------------------------------------------
# Plugin behaviour in the server's processes


@pytest.mark.engine
def test_server_loads_plugin_logs_once_and_leaves_nothing(server_run, engines):
    lines = [line for line in server_run["log"].splitlines() if ACTIVE_LINE in line]
    assert len(lines) == 1, lines
    assert "(Worker" in lines[0] and "sink S=16, window W=128, KV block size" in lines[0]
    from wmtp.measure.server import group_alive

    assert not group_alive(server_run["pgid"]), "the server's process group outlived the test"
    # In process: each windowed engine logs once; none and mtp stay silent and record nothing.
    assert engines["log"].count(ACTIVE_LINE) == len(WINDOWS) + 4  # zero twice, "off" and the ring
    assert not [tag for tag in engines["records"] if tag.startswith(("none", "mtp"))]
    # A configuration the plugin cannot honour stops the engine at start-up, naming the setting.
    refusal = engines["timings"]["refused"]["error"]
    assert "--additional-config wmtp.window must be an integer ≥ 1" in refusal + engines["log"], refusal
    print({"in_process": engines["timings"], "server": server_run["timings"]}, file=sys.stderr)
