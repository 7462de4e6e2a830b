"""The ring's admission in vLLM's own scheduler, at a model's real shape, without the model.

Run in an interpreter where a vLLM is importable (its sources are enough: no GPU, no weights):

    python -m wmtp.measure.ring_blocks --model DIR --out ring_blocks.json --sink 16 --window 4096

``DIR`` is a checkpoint directory (a ``config.json``; ``wmtp.model.dummy`` writes one for each architecture). For
arms wmtp and wmtp-ring it builds what a server of that vLLM would build before its first request:

- the engine config, from vLLM's own ``EngineArgs`` (on a machine with no GPU, under vLLM's CPU platform), with
  the attention block size set as the engine's executor sets it for a hybrid model;
- each layer's KV cache spec, as the model's layers make theirs (full attention, and the Gated DeltaNet states
  whose shapes vLLM's model class computes), with the ring's spec for the draft layer from ``wmtp.plugin.ring``;
- the KV cache groups and the pool, by vLLM's ``get_kv_cache_configs``, at a KV memory chosen as the admission
  proof chooses it (``wmtp.measure.admission.kv_bytes_for``): wmtp fits N requests of ``max_model_len``, the
  ring N + 1.

Then N + 1 requests arrive at once and vLLM's ``Scheduler`` schedules them step by step, through its own
``allocate_slots`` and the ring's manager, while this module plays the model: a prefill step samples nothing,
a decode step accepts a fixed pattern of the drafts and proposes k more. After each step it reads the
scheduler's state: requests running and waiting, preemptions, the pool's free blocks and the draft group's
blocks per request; after each scheduling it counts the draft blocks already freed that a step in flight may still
read (``freed_but_readable``: none, if the ring is right). What the GPU then has to show is the same count with
real kernels; what this shows is that the KV manager admits it, frees what it should and never holds more than the
ring's bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from wmtp.measure.admission import AdmissionUnsized, kv_bytes_for, step_times, summarize_steps, verdict

log = logging.getLogger(__name__)

RESULT = "WMTP-RING-BLOCKS "
# The vLLM series whose engine core's start-up this module repeats (later ones resolve a KV layout with their
# workers first, and name things otherwise).
ENGINE_CORE_SERIES = "0.24."
DEFAULT_N = 2
# Accepted drafts per decode step, cycled: every count from none to all k appears.
ACCEPT_PATTERN = (3, 0, 2, 1)


def overlap_tokens(n: int, prompt_tokens: int, chunk: int, k: int) -> int:
    """Output tokens that keep the first request decoding until the last of ``n + 1`` has been admitted.

    A long prompt takes the whole token budget of ``ceil(prompt / chunk)`` steps, so the requests prefill one
    after another; the first one must not finish before the other ``n`` have prefilled, even when every step
    accepts all ``k`` drafts (k + 1 tokens a step). Without this the requests never all run at once, whatever
    the KV memory.
    """
    return n * -(-prompt_tokens // chunk) * (k + 1) + 1


def accepted(step: int, drafts: int) -> int:
    """How many of a decode step's ``drafts`` the stand-in model accepts at its ``step``-th decode."""
    return min(ACCEPT_PATTERN[step % len(ACCEPT_PATTERN)], drafts)


# --------------------------------------------------------------------------------------------------
# The engine side (imports vLLM)


def _platform() -> str:
    """vLLM's platform here; on a machine without a GPU, vLLM's CPU platform (config only, no kernels run)."""
    import vllm.platforms as platforms

    if not platforms.current_platform.device_type:
        from vllm.platforms.cpu import CpuPlatform

        platforms._current_platform = CpuPlatform()
    return type(platforms.current_platform).__name__


def engine_config(args: argparse.Namespace, ring: bool) -> Any:
    platform = _platform()  # before vLLM's modules that import the platform by name
    from vllm.engine.arg_utils import EngineArgs

    engine_args = EngineArgs(
        model=str(args.model),
        dtype="bfloat16",
        load_format="dummy",
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.chunk,
        max_num_seqs=args.n + 1,
        enable_prefix_caching=False,
        async_scheduling=args.async_scheduling,
        speculative_config={"method": "mtp", "num_speculative_tokens": args.k},
        additional_config={"wmtp": {"sink": args.sink, "window": args.window, "ring": ring}},
    )
    config = engine_args.create_engine_config()
    # vLLM's CPU platform turns async scheduling off; the stand-in for a GPU keeps what was asked for.
    config.scheduler_config.async_scheduling = args.async_scheduling
    from vllm.platforms import current_platform
    from vllm.platforms.interface import Platform

    # What vLLM's executors do before the workers report their specs: a hybrid model's attention block grows
    # until one page holds a Gated DeltaNet state, in multiples of the attention kernel's block. Without a GPU,
    # the kernel is the one a CUDA server of this vLLM picks for these heads: FlashAttention.
    if current_platform.is_cuda():
        current_platform.update_block_size_for_backend(config)
    else:
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

        class CudaBlockSizes(Platform):
            @classmethod
            def _find_non_ssm_backend(cls, vllm_config: Any) -> Any:
                return FlashAttentionBackend

        config.cache_config.block_size = config.cache_config.DEFAULT_BLOCK_SIZE
        Platform.update_block_size_for_backend.__func__(CudaBlockSizes, config)
    log.info("%s: block size %d", platform, config.cache_config.block_size)
    return config


