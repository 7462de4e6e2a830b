"""The roofline cost model against cases computed by hand (one per architecture family)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wmtp.analyze import costmodel as cm
from wmtp.analyze import floor as fl

MODELS = Path(__file__).resolve().parents[1] / "config" / "models"

# Tiny GDN-MoE hybrid: one Gated-DeltaNet+MoE layer, one attention+MoE layer, MTP = one "A" layer.
GDN_MOE = {
    "name": "tiny-gdn-moe",
    "family": "gdn_moe",
    "hidden_size": 8,
    "vocab_size": 16,
    "layer_pattern": "LA",
    "pattern_legend": {"L": ["gdn", "moe"], "A": ["attn", "moe"]},
    "attention": {"num_q_heads": 2, "num_kv_heads": 1, "head_dim": 4, "output_gate": True},
    "gdn": {"num_k_heads": 1, "num_v_heads": 2, "k_head_dim": 2, "v_head_dim": 2, "conv_kernel": 4},
    "mamba2": None,
    "moe": {
        "num_experts": 4,
        "top_k": 2,
        "expert_intermediate_size": 3,
        "activation": "swiglu",
        "latent_size": None,
        "shared_experts": 1,
        "shared_intermediate_size": 2,
        "shared_expert_gate": True,
    },
    "mtp": {"num_layers": 1, "layer_pattern": "A", "fusion_proj": True},
    "dtypes": {
        "weights": "bfloat16",
        "kv": "bfloat16",
        "recurrent_state": "float32",
        "conv_state": "bfloat16",
    },
}

# Tiny Mamba2 hybrid with a latent MoE: M, E, *, E; MTP = "*E".
MAMBA2_MOE = {
    "name": "tiny-mamba2-moe",
    "family": "mamba2_moe",
    "hidden_size": 8,
    "vocab_size": 16,
    "layer_pattern": "ME*E",
    "pattern_legend": {"M": ["mamba2"], "E": ["moe"], "*": ["attn"]},
    "attention": {"num_q_heads": 2, "num_kv_heads": 1, "head_dim": 4, "output_gate": False},
    "gdn": None,
    "mamba2": {"num_heads": 2, "head_dim": 2, "n_groups": 1, "state_size": 2, "conv_kernel": 4},
    "moe": {
        "num_experts": 8,
        "top_k": 2,
        "expert_intermediate_size": 3,
        "activation": "relu2",
        "latent_size": 4,
        "shared_experts": 1,
        "shared_intermediate_size": 5,
        "shared_expert_gate": False,
    },
    "mtp": {"num_layers": 1, "layer_pattern": "*E", "fusion_proj": True},
    "dtypes": {
        "weights": "bfloat16",
        "kv": "bfloat16",
        "recurrent_state": "float32",
        "conv_state": "bfloat16",
    },
}


def test_gdn_moe_hand_computed():
    # Elements: attn 8*16 + 8*8 + 8*8 = 256; gdn 8*12 + 8*4 + 8*4 + 4*8 = 192;
    # expert 3*8*3 = 72; MoE dense = router 32 + shared 48 + gate 8 = 88.
    # Verify, T = 4: distinct experts 4*(1 - 0.5**4) = 3.75 -> MoE 88 + 270 = 358 per layer;
    # weights (192 + 358 + 256 + 358) * 2 B + 4 embedding rows * 16 B = 2392 B.
    # KV: 16 B/token/layer; read 104 tokens, write 4 -> 1728 B. State: ssm 32 B read + 4 writes,
    # conv 48 B read + write -> 256 B. lm_head 16*8*2 = 256 B. Verify = 4632 B.
    # Draft: attn 256 + MoE(T=1) 88 + 2*72 + fusion 128 = 616 el -> 1232 B + 16 B embedding row;
    # KV native (101 read + 1 written) * 16 = 1632 B, windowed S=4,W=16 -> (20 + 1) * 16 = 336 B.
    p = cm.predict(GDN_MOE, 100, 3, 4, 16, bandwidth=1000.0)
    assert p.native.verify.weights == pytest.approx(2392)
    assert p.native.verify.kv == pytest.approx(1728)
    assert p.native.verify.state == pytest.approx(256)
    assert p.native.verify.lm_head == pytest.approx(256)
    assert p.native.verify.total == pytest.approx(4632)
    assert p.native.draft.total == pytest.approx(1248 + 1632 + 256)
    assert p.windowed.draft.total == pytest.approx(1248 + 336 + 256)
    assert p.native.time_s == pytest.approx(14.040)
    assert p.windowed.time_s == pytest.approx(10.152)
    assert p.ratio == pytest.approx(14040 / 10152)
    # KV memory at N=100: target 1600 B, draft 1600 B, state 32 + 48 B; the ring keeps 20 slots.
    assert p.kv.target_kv == 1600 and p.kv.draft_kv == 1600 and p.kv.state == 80
    assert p.draft_kv_share == pytest.approx(0.5)
    assert p.kv_ring.draft_kv == 320
    cap = cm.capacity(GDN_MOE, 100, 10_000, sink=4, window=16)
    assert (cap.per_request_bytes, cap.per_request_bytes_ring) == (3280, 2000)
    assert (cap.requests, cap.requests_ring) == (3, 5)


def test_gdn_moe_overhead_and_none_arm():
    p = cm.predict(GDN_MOE, 100, 3, 4, 16, bandwidth=1000.0, overhead_per_forward_s=0.5)
    assert p.native.time_s == pytest.approx(14.040 + 4 * 0.5)
    assert p.windowed.time_s == pytest.approx(10.152 + 4 * 0.5)
    # Plain decode: T = 1 -> distinct experts 2; weights (192+232+256+232)*2 + 16 = 1840 B;
    # KV (101 + 1) * 16 = 1632 B; state 32*2 + 96 = 160 B; lm_head 256 B.
    assert p.none.time_s == pytest.approx((1840 + 1632 + 160 + 256) / 1000.0 + 0.5)


def test_a_batch_reads_the_weights_once_and_each_requests_kv_and_state():
    # Two requests, verify T = 4: 8 tokens touch 4*(1 - 0.5**8) = 3.984375 experts -> MoE 88 + 286.875 per layer;
    # weights (192 + 374.875 + 256 + 374.875) * 2 B + 8 embedding rows * 16 B = 2523.5 B; KV and state twice
    # one request's (1728, 256 B); lm_head once. Draft, 2 tokens: 3 experts -> MoE 304; 256 + 304 + fusion 128
    # = 688 el -> 1376 B + 2 rows * 16 B; KV twice one request's (1632 B native, 336 B windowed).
    spec = cm.model_from_dict(GDN_MOE)
    verify = cm.verify_bytes(spec, 100, 4, batch=2)
    assert (verify.weights, verify.kv, verify.state, verify.lm_head) == pytest.approx((2523.5, 3456, 512, 256))
    draft = cm.draft_bytes(spec, 100, "mtp", batch=2)
    assert (draft.weights, draft.kv, draft.lm_head) == pytest.approx((1408, 3264, 256))
    assert cm.draft_bytes(spec, 100, "wmtp", 4, 16, batch=2).kv == pytest.approx(672)
    # the floor's components are these bytes, the draft's over its k = 3 forwards
    parts = fl.step_bytes(spec, 100, 3, "mtp", batch=2)
    assert parts == pytest.approx(
        {"target_attn": 3456, "target_other": 2523.5 + 512, "lm_head": 256,
         "draft_attn": 3 * 3264, "draft_other": 3 * 1408, "draft_lm_head": 3 * 256}
    )  # fmt: skip
    with pytest.raises(ValueError, match="batch"):
        cm.verify_bytes(spec, 100, 4, batch=0)


def test_mamba2_latent_moe_hand_computed():
    # Elements: attn 64 + 64 + 64 = 192 (no gate); mamba2 in_proj 8*14 + conv 8*4 + out 4*8 = 176;
    # latent relu2 expert 2*4*3 = 24; MoE dense = router 64 + latent 2*8*4 + shared 2*8*5 = 208.
    # Verify, T = 4: distinct 8*(1 - 0.75**4) = 5.46875 -> MoE 339.25 per E layer;
    # weights (176 + 2*339.25 + 192) * 2 + 64 = 2157 B; KV 1728 B; state 32*5 + 2*48 = 256 B; lm 256 B.
    # Draft "*E": 192 + 208 + 2*24 + fusion 128 = 576 el -> 1152 + 16 B.
    p = cm.predict(MAMBA2_MOE, 100, 3, 4, 16, bandwidth=1000.0)
    assert p.native.verify.weights == pytest.approx(2157)
    assert p.native.verify.state == pytest.approx(256)
    assert p.native.verify.total == pytest.approx(4397)
    assert p.native.draft.total == pytest.approx(1168 + 1632 + 256)
    assert p.windowed.draft.total == pytest.approx(1168 + 336 + 256)
    assert p.ratio == pytest.approx((4397 + 3 * 3056) / (4397 + 3 * 1760))


def test_window_covers_short_context():
    p = cm.predict(GDN_MOE, 10, 3, 4, 16, bandwidth=1000.0)
    assert p.ratio == pytest.approx(1.0)
    assert p.ring_reclaimed_fraction == pytest.approx(0.0)


def test_expected_distinct_experts():
    assert cm.expected_distinct_experts(256, 8, 1) == pytest.approx(8)
    assert cm.expected_distinct_experts(256, 8, 0) == 0
    assert cm.expected_distinct_experts(256, 8, 10_000) == pytest.approx(256)
    assert cm.expected_distinct_experts(256, 8, 4) == pytest.approx(256 * (1 - (1 - 8 / 256) ** 4))


@pytest.mark.parametrize(
    ("fname", "n_attn", "share", "limit_k3"),
    [
        ("qwen3.6-35b-a3b.json", 10, 1 / 11, 1.30),
        ("qwen3.5-122b-a10b.json", 12, 1 / 13, 1.25),
        ("qwen3-next-80b-a3b.json", 12, 1 / 13, 1.25),
        ("nemotron-3-super-120b-a12b.json", 8, 1 / 9, 1.375),
    ],
)
def test_shipped_models(fname, n_attn, share, limit_k3):
    spec = cm.load_model(MODELS / fname)
    assert spec.n_attn == n_attn
    assert spec.n_draft_attn == 1
    assert cm.limit_ratio(spec, 3) == pytest.approx(limit_k3)
    p = cm.predict(spec, 1 << 20, 3, 4, 2048)
    # the draft's share of KV is what the paper's ring reclaims (7.7-11.1 %)
    assert p.draft_kv_share == pytest.approx(share)
    assert 1.0 < p.ratio < limit_k3
    assert json.loads((MODELS / fname).read_text())["source"]


def test_nemotron_parameter_count_matches_published():
    spec = cm.load_model(MODELS / "nemotron-3-super-120b-a12b.json")
    # safetensors totals quoted in public code: 123,611,012,096 bf16 weights, MTP 2,942,324,736
    assert cm.total_params(spec) == pytest.approx(123_611_012_096, rel=1e-4)
    mtp = cm.total_params(spec) - cm.total_params(spec, include_mtp=False)
    assert mtp == pytest.approx(2_942_324_736, rel=1e-4)


def test_errors_name_the_field():
    with pytest.raises(ValueError, match="arm must be"):
        cm.step_cost(GDN_MOE, 100, 3, "eagle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="k must be >= 1"):
        cm.step_cost(GDN_MOE, 100, 0, "mtp")
    bad = dict(GDN_MOE, layer_pattern="LX")
    with pytest.raises(ValueError, match=r"layer_pattern\[1\]"):
        cm.model_from_dict(bad)


@pytest.mark.parametrize("fname", ["qwen3.6-35b-a3b.json", "nemotron-3-super-120b-a12b.json"])
@pytest.mark.parametrize("arm", ["none", "mtp", "wmtp"])
def test_a_cycles_components_as_a_trace_splits_them_sum_to_its_bytes(fname, arm):
    spec = cm.load_model(MODELS / fname)
    whole = fl.step_bytes(spec, 131_072, 3, arm, sink=16, window=4096)
    parts = fl.cycle_component_bytes(spec, 131_072, 3, arm, sink=16, window=4096)
    assert sum(parts.values()) == pytest.approx(sum(whole.values()))
    assert all(value >= 0 for value in parts.values())
    assert parts["target_attn"] == whole["target_attn"] and parts["draft_attn"] == whole["draft_attn"]
    # Every lm_head of the cycle: the target's and one a draft forward.
    assert parts["lm_head"] == pytest.approx((1 + (0 if arm == "none" else 3)) * cm.lm_head_bytes(spec))
    # The recurrent kernels move the state, not the projections' weights (those are GEMMs).
    assert parts["target_gdn"] == pytest.approx(cm.verify_bytes(spec, 131_072, 1 if arm == "none" else 4).state)


def test_the_routed_experts_a_verify_touches_grow_with_its_tokens():
    spec = cm.load_model(MODELS / "qwen3.6-35b-a3b.json")
    one = fl.cycle_component_bytes(spec, 131_072, 3, "none")["target_moe"]
    four = fl.cycle_component_bytes(spec, 131_072, 3, "mtp")["target_moe"]
    assert 1 < four / one < 4
