"""The Windowed-MTP plugin's proofs in a CUDA build of vLLM, on one GPU (an H200).

Two steps. Here, where the tokenizer and the corpus are (any machine with the pipeline's venv):

    python scripts/device/vllm_gpu_proofs.py prompts --out .gpu-inputs/proofs/prompts.json

There, with the carried engine on the path (scripts/device/engine_install.sh) and the prompts carried in:

    PYTHONPATH=/tmp/wmtp-engine/site:src python3 scripts/device/vllm_gpu_proofs.py run \
        --prompts .gpu-inputs/proofs/prompts.json --out "$OUT"

``run`` serves the committed tiny trained model (src/wmtp/model/tiny-trained) in one process, CUDA graphs on
as a real server runs them (FULL for the target's decode, PIECEWISE for the drafter): first stock MTP (k = 3),
then wmtp (S = 16, W = 256) with the plugin's test instrument (wmtp.plugin.testing) and counters
(wmtp.plugin.stats). It proves, and writes to ``$OUT/gpu_proofs.json`` (exit 1 when one fails):

- the hook is on the path that runs: ``check_hook_points(deep=True)`` patched the proposer, and the plugin
  counted windowed draft forwards (> 0) and skipped KV blocks (> 0);
- lossless: wmtp's greedy tokens are mtp's on code and copy-task prompts of 4,096 and 12,288 tokens, up to
  near ties (the first divergence where mtp's top-2 log-probability gap is below 0.25), with no penalty and with
  the Windowed-MTP artifact's repetition penalty of 1.15 on every request;
- the read set, both ways, with the draft layer's KV overwritten through the CUDA attention backend's own
  cache writer (``do_kv_cache_update``): poisoned outside sink ∪ window, the windowed draft proposes exactly
  what it proposes clean, and a draft that reads everything (a window wider than the context) does not;
  poisoned inside the sink or inside the window, the windowed draft changes.

With ``--ring`` it serves the ring (wmtp-ring, the draft's KV kept to sink + window, the rest given back to the
pool) as a third engine and proves it too: lossless against MTP; on the read-set prompt it proposes exactly what
wmtp proposes; poisoned where the blocks it gave back and the pool holds free are (the worker's table still names
them; a block the pool has handed out again is spared, as its new owner's KV), it proposes what it proposes clean,
some poison having landed in such blocks, and the target answers as it does clean; and what it
gave back is gone: its KV cache manager gave blocks back to the pool (the instrument records each free in the
engine core, where it happens; the worker's block table keeps the freed ids), every free starting right after the
sink and none reaching a block the next draft forward reads. Every engine runs with a token budget of
``TOKEN_BUDGET``: the ring frees only behind every budget in flight, and at vLLM's GPU default (16,384 tokens, two
batches in flight) a 12K prompt would keep all its blocks. What a draft told to read past what the ring keeps
proposes, beside wmtp's told the same, is recorded, not proven: where the clean draft does not depend on the far
context, reading it or what now sits in the freed blocks proposes alike.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

from wmtp.layout import TRAINED_CHECKPOINT

REPO = Path(__file__).resolve().parents[2]
FIXTURE = TRAINED_CHECKPOINT
K = 3
SINK, WINDOW = 16, 256
WIDE_OPEN = (0, 1_000_000)  # W beyond every context: the plugin hands the metadata through (= mtp)
LENGTHS = (4096, 12288)
READ_SET_PROMPT = "code 12288"
OUTPUT_TOKENS = 48
MAX_MODEL_LEN = 16640
NEAR_TIE = 0.25  # a few bf16 ulps of the trained tiny model's logits (tests/test_train.py)
PENALTY = 1.15  # the Windowed-MTP artifact's repetition penalty
# max_num_batched_tokens of every engine, so that the ring frees within the prompts: it frees a request's blocks only
# behind the token budgets in flight (wmtp.plugin.ring_math.free_lag, retained_blocks).
TOKEN_BUDGET = 2048


def make_prompts(out: Path) -> None:
    """Token ids of exact length: held-out code and the copy task, with the fixture's tokenizer."""
    from wmtp.measure.workload import Corpus, PromptFactory, copy_task_prompt
    from wmtp.model.train import heldout_text

    factory = PromptFactory(FIXTURE / "tokenizer.json", corpus=Corpus(heldout_text(), "heldout"))
    prompts = {}
    for n in LENGTHS:
        prompts[f"code {n}"] = factory.encode(factory.prompt(n, 0, salt="gpu-proof/code"))
        prompts[f"copy {n}"] = factory.encode(copy_task_prompt(factory, n, 0, salt="gpu-proof/copy").text)
    assert all(len(ids) == int(name.split()[1]) for name, ids in prompts.items())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(prompts))


def _control(directory: Path, tag: str, window: tuple[int, int], poison: str | None = None) -> None:
    body: dict = {"tag": tag, "sink": window[0], "window": window[1]}
    if poison:
        body["poison"] = {"sink": SINK, "window": WINDOW, "region": poison}
    (directory / "control.json.tmp").write_text(json.dumps(body))
    os.replace(directory / "control.json.tmp", directory / "control.json")


