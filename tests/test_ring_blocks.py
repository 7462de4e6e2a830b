"""wmtp-ring in the scheduler and KV cache manager of the CUDA vLLM the H200 studies carry, at the 35B shape.

The engine interpreter runs ``wmtp.measure.ring_blocks`` with that vLLM's Python sources first on its path
(``make engine`` reads them out of the release's wheel): vLLM's own engine config, pool sizing and scheduler,
the ring's spec and manager, and a stand-in for the model that samples tokens. The same configuration is held
against what a real server of that vLLM logged on an H200 (the committed raw files), so the stand-in's KV
cache is the GPU's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import REPO, gpu_vllm_version

from wmtp.measure.ring_blocks import overlap_tokens
from wmtp.model.dummy import write_dummy

ARCHITECTURE = REPO / "config" / "models" / "qwen3.6-35b-a3b.json"
# The H200 servers of the tuned study, both arms, as vLLM logged them at start-up.
SERVER_LOGS = REPO / "measurements" / "h200" / "vllm-tuned" / "vllm_qwen3.6-35b-a3b_raw.tar.gz"
PROMPT = 1_040_000
CHUNK = 8192


@pytest.fixture(scope="module")
def model_35b(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dummy-35b")
    write_dummy(ARCHITECTURE, out, 1_049_600)
    return out


def _run(engine_python: str, sources: Path, argv: list[str], engine_env: dict) -> subprocess.CompletedProcess:
    env = {**os.environ, **engine_env, "PYTHONPATH": f"{sources}{os.pathsep}{REPO / 'src'}"}
    return subprocess.run(
        [engine_python, *argv], capture_output=True, text=True, timeout=600, env=env, check=False, cwd=REPO
    )


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def blocks(request, engine_python, gpu_vllm_sources, model_35b, engine_env, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ring-blocks") / "ring_blocks.json"
    argv = ["-m", "wmtp.measure.ring_blocks", "--model", str(model_35b), "--out", str(out), "--window", "4096"]
    argv += ["--prompt-tokens", str(PROMPT), "--chunk", str(CHUNK)]
    if request.param:
        argv.append("--async-scheduling")
    proc = _run(engine_python, gpu_vllm_sources, argv, engine_env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    print(
        {
            arm: {k: r[k] for k in ("groups", "num_blocks", "max_running", "draft_blocks_held_max")}
            for arm, r in result["arms"].items()
        },
        f"reclaimed {result['reclaimed_fraction']:.4f}",
        file=sys.stderr,
    )
    return result


@pytest.mark.engine
def test_the_ring_runs_three_1m_requests_where_wmtp_runs_two(blocks):
    assert blocks["vllm"] == gpu_vllm_version()
    assert blocks["block_size"] == 560
    plain, ring = blocks["arms"]["wmtp"], blocks["arms"]["wmtp-ring"]
    assert blocks["verdict"] == "ring admits one more"
    assert (plain["max_running"], ring["max_running"]) == (2, 3)
    assert plain["preemptions"] == ring["preemptions"] == 0
    # no block freed where a step in flight could still read it, counted after every scheduling
    assert ring["freed_but_readable"] == 0
    assert plain["finished"] == ring["finished"] == 3
    assert ring["draft_manager"] == "SinkWindowManager" and plain["draft_manager"] == "FullAttentionManager"
    # vLLM's grouping: wmtp keeps the draft among the 11 full-attention layers; the ring's draft group stands apart and
    # the target's layers keep groups of ten, not of one (41 groups) as vLLM would make them around a one-layer type
    assert "FullAttentionSpec ×11" in plain["group_kinds"] and "SinkWindowSpec ×1" in ring["group_kinds"]
    assert ring["groups"] == plain["groups"] + 1 and "FullAttentionSpec ×10" in ring["group_kinds"]


@pytest.mark.engine
def test_the_draft_holds_at_most_its_bound_and_the_reclaimed_share_is_one_layer_of_eleven(blocks):
    ring = blocks["arms"]["wmtp-ring"]
    assert 0 < ring["draft_blocks_held_max"] <= ring["draft_blocks_limit"] < PROMPT // 560 // 20
    # one full-attention layer of eleven, less what the ring still holds (sink, window, tokens in flight), each draft
    # block costing the pages of one block of the others' ten-layer groups
    plain = blocks["arms"]["wmtp"]
    layer_share = 1 / 11
    held = ring["draft_blocks_limit"] / ring["num_blocks"] * ring["max_concurrency"]  # of the pool per request
    assert layer_share - held - 0.01 < blocks["reclaimed_fraction"] < layer_share, (blocks["reclaimed_fraction"], held)
    assert plain["draft_blocks_limit"] is None
    # an optimistic count under async scheduling is held back by the batch in flight
    assert ring["draft_free_lag"] == (CHUNK if blocks["async_scheduling"] else 0)


@pytest.mark.engine
def test_the_scheduler_is_timed_at_each_batch_size_it_decoded(blocks):
    timed = blocks["arms"]["wmtp-ring"]["scheduler_us_per_decode_step"]
    if blocks["async_scheduling"]:
        assert timed == {}  # a step's schedule and update are not one after the other there
        return
    assert set(timed) == {"1", "2", "3"} and all(t["n"] > 0 and t["median"] > 0 for t in timed.values())


def test_the_proofs_requests_overlap_even_when_every_draft_is_accepted():
    # two 1M prefills of 127 chunks each, while the first request decodes at most 4 tokens a step
    assert overlap_tokens(2, PROMPT, CHUNK, 3) == 2 * 127 * 4 + 1


def _server_logs() -> list[str]:
    logs = []
    with tarfile.open(SERVER_LOGS) as archive:
        for member in archive.getmembers():
            if member.isfile() and member.name.endswith(".log"):
                text = archive.extractfile(member).read().decode(errors="replace")
                if "GPU KV cache size:" in text:
                    logs.append(text)
    return logs


CAPACITY = r"""
import json, sys
from pathlib import Path
from types import SimpleNamespace
from wmtp.measure import ring_blocks as rb
from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity
spec = json.loads(sys.argv[1])
args = SimpleNamespace(model=Path(spec["model"]), max_model_len=spec["max_model_len"], chunk=8192, n=2, k=3,
                       sink=16, window=4096, async_scheduling=True)