def layer_specs(config: Any, ring: bool, sink: int, window: int, free_lag: int | None = None) -> dict[str, Any]:
    """Each layer's KV cache spec as the model's layers make theirs; the draft layer's through the ring."""
    import torch
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from wmtp.plugin import window as win

    model = config.model_config
    cache = config.cache_config
    model_cls, _ = ModelRegistry.resolve_model_cls(model.architecture, model_config=model)
    hf = model.hf_config
    k = config.speculative_config.num_speculative_tokens
    attention = FullAttentionSpec(
        block_size=cache.block_size,
        num_kv_heads=model.get_num_kv_heads(config.parallel_config),
        head_size=model.get_head_size(),
        dtype=torch.bfloat16,
    )
    recurrent = MambaSpec(
        shapes=tuple(model_cls.get_mamba_state_shape_from_config(config)),
        dtypes=tuple(model_cls.get_mamba_state_dtype_from_config(config)),
        block_size=cache.mamba_block_size or cache.block_size,
        page_size_padded=cache.mamba_page_size_padded,
        mamba_type="gdn_attention",
        mamba_cache_mode=cache.mamba_cache_mode,
        num_speculative_blocks=k,
    )
    specs: dict[str, Any] = {}
    for index, kind in enumerate(hf.layer_types):
        specs[f"model.layers.{index}"] = attention if kind == "full_attention" else recurrent
    draft = attention
    if ring:
        from wmtp.plugin import ring as ring_module

        draft = ring_module.sink_window_spec(attention, win.WindowConfig(sink=sink, window=window, ring=True), config)
        if free_lag is not None:
            draft = dataclasses.replace(draft, free_lag=free_lag)
    specs["mtp.layers.0.self_attn.attn"] = draft
    return specs


def kv_cache_config(config: Any, specs: dict[str, Any], kv_bytes: int) -> Any:
    """The scheduler's KV cache config at ``kv_bytes``, and the cache config updated, as vLLM's engine core does."""
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, get_kv_cache_configs

    config.cache_config.kv_cache_memory_bytes = kv_bytes
    kv = generate_scheduler_kv_cache_config(get_kv_cache_configs(config, [specs], [kv_bytes]))
    config.cache_config.num_gpu_blocks = kv.num_blocks
    config.cache_config.block_size = min(g.kv_cache_spec.block_size for g in kv.kv_cache_groups)
    return kv


def capacity(config: Any, kv: Any) -> dict[str, Any]:
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    groups = []
    for group in kv.kv_cache_groups:
        groups.append(f"{type(group.kv_cache_spec).__name__} ×{len(group.layer_names)}")
    concurrency = get_max_concurrency_for_kv_cache_config(config, kv)
    return {
        "groups": len(kv.kv_cache_groups),
        "group_kinds": sorted(set(groups)),
        "num_blocks": kv.num_blocks,
        "max_concurrency": concurrency,
    }


def _scheduler(config: Any, kv: Any) -> Any:
    """The scheduler class the engine core would start (async or not), built as the engine core builds it."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.structured_output import StructuredOutputManager

    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv, config)
    return config.scheduler_config.get_scheduler_cls()(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=scheduler_block_size,
        hash_block_size=hash_block_size,
    )


def freed_but_readable(manager: Any, batches: list[dict[str, int]]) -> int:
    """Draft blocks already freed that a step in flight may still read, counted after each scheduling.

    A step's draft reads from W tokens before the first token it computes; no later step starts before it. So for
    each request the oldest step in flight (``batches``: each step's first token per request) sets where reading
    begins, and no block from there on may be vLLM's null block. The sink's blocks are never freed.
    """
    window = getattr(manager.kv_cache_spec, "window", None)
    if window is None:
        return 0
    earliest: dict[str, int] = {}
    for starts in batches:
        for rid, start in starts.items():
            earliest[rid] = min(start, earliest.get(rid, start))
    found = 0
    for rid, start in earliest.items():
        blocks = manager.req_to_blocks.get(rid, [])
        first = max(start - window, 0) // manager.block_size
        found += sum(1 for block in blocks[first:] if block.is_null)
    return found


def stand_in_output(scheduler: Any, out: Any, decodes: int) -> Any:
    """What the model returns for a scheduled step: nothing for a prefill chunk short of the prompt's end, and for
    a decode the accepted drafts (``accepted``) and one token more."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        request = scheduler.requests[rid]
        if request.num_computed_tokens < request.num_prompt_tokens:
            sampled.append([])
            continue
        proposed = out.scheduled_spec_decode_tokens.get(rid, [])
        sampled.append([7] * accepted(decodes, len(proposed)) + [7])
        decodes += 1
    return ModelRunnerOutput(
        req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)}, sampled_token_ids=sampled
    )


