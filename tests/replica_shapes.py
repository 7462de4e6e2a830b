"""What the replica's tests share (two tiny model shapes, a Gated-DeltaNet MoE and a Mamba2 MoE, random inputs
and the relative error): used by test_replica.py and by replica_triton_checks.py, which runs without pytest."""

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def fresh(hq=8, hkv=2, d=32, n=300, t=3, dtype=torch.bfloat16):
    """Fresh random inputs every call (no fixed seed): the kernel must be right on any input."""
    kc = torch.randn(n + t, hkv, d, dtype=dtype)
    vc = torch.randn(n + t, hkv, d, dtype=dtype)
    q = torch.randn(hq, t, d, dtype=dtype)
    return q, kc, vc


def gdn_inputs(t=3, hk=2, hv=4, dk=8, dv=4):
    return (
        torch.randn(t, hk, dk),
        torch.randn(t, hk, dk),
        torch.randn(t, hv, dv),
        torch.randn(t, hv),
        torch.randn(t, hv),
        torch.rand(hv),
        torch.rand(hv),
    )


TINY_GDN = {
    "name": "tiny-gdn-moe",
    "hidden_size": 64,
    "vocab_size": 97,
    "layer_pattern": "LLLA",
    "pattern_legend": {"L": ["gdn", "moe"], "A": ["attn", "moe"]},
    "attention": {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 16, "output_gate": True},
    "gdn": {"num_k_heads": 2, "num_v_heads": 4, "k_head_dim": 16, "v_head_dim": 16, "conv_kernel": 4},
    "moe": {
        "num_experts": 16,
        "top_k": 2,
        "expert_intermediate_size": 32,
        "activation": "swiglu",
        "latent_size": None,
        "shared_experts": 1,
        "shared_intermediate_size": 32,
        "shared_expert_gate": True,
    },
    "mtp": {"num_layers": 1, "layer_pattern": "A"},
}
TINY_MAMBA = {
    "name": "tiny-mamba2-moe",
    "hidden_size": 64,
    "vocab_size": 97,
    "layer_pattern": "ME*E",
    "pattern_legend": {"M": ["mamba2"], "E": ["moe"], "*": ["attn"]},
    "attention": {"num_q_heads": 8, "num_kv_heads": 2, "head_dim": 16, "output_gate": False},
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 2, "state_size": 16, "conv_kernel": 4},
    "moe": {
        "num_experts": 32,
        "top_k": 4,
        "expert_intermediate_size": 24,
        "activation": "relu2",
        "latent_size": 32,
        "shared_experts": 1,
        "shared_intermediate_size": 48,
        "shared_expert_gate": False,
    },
    "mtp": {"num_layers": 1, "layer_pattern": "*E"},
}