config = rb.engine_config(args, False)
kv = rb.kv_cache_config(config, rb.layer_specs(config, False, 16, 4096), spec["kv_bytes"])
tokens, concurrency = get_kv_cache_capacity(config, kv)
print("CAPACITY " + json.dumps({"tokens": tokens, "concurrency": concurrency,
                                "block_size": config.cache_config.block_size}))
"""


@pytest.mark.engine
def test_the_stand_in_sizes_the_kv_cache_as_the_h200_servers_did(
    engine_python, gpu_vllm_sources, model_35b, engine_env
):
    logs = _server_logs()
    assert logs, f"no server start-up log in {SERVER_LOGS}"
    for text in logs:
        gib = float(re.search(r"Available KV cache memory: ([\d.]+) GiB", text).group(1))
        tokens = int(re.search(r"GPU KV cache size: ([\d,]+) tokens", text).group(1).replace(",", ""))
        length, concurrency = re.search(
            r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x", text
        ).groups()
        block = int(re.search(r"Setting attention block size to (\d+) tokens", text).group(1))
        spec = {"model": str(model_35b), "max_model_len": int(length.replace(",", "")), "kv_bytes": int(gib * 2**30)}
        proc = _run(engine_python, gpu_vllm_sources, ["-c", CAPACITY, json.dumps(spec)], engine_env)
        assert proc.returncode == 0, proc.stderr[-4000:]
        found = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("CAPACITY "))[len("CAPACITY ") :])
        assert found["block_size"] == block
        # the log rounds the memory to 0.01 GiB: a few hundred tokens either way
        assert abs(found["tokens"] - tokens) / tokens < 1e-3, (found, tokens)
        assert round(found["concurrency"], 2) == float(concurrency)


PREDICTION = REPO / "measurements" / "h200" / "ring_blocks_vllm-0.24.0.json"


@pytest.mark.engine
def test_the_committed_prediction_the_gpu_proof_reads_is_what_the_scheduler_gives_now(blocks):
    """scripts/device/ring_admission_gpu.sh takes its KV memory, lengths and tokens from the committed record."""
    if not blocks["async_scheduling"]:
        return  # the record is of the H200 servers' async scheduling; the sync run has its own tests above
    committed = json.loads(PREDICTION.read_text())
    for key in ("vllm", "kv_cache_memory_bytes", "max_model_len", "prompt_tokens", "output_tokens", "verdict"):
        assert committed[key] == blocks[key], key
    assert committed["model"] == "Qwen3.6-35B-A3B"
    assert committed["arms"]["wmtp-ring"]["max_running"] == 3


@pytest.mark.engine
def test_a_lag_short_of_the_batch_in_flight_frees_what_a_step_still_reads(
    engine_python, gpu_vllm_sources, model_35b, engine_env, tmp_path
):
    """The control of the read-set count above: under async scheduling vLLM 0.24 frees at a count that includes the
    batch in flight; without the ring's lag, blocks go back while that batch's draft reads them. At 60,000 tokens the
    ring's group also stays in vLLM's own grouping: apart, its bound at ten pages a block would cost more than the
    draft's whole context."""
    out = tmp_path / "control.json"
    argv = ["-m", "wmtp.measure.ring_blocks", "--model", str(model_35b), "--out", str(out), "--window", "4096"]
    argv += ["--prompt-tokens", "60000", "--chunk", str(CHUNK), "--async-scheduling", "--free-lag", "0"]
    proc = _run(engine_python, gpu_vllm_sources, argv, engine_env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    ring = result["arms"]["wmtp-ring"]
    assert ring["draft_free_lag"] == 0 and ring["freed_but_readable"] > 0
    assert ring["groups"] == 41 and "in vLLM's own grouping" in proc.stdout + proc.stderr
    assert result["reclaimed_fraction"] > 0