def _counters(llm) -> dict[str, float]:
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted",
    }
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        name = names.get(metric.name.removesuffix("_total"))
        if name and hasattr(metric, "value"):
            out[name] = out.get(name, 0.0) + float(metric.value)
    return out


def _engine(arm: str):
    from vllm import LLM

    kwargs = {}
    if arm in ("wmtp", "wmtp-ring"):
        kwargs["additional_config"] = {"wmtp": {"sink": SINK, "window": WINDOW, "ring": arm == "wmtp-ring"}}
    return LLM(
        model=str(FIXTURE),
        dtype="bfloat16",
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.3,
        speculative_config={"method": "mtp", "num_speculative_tokens": K},
        gdn_prefill_backend="triton",  # FlashInfer's GDN prefill compiles with nvcc at start
        max_num_batched_tokens=TOKEN_BUDGET,
        disable_log_stats=False,
        seed=0,
        **kwargs,
    )


def _generate(llm, ids: list[int], penalty: float = 1.0) -> dict:
    from vllm import SamplingParams

    from wmtp.measure.admission import top2_gaps

    params = SamplingParams(
        temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True, logprobs=2, repetition_penalty=penalty
    )
    before = _counters(llm)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].outputs[0]
    after = _counters(llm)
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    return {
        "ids": list(out.token_ids),
        "gaps": top2_gaps(out.logprobs),
        "acceptance": delta.get("accepted", 0.0) / delta["draft_tokens"] if delta.get("draft_tokens") else None,
    }


def _lines(records: Path) -> list[dict]:
    return [json.loads(line) for line in records.read_text().splitlines()] if records.exists() else []


def _drafts(records: Path, tag: str) -> list:
    return [r["draft"] for r in _lines(records) if r.get("kind") == "propose" and r.get("tag") == tag]


RING_TAGS = ("ring clean", "ring poison outside", "ring clean, read all")


def _ring_read_set(llm, test_dir: Path, ids: list[int], outputs: dict) -> None:
    for tag, window, poison in (
        ("ring clean", (SINK, WINDOW), None),
        ("ring poison outside", (SINK, WINDOW), "outside"),
        ("ring clean, read all", WIDE_OPEN, None),
    ):
        _control(test_dir, tag, window, poison)
        try:
            outputs[f"read set {tag}"] = _generate(llm, ids)
        except Exception as err:  # a ring that refuses to read past what it keeps fails its proof, not the run
            outputs[f"read set {tag}"] = {"error": repr(err)[:500]}
    _control(test_dir, "idle", (SINK, WINDOW))


def _ring_proofs(prompts: dict, outputs: dict, records: Path, proofs: dict, found: dict) -> None:
    from wmtp.analyze.equality import equal_up_to_numerics
    from wmtp.measure.proofs import ring_frees

    for name in prompts:
        mtp, ring = outputs[f"mtp {name}"], outputs[f"wmtp-ring {name}"]
        proofs[f"ring lossless {name}"] = equal_up_to_numerics(mtp["ids"], mtp["gaps"], ring["ids"], NEAR_TIE).equal
    drafts = {tag: _drafts(records, tag) for tag in (*RING_TAGS, "clean", "clean, read all")}
    found["ring_read_set"] = {tag: len(d) for tag, d in drafts.items()}
    every = all(drafts.values())
    proofs["ring read set: drafts as wmtp's"] = every and drafts["ring clean"] == drafts["clean"]
    # The instrument poisons what the ring gave back and the pool holds free, and spares what the pool has already
    # handed to another owner (the target's KV, as the prefill's chunks go on).
    ring_lines = [line for line in _lines(records) if line.get("tag") in RING_TAGS]
    poisons = [line for line in ring_lines if line.get("kind") == "poison"]
    found["ring_poison"] = {key: sum(p.get(key, 0) for p in poisons) for key in ("slots", "free", "spared")}
    proofs["ring read set: freed blocks unread"] = (
        every and found["ring_poison"]["free"] > 0 and drafts["ring poison outside"] == drafts["ring clean"]
    )
    clean, poisoned = outputs["read set ring clean"], outputs["read set ring poison outside"]
    target_unmoved = "ids" in clean and clean["ids"] == poisoned.get("ids")
    proofs["ring read set: the poison left the target alone"] = target_unmoved
    frees = ring_frees(ring_lines, SINK, WINDOW)
    found["ring_frees"] = frees
    proofs["ring read set: what it gave back is gone"] = (
        frees["blocks_given_back"] > 0 and frees["not_after_the_sink"] == 0 and frees["into_a_read_window"] == 0
    )
    found["ring_read_all_differs_from_wmtp_read_all"] = drafts["ring clean, read all"] != drafts["clean, read all"]
    found["wmtp_read_all_differs_from_clean"] = drafts["clean, read all"] != drafts["clean"]


