"""Two tiny model shapes for the replica's tests (a Gated-DeltaNet MoE and a Mamba2 MoE): shared by
test_replica.py and replica_triton_checks.py, which runs without pytest."""

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
