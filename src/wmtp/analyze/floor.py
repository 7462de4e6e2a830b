"""The bytes/bandwidth floor of a replica step, per component, for a batch of requests (torch-free).

A decode step is memory-bound: each component's floor is the bytes it must move divided by the
measured copy bandwidth.  At batch 1 the total is the cost model's step
(:func:`wmtp.analyze.costmodel.step_cost`); a batch of B requests at the same context reads the
weights a forward over B times as many tokens touches (more distinct experts, still once), and B
times the KV and recurrent state.  The components match those the sweep times.
"""

from __future__ import annotations

from wmtp.analyze import costmodel as cm

#: Components of a step, in the order the sweep times them; the draft's are summed over its k forwards.
COMPONENTS = ("target_attn", "target_other", "lm_head", "draft_attn", "draft_other", "draft_lm_head")


def _state_bytes(spec: cm.ModelSpec, query_tokens: int) -> float:
    """One request's recurrent state per verify: read once, one write per query token, conv read + write."""
    total = 0.0
    for comp in ("gdn", "mamba2"):
        ssm, conv = cm.recurrent_state_bytes(spec, comp)
        total += spec.count(comp) * (ssm * (1 + query_tokens) + 2 * conv)
    return total


def step_bytes(
    spec: cm.ModelSpec, context: int, k: int, arm: str, *, batch: int = 1, sink: int = 0, window: int = 0
) -> dict[str, float]:
    """Bytes of each component of one step of ``arm`` over ``batch`` requests at ``context`` tokens."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1 (got {batch})")
    t = 1 if arm == "none" else k + 1
    drafts = 0 if arm == "none" else k
    wb, h = spec.weight_bytes, spec.hidden_size
    kv_tok = cm.kv_bytes_per_token_layer(spec)
    tokens = batch * t
    target_weights = sum(cm.layer_params_touched(spec, parts, tokens) for parts in spec.layers) * wb
    draft_weights = sum(cm.layer_params_touched(spec, parts, batch) for parts in spec.mtp_layers)
    if spec.mtp_fusion_proj:
        draft_weights += spec.mtp_blocks * 2 * h * h
    draft_arm = "mtp" if arm == "none" else arm
    draft_kv = spec.n_draft_attn * (cm.draft_kv_tokens(context, draft_arm, sink, window) + 1) * kv_tok  # type: ignore[arg-type]
    lm = float(cm.lm_head_bytes(spec))
    return {
        "target_attn": batch * spec.n_attn * (context + 2 * t) * kv_tok,  # read all visible, write the new
        "target_other": target_weights + tokens * h * wb + batch * _state_bytes(spec, t),
        "lm_head": lm,
        "draft_attn": drafts * batch * draft_kv,
        "draft_other": drafts * (draft_weights * wb + batch * h * wb),
        "draft_lm_head": drafts * lm,
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
    return nat / win


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