def run(prompts_file: Path, out_dir: Path, ring: bool = False) -> int:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.plugins import load_general_plugins

    from wmtp.analyze.equality import equal_up_to_numerics
    from wmtp.engines.vllm_hooks import check_hook_points
    from wmtp.measure.proofs import finish
    from wmtp.plugin import stats as wstats

    load_general_plugins()  # through the wmtp entry point, as every vLLM process loads it
    prompts = {name: list(ids) for name, ids in json.loads(prompts_file.read_text()).items()}
    test_dir, stats_dir = out_dir / "instrument", out_dir / "stats"
    test_dir.mkdir(parents=True, exist_ok=True)
    stats_dir.mkdir(exist_ok=True)
    found: dict = {"hook_points": check_hook_points(deep=True), "arms": {}, "proofs": {}}
    outputs: dict[str, dict] = {}
    for arm in ("mtp", "wmtp", *(("wmtp-ring",) if ring else ())):
        if arm != "mtp":
            os.environ["WMTP_PLUGIN_TEST_DIR"] = str(test_dir)  # read when the proposer starts
            os.environ["WMTP_PLUGIN_STATS_DIR"] = str(stats_dir)
            _control(test_dir, "lossless", (SINK, WINDOW))
        started = time.monotonic()
        llm = _engine(arm)
        found["arms"][arm] = {"start_s": round(time.monotonic() - started, 1)}
        started = time.monotonic()
        for name, ids in prompts.items():
            outputs[f"{arm} {name}"] = _generate(llm, ids)
            if arm == "wmtp-ring":
                continue
            # The Windowed-MTP artifact's protocol penalises repetition in the draft and the target alike.
            outputs[f"{arm} {name}, penalty {PENALTY}"] = _generate(llm, ids, PENALTY)
        if arm == "wmtp-ring":
            _ring_read_set(llm, test_dir, prompts[READ_SET_PROMPT], outputs)
        if arm == "wmtp":
            ids = prompts[READ_SET_PROMPT]
            for tag, window, poison in (
                ("clean", (SINK, WINDOW), None),
                ("poison outside", (SINK, WINDOW), "outside"),
                ("clean, read all", WIDE_OPEN, None),
                ("poison outside, read all", WIDE_OPEN, "outside"),
                ("poison sink", (SINK, WINDOW), "sink"),
                ("poison window", (SINK, WINDOW), "window"),
            ):
                _control(test_dir, tag, window, poison)
                outputs[f"read set {tag}"] = _generate(llm, ids)
            _control(test_dir, "idle", (SINK, WINDOW))
        found["arms"][arm]["requests_s"] = round(time.monotonic() - started, 1)
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()

    proofs = found["proofs"]
    proofs["patched"] = bool(found["hook_points"].get("patched"))
    counted = wstats.summarize(wstats.read(stats_dir))
    found["plugin_counters"] = counted
    proofs["windowed"] = counted["windowed_forwards"] > 0 and counted["blocks_skipped"] > 0
    for name in [*prompts, *(f"{name}, penalty {PENALTY}" for name in prompts)]:
        mtp, wmtp = outputs[f"mtp {name}"], outputs[f"wmtp {name}"]
        verdict = equal_up_to_numerics(mtp["ids"], mtp["gaps"], wmtp["ids"], NEAR_TIE)
        proofs[f"lossless {name}"] = verdict.equal
        found.setdefault("lossless", {})[name] = {
            "reason": verdict.reason,
            "acceptance_mtp": mtp["acceptance"],
            "acceptance_wmtp": wmtp["acceptance"],
        }
    records = test_dir / "records.jsonl"
    drafts = {tag: _drafts(records, tag) for tag in ("clean", "poison outside", "clean, read all")}
    drafts.update({tag: _drafts(records, tag) for tag in ("poison outside, read all", "poison sink", "poison window")})
    found["read_set"] = {tag: len(d) for tag, d in drafts.items()}
    poisons = [json.loads(line) for line in records.read_text().splitlines() if '"kind": "poison"' in line]
    found["poison_writes"] = {
        region: sum(p["slots"] for p in poisons if p["region"] == region) for region in ("outside", "sink", "window")
    }
    every = all(drafts.values())
    proofs["read set: outside unread by the window"] = every and drafts["poison outside"] == drafts["clean"]
    proofs["read set: outside read without it"] = (
        every and drafts["poison outside, read all"] != drafts["clean, read all"]
    )
    proofs["read set: sink read"] = every and drafts["poison sink"] != drafts["clean"]
    proofs["read set: window read"] = every and drafts["poison window"] != drafts["clean"]
    if ring:
        _ring_proofs(prompts, outputs, records, proofs, found)
    import torch
    import vllm

    found["engine"] = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
    }
    return finish(found, outputs, out_dir / "gpu_proofs.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prompts")
    p.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("run")
    r.add_argument("--prompts", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--ring", action="store_true", help="also serve and prove the ring (wmtp-ring)")
    args = parser.parse_args(argv)
    if args.command == "prompts":
        make_prompts(args.out)
        return 0
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and worker here: the instrument's files
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    return run(args.prompts, args.out, args.ring)


if __name__ == "__main__":
    sys.exit(main())
