"""Arm wmtp-ring inside the real vLLM CPU build: the draft layer's blocks outside sink ∪ window go back to the pool.

One engine interpreter runs, in process (``LLM``, engine core and worker in one process), wmtp and wmtp-ring at
two (S, W), stepping the engine by hand so that after every step it can read the scheduler's own accounting: the
draft group's block list (freed entries are vLLM's null block), each block's reference count and the pool's free
count. The model is the random-weight model with the draft's o_proj ×30 (its proposals react to what its
attention reads) that test_plugin_vllm's engines read too: one build, tests/conftest.py's ``random_model``.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wmtp.plugin import window as win

K = 3
MAX_TOKENS = 32
# The design point, and a sink and a window each smaller than one KV block.
WINDOWS = ((16, 128), (4, 8))
SHORT, LONG = 700, 3000  # LONG is over 20 × S + W at both windows
CHUNK_TOKENS = 512

DRIVER = r"""
import gc, json, os, sys, time
spec = json.load(open(sys.argv[1]))
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and worker in this process: the scheduler is ours
from vllm import LLM, SamplingParams
from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)
out = {}
for engine in spec["engines"]:
    started = time.monotonic()
    sink, window = engine["window"]
    # The plugin's instrument, on: its records of each free (engine core) and each draft build (worker).
    os.environ["WMTP_PLUGIN_TEST_DIR"] = engine["records"]
    llm = LLM(model=spec["model"], dtype="bfloat16", enforce_eager=True, enable_prefix_caching=False,
              max_model_len=4096, max_num_batched_tokens=spec["chunk"], distributed_executor_backend="uni",
              disable_log_stats=False, seed=0,
              speculative_config={"method": "mtp", "num_speculative_tokens": spec["k"]},
              additional_config={"wmtp": {"sink": sink, "window": window, "ring": engine["ring"]}})
    init_s = time.monotonic() - started
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    managers = manager.coordinator.single_type_managers
    draft_gid = next(i for i, g in enumerate(scheduler.kv_cache_config.kv_cache_groups)
                     if any(name.startswith("mtp.") for name in g.layer_names))
    cache = llm.llm_engine.vllm_config.cache_config
    record = {"init_s": init_s, "capacity_tokens": cache.kv_cache_size_tokens, "num_blocks": cache.num_gpu_blocks,
              "groups": [type(m).__name__ for m in managers], "draft_gid": draft_gid,
              "block_size": managers[draft_gid].block_size,
              "limit": getattr(managers[draft_gid].kv_cache_spec, "max_blocks_per_request", None),
              "requests": {}}
    started = time.monotonic()
    def accepted():
        return {m.name.removesuffix("_total"): m.value for m in llm.get_metrics()
                if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value")}

    for length in spec["lengths"]:
        counters = accepted()
        llm.llm_engine.add_request(f"{length}", {"prompt_token_ids": spec["prompts"][str(length)]}, params)
        steps, ids, seen = [], None, set()
        while llm.llm_engine.has_unfinished_requests():
            for result in llm.llm_engine.step():
                if result.finished:
                    ids = list(result.outputs[0].token_ids)
            if not scheduler.requests:
                continue
            rid = next(iter(scheduler.requests))
            groups = manager.coordinator.get_blocks(rid)
            draft = [None if b.is_null else b.block_id for b in groups[draft_gid]]
            held = {b.block_id for g in groups for b in g if not b.is_null}
            seen.update(b for b in draft if b is not None)
            steps.append({
                "computed": scheduler.requests[rid].num_computed_tokens,
                "draft": draft,
                "held": len(held),
                "free": pool.get_num_free_blocks(),
                # Every draft block this request ever held and no longer holds: its reference count now.
                "released_ref_cnt": {str(b): pool.blocks[b].ref_cnt for b in seen - held},
            })
        after = accepted()
        record["requests"][str(length)] = {"ids": ids, "steps": steps,
                                           "spec": {k: v - counters.get(k, 0) for k, v in after.items()}}
    record["requests_s"] = time.monotonic() - started
    out[engine["name"]] = record
    del llm, scheduler, manager, pool, managers
    gc.collect()
    cleanup_dist_env_and_memory()
json.dump(out, open(sys.argv[2], "w"))
"""


@pytest.fixture(scope="module")
def runs(engine_python, random_model, work, engine_env) -> dict:
    rng = random.Random(5)
    prompts = {n: [rng.randint(1, 2047) for _ in range(n)] for n in (SHORT, LONG)}
    engines = [
        {"name": f"{'ring' if ring else 'wmtp'} {window}", "window": window, "ring": ring}
        for window in WINDOWS
        for ring in (False, True)
    ]
    for number, engine in enumerate(engines):
        engine["records"] = str(work / f"ring-records-{number}")
        Path(engine["records"]).mkdir(exist_ok=True)
    spec = {
        "model": str(random_model),
        "k": K,
        "max_tokens": MAX_TOKENS,
        "chunk": CHUNK_TOKENS,
        "lengths": [SHORT, LONG],
        "prompts": {str(n): p for n, p in prompts.items()},
        "engines": engines,
    }
    spec_path, out_path = work / "ring-spec.json", work / "ring-out.json"
    spec_path.write_text(json.dumps(spec))
    started = time.monotonic()
    proc = subprocess.run(
        [engine_python, "-c", DRIVER, str(spec_path), str(out_path)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **engine_env},
    )
    assert proc.returncode == 0, f"ring driver failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    result = json.loads(Path(out_path).read_text())
    for engine in engines:
        records = Path(engine["records"]) / "records.jsonl"
        lines = records.read_text().splitlines() if records.exists() else []
        result[engine["name"]]["records"] = [json.loads(line) for line in lines]
    result["_log"] = proc.stdout + proc.stderr
    result["_total_s"] = time.monotonic() - started
    return result


def _decode_steps(run: dict, length: int) -> list[dict]:
    """Steps that started with the whole prompt computed: a step frees at the length the step before committed."""
    steps = run["requests"][str(length)]["steps"]
    return [after for before, after in itertools.pairwise(steps) if before["computed"] >= length]


@pytest.mark.engine
def test_ring_gives_the_draft_layer_its_own_group_and_more_tokens(runs):
    for window in WINDOWS:
        plain, ring = runs[f"wmtp {window}"], runs[f"ring {window}"]
        assert ring["groups"][ring["draft_gid"]] == "SinkWindowManager", ring["groups"]
        assert plain["groups"][plain["draft_gid"]] == "FullAttentionManager", plain["groups"]
        assert ring["capacity_tokens"] > plain["capacity_tokens"], (ring["capacity_tokens"], plain["capacity_tokens"])
    assert "wmtp: ring: the draft layer's KV cache group keeps sink" in runs["_log"]
    print(
        {name: (r["capacity_tokens"], r["num_blocks"], r["groups"]) for name, r in runs.items() if name[0] != "_"},
        f"total {runs['_total_s']:.0f} s",
        file=sys.stderr,
    )


@pytest.mark.engine
@pytest.mark.parametrize("window", WINDOWS, ids=[f"S{s}-W{w}" for s, w in WINDOWS])
def test_ring_is_lossless_against_wmtp(runs, window):
    """Same read set, same KV values: the ring's greedy output is wmtp's, token for token."""
    for length in (SHORT, LONG):
        plain = runs[f"wmtp {window}"]["requests"][str(length)]["ids"]
        ring = runs[f"ring {window}"]["requests"][str(length)]["ids"]
        assert len(ring) == MAX_TOKENS and ring == plain, (window, length)
        # The draft's proposals react to what its attention reads (o_proj ×30): a freed block read after reuse
        # would move them, and with them the engine's acceptance counts.
        spec_plain = runs[f"wmtp {window}"]["requests"][str(length)]["spec"]
        spec_ring = runs[f"ring {window}"]["requests"][str(length)]["spec"]
        assert spec_plain["vllm:spec_decode_num_drafts"] > 0 and spec_ring == spec_plain, (spec_ring, spec_plain)


@pytest.mark.engine
@pytest.mark.parametrize("window", WINDOWS, ids=[f"S{s}-W{w}" for s, w in WINDOWS])
def test_blocks_behind_the_window_go_back_to_the_free_pool(runs, window):
    ring = runs[f"ring {window}"]
    sink, width = window
    block = ring["block_size"]
    for length in (SHORT, LONG):
        steps = ring["requests"][str(length)]["steps"]
        freed = reused = 0
        for before, after in itertools.pairwise(steps):
            # A step frees before it allocates, at the length committed by the step before: exactly the blocks
            # strictly between the sink and the block holding that length - W are gone.
            first, last = win.sink_blocks(sink, block), max(before["computed"] - width, 0) // block
            for j, block_id in enumerate(after["draft"]):
                assert (block_id is None) == (first <= j < max(first, last)), (length, after["computed"], j)
            released = [b for j, b in enumerate(before["draft"]) if b is not None and after["draft"][j] is None]
            freed += len(released)
            # A released block is referenced by nobody (in vLLM's free queue, counted as free), unless the pool
            # already handed it out again within the same step, to this request's next blocks.
            for b in released:
                assert after["released_ref_cnt"].get(str(b), 0) == 0, (length, b)
                reused += str(b) not in after["released_ref_cnt"]
        assert freed > reused >= 0, f"nothing freed at {length} tokens ({freed} released, {reused} reused)"
        # The pool's own count: everything this single request does not hold is free (block 0 is vLLM's null).
        for step in steps:
            assert step["free"] == ring["num_blocks"] - 1 - step["held"], step
    plain = runs[f"wmtp {window}"]
    for ours, theirs in zip(_decode_steps(ring, LONG), _decode_steps(plain, LONG), strict=True):
        assert ours["computed"] == theirs["computed"]
        # Plain wmtp keeps every draft block; the ring keeps sink ∪ window only.
        assert sum(b is not None for b in ours["draft"]) < sum(b is not None for b in theirs["draft"])
    last = _decode_steps(ring, LONG)[-1]
    print(
        f"ring {window}: at {last['computed']} tokens the draft holds {sum(b is not None for b in last['draft'])} "
        f"of {len(last['draft'])} blocks; pool free {last['free']} of {ring['num_blocks']} "
        f"(wmtp: {_decode_steps(plain, LONG)[-1]['free']} of {plain['num_blocks']})",
        file=sys.stderr,
    )


@pytest.mark.engine
@pytest.mark.parametrize("window", WINDOWS, ids=[f"S{s}-W{w}" for s, w in WINDOWS])
def test_a_long_request_holds_a_bounded_number_of_draft_blocks(runs, window):
    ring = runs[f"ring {window}"]
    sink, width = window
    block = ring["block_size"]
    assert 20 * (sink + width) < LONG
    held = [sum(b is not None for b in s["draft"]) for s in ring["requests"][str(LONG)]["steps"]]
    assert max(held) <= ring["limit"] < -(-LONG // block), (held, ring["limit"])
    # While decoding, one step's queries are at most K + 1 tokens: sink blocks + the window's blocks + 1.
    bound = win.sink_blocks(sink, block) + -(-(width + K + 1) // block) + 1
    decode = [sum(b is not None for b in s["draft"]) for s in _decode_steps(ring, LONG)]
    assert decode and max(decode) <= bound, (decode, bound)


@pytest.mark.engine
@pytest.mark.parametrize("window", WINDOWS, ids=[f"S{s}-W{w}" for s, w in WINDOWS])
def test_the_instrument_sees_the_ring_free_after_the_sink_and_never_what_the_draft_reads(runs, window):
    """The GPU proofs' judgement of the ring's frees (wmtp.measure.proofs.ring_frees) on this
    engine's records: the ring's manager gave blocks back, each free started right after the sink, and none reached
    a block the next draft forward read; wmtp never freed."""
    from wmtp.measure.proofs import ring_frees

    ring, plain = runs[f"ring {window}"]["records"], runs[f"wmtp {window}"]["records"]
    assert any(line["kind"] == "build" for line in ring)
    frees = ring_frees(ring, *window)
    assert frees["blocks_given_back"] > 0 and frees["frees"] > 0, frees
    assert frees["not_after_the_sink"] == 0 and frees["into_a_read_window"] == 0, frees
    assert not [line for line in plain if line["kind"] == "free"]