def serve(config: Any, kv: Any, prompt_tokens: int, output_tokens: int, requests: int) -> dict[str, Any]:
    """Schedule ``requests`` prompts of ``prompt_tokens`` at once until they finish; the scheduler's own state
    after every step.

    Steps go through a queue as deep as the engine's concurrent batches, as vLLM's engine core runs them: under
    async scheduling the next step is scheduled before the last one's tokens are back, its drafts placeholders.
    """
    import time
    from collections import deque

    from vllm import SamplingParams
    from vllm.v1.outputs import DraftTokenIds
    from vllm.v1.request import Request

    scheduler = _scheduler(config, kv)
    in_flight = config.max_concurrent_batches
    k = config.speculative_config.num_speculative_tokens
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    for i in range(requests):
        scheduler.add_request(Request(str(i), [1 + (j % 1000) for j in range(prompt_tokens)], params, None))
    pool = scheduler.kv_cache_manager.block_pool
    draft_group = next(
        i for i, g in enumerate(kv.kv_cache_groups) if any(name.startswith("mtp.") for name in g.layer_names)
    )
    draft_manager = scheduler.kv_cache_manager.coordinator.single_type_managers[draft_group]
    batches: deque[tuple[Any, Any, dict[str, int]]] = deque()
    unread = 0
    steps: list[dict[str, float]] = []
    draft_held: list[int] = []
    preemptions = decodes = 0
    finished: set[str] = set()
    # The scheduler's own host time in steps that only decode (schedule plus update), per batch size.
    decode_us: list[tuple[int, float]] = []
    while len(finished) < requests:
        if len(steps) > 100 * requests * (prompt_tokens + output_tokens):
            raise RuntimeError(f"the scheduler ran {len(steps)} steps and {len(finished)} of {requests} finished")
        if scheduler.has_requests() and len(batches) < in_flight:
            starts = {rid: request.num_computed_tokens for rid, request in scheduler.requests.items()}
            started = time.perf_counter()
            out = scheduler.schedule()
            schedule_s = time.perf_counter() - started
            starts = {rid: starts.get(rid, 0) for rid in out.num_scheduled_tokens}
            unread += freed_but_readable(draft_manager, [*(b[2] for b in batches), starts])
            preemptions += len(getattr(out, "preempted_req_ids", None) or ())
            result = stand_in_output(scheduler, out, decodes)
            decodes += sum(1 for tokens in result.sampled_token_ids if tokens)
            batches.append((out, result, starts))
            if len(batches) < in_flight and scheduler.has_requests():
                continue
        out, result, _ = batches.popleft()
        started = time.perf_counter()
        updated = scheduler.update_from_output(out, result)
        if all(result.sampled_token_ids) and in_flight == 1:
            decode_us.append((len(result.req_ids), 1e6 * (schedule_s + time.perf_counter() - started)))
        for engine_outputs in updated.values():
            for output in engine_outputs.outputs:
                if output.finish_reason is not None:
                    finished.add(output.request_id)
        if in_flight == 1:
            # Without async scheduling the drafter's proposals come back after the step; with it, the scheduler
            # has already put placeholders in their place.
            live = [rid for rid, tokens in zip(result.req_ids, result.sampled_token_ids, strict=True) if tokens]
            live = [rid for rid in live if rid in scheduler.requests and rid not in finished]
            if live:
                scheduler.update_draft_token_ids(DraftTokenIds(live, [[7] * k for _ in live]))
        for rid in result.req_ids:
            if rid in draft_manager.req_to_blocks:
                draft_held.append(sum(not b.is_null for b in draft_manager.req_to_blocks[rid]))
        steps.append(
            {
                "running": float(len(scheduler.running)),
                "waiting": float(len(scheduler.waiting)),
                "preemptions": float(preemptions),
                "free": float(pool.get_num_free_blocks()),
            }
        )
    return {
        **summarize_steps(steps, requests),
        "finished": len(finished),
        "draft_manager": type(draft_manager).__name__,
        "draft_blocks_held_max": max(draft_held, default=0),
        "draft_blocks_limit": getattr(draft_manager.kv_cache_spec, "max_blocks_per_request", None),
        "draft_free_lag": getattr(draft_manager.kv_cache_spec, "free_lag", None),
        # Blocks freed where a step in flight (or the one just scheduled) can still read: none, if the ring is right.
        "freed_but_readable": unread,
        "min_free_blocks": int(min(s["free"] for s in steps)),
        # Timed here only without async scheduling, where a step's schedule and update are one after the other.
        "scheduler_us_per_decode_step": step_times(decode_us),
    }


