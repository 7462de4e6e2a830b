"""The bytes/bandwidth floor of a decode step, per component, for a batch of requests (torch-free).

A decode step is memory-bound: each component's floor is the bytes it must move divided by the
measured copy bandwidth.  The bytes are the cost model's (:func:`wmtp.analyze.costmodel.verify_bytes`
and :func:`~wmtp.analyze.costmodel.draft_bytes`, batch-aware), split into the components the replica's
sweep times; at batch 1 their total is the cost model's step (:func:`wmtp.analyze.costmodel.step_cost`).
"""

from __future__ import annotations

from wmtp.analyze import costmodel as cm
from wmtp.analyze.analysis import cost_side_ratio

#: Components of a step, in the order the sweep times them; the draft's are summed over its k forwards.
COMPONENTS = ("target_attn", "target_other", "lm_head", "draft_attn", "draft_other", "draft_lm_head")


def step_bytes(
    spec: cm.ModelSpec, context: int, k: int, arm: str, *, batch: int = 1, sink: int = 0, window: int = 0
) -> dict[str, float]:
    """Bytes of each component of one step of ``arm`` over ``batch`` requests at ``context`` tokens;
    ``target_other`` is the target's touched weights, its embedding rows and the recurrent state."""
    drafts = 0 if arm == "none" else k
    verify = cm.verify_bytes(spec, context, 1 if arm == "none" else k + 1, batch=batch)
    draft_arm = "mtp" if arm == "none" else arm
    draft = cm.draft_bytes(spec, context, draft_arm, sink, window, batch=batch)  # type: ignore[arg-type]
    return {
        "target_attn": verify.kv,
        "target_other": verify.weights + verify.state,
        "lm_head": float(verify.lm_head),
        "draft_attn": drafts * draft.kv,
        "draft_other": drafts * draft.weights,
        "draft_lm_head": drafts * float(draft.lm_head),
    }


def cycle_component_bytes(
    spec: cm.ModelSpec, context: int, k: int, arm: str, *, sink: int = 0, window: int = 0
) -> dict[str, float]:
    """Bytes of each part of one decode cycle of one request, split as a traced cycle's kernels are
    (:data:`wmtp.analyze.traces.STEP_COMPONENTS`): the target's attention (its KV); its recurrent kernels (the
    recurrent state they read and write; their projections are GEMMs); its routed experts (the fused MoE kernels);
    the rest of its weights (every dense GEMM: projections, shared experts, router; embedding rows); every lm_head of
    the cycle, the target's and each draft forward's; the draft's attention (its KV) and the rest of its forwards
    (their weights). They sum to :func:`step_bytes`."""
    parts = step_bytes(spec, context, k, arm, sink=sink, window=window)
    tokens = 1 if arm == "none" else k + 1
    state = cm.verify_bytes(spec, context, tokens).state
    per_weight = spec.quantized_bytes if "moe" in spec.quantized_parts else spec.weight_bytes
    m = spec.moe
    experts = cm.expected_distinct_experts(m.num_experts, m.top_k, tokens) * cm.expert_params(spec) * per_weight
    routed = spec.count("moe") * experts
    return {
        "target_attn": parts["target_attn"],
        "target_gdn": state,
        "target_moe": routed,
        "target_other": parts["target_other"] - state - routed,
        "lm_head": parts["lm_head"] + parts["draft_lm_head"],
        "draft_attn": parts["draft_attn"],
        "draft_other": parts["draft_other"],
    }


def step_floor_ms(
    spec: cm.ModelSpec,
    context: int,
    k: int,
    arm: str,
    bandwidth: float,
    *,
    batch: int = 1,
    sink: int = 0,
    window: int = 0,
) -> dict[str, float]:
    """Each component's floor in ms at ``bandwidth`` bytes/s, and ``step`` (their sum)."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s (got {bandwidth})")
    parts = step_bytes(spec, context, k, arm, batch=batch, sink=sink, window=window)
    out = {name: b / bandwidth * 1e3 for name, b in parts.items()}
    out["step"] = sum(out[name] for name in COMPONENTS)
    return out


def predicted_ratio(
    spec: cm.ModelSpec, context: int, k: int, bandwidth: float, *, batch: int = 1, sink: int = 0, window: int = 0
) -> float:
    """The cost-side ratio the floor predicts: native step over windowed step."""
    nat = step_floor_ms(spec, context, k, "mtp", bandwidth, batch=batch, sink=sink, window=window)["step"]
    win = step_floor_ms(spec, context, k, "wmtp", bandwidth, batch=batch, sink=sink, window=window)["step"]
    return cost_side_ratio(nat, win)


def replica_bytes(spec: cm.ModelSpec, context: int, max_k: int, batch: int) -> float:
    """Device memory the replica needs: touched weights, every request's KV (target and draft), states."""
    t = max_k + 1
    h = spec.hidden_size
    w = sum(cm.layer_params_touched(spec, p, batch * t) for p in spec.layers)
    w += sum(cm.layer_params_touched(spec, p, batch) for p in spec.mtp_layers) + 2 * h * h
    w += 2 * spec.vocab_size * h
    kv = (spec.n_attn + spec.n_draft_attn) * (context + max_k + 2) * cm.kv_bytes_per_token_layer(spec)
    state = sum((t + 1) * cm.recurrent_state_bytes(spec, c)[0] * spec.count(c) for c in ("gdn", "mamba2"))
    return w * spec.weight_bytes * 1.1 + batch * (kv + state)


def largest_batch(spec: cm.ModelSpec, context: int, max_k: int, batches: list[int], free: float, slack: float) -> int:
    """The largest of ``batches`` whose replica fits in ``free`` bytes less ``slack``; 0 if none does."""
    fits = [b for b in batches if replica_bytes(spec, context, max_k, b) + slack < free]
    return max(fits, default=0)