def model_name(model: Path) -> str:
    """The architecture a dummy checkpoint stands for (its wmtp-model.json), else the folder's name."""
    manifest = model / "wmtp-model.json"
    if manifest.exists():
        return json.loads(manifest.read_text()).get("architecture") or model.name
    return model.name


def run(args: argparse.Namespace) -> dict[str, Any]:
    import vllm

    if not vllm.__version__.startswith(ENGINE_CORE_SERIES):
        raise SystemExit(
            f"wmtp.measure.ring_blocks repeats vLLM {ENGINE_CORE_SERIES}x's engine core start-up; this is vLLM "
            f"{vllm.__version__} ({vllm.__file__}): put those sources first on PYTHONPATH (make engine fetches them)"
        )

    out: dict[str, Any] = {
        "vllm": vllm.__version__,
        "model": model_name(args.model),
        "n": args.n,
        "sink": args.sink,
        "window": args.window,
        "k": args.k,
        "max_model_len": args.max_model_len,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.tokens,
        "chunk": args.chunk,
        "async_scheduling": args.async_scheduling,
        "arms": {},
    }
    configs, specs, per_request = {}, {}, {}
    for arm, ring in (("wmtp", False), ("wmtp-ring", True)):
        configs[arm] = engine_config(args, ring)
        specs[arm] = layer_specs(configs[arm], ring, args.sink, args.window, args.free_lag)
        probe = capacity(configs[arm], kv_cache_config(configs[arm], specs[arm], args.probe_bytes))
        per_request[arm] = args.probe_bytes / probe["max_concurrency"]
    out["block_size"] = configs["wmtp"].cache_config.block_size
    out["platform"] = _platform()
    out["bytes_per_request"] = per_request
    out["reclaimed_fraction"] = 1 - per_request["wmtp-ring"] / per_request["wmtp"]
    try:
        kv_bytes = kv_bytes_for(args.n, per_request["wmtp"], per_request["wmtp-ring"])
    except AdmissionUnsized as err:
        return {**out, "kv_cache_memory_bytes": None, "verdict": f"not sizeable: {err}"}
    out["kv_cache_memory_bytes"] = kv_bytes
    for arm in ("wmtp", "wmtp-ring"):
        kv = kv_cache_config(configs[arm], specs[arm], kv_bytes)
        out["arms"][arm] = {
            **capacity(configs[arm], kv),
            **serve(configs[arm], kv, args.prompt_tokens, args.tokens, args.n + 1),
        }
    out["verdict"] = verdict(out["arms"]["wmtp"], out["arms"]["wmtp-ring"])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a checkpoint directory (config.json)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sink", type=int, default=16)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--n", type=int, default=DEFAULT_N, help="requests wmtp admits; the ring should admit n + 1")
    parser.add_argument("--prompt-tokens", type=int, default=1_040_000)
    parser.add_argument(
        "--tokens", type=int, default=None, help="generated tokens per request (default: enough to overlap all)"
    )
    parser.add_argument("--chunk", type=int, default=8192, help="prefill chunk (max_num_batched_tokens)")
    parser.add_argument("--async-scheduling", action="store_true", help="as vLLM serves by default on a GPU")
    parser.add_argument("--probe-bytes", type=int, default=64 << 30, help="KV memory of the sizing configs")
    parser.add_argument(
        "--free-lag",
        type=int,
        help="the ring's lag in tokens instead of its own (a control: too small a lag frees early)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    if args.tokens is None:
        args.tokens = overlap_tokens(args.n, args.prompt_tokens, args.chunk, args.k)
    # The admission proof's own rule (wmtp.measure.admission.prompt_length): every step keeps its whole draft.
    args.max_model_len = args.prompt_tokens + args.tokens + args.k + 1
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(args.out)
    print(
        RESULT + json.dumps({"verdict": result["verdict"], "reclaimed": result.get("reclaimed_fraction")}), flush=True
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
