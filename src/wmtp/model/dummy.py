"""A weightless checkpoint of a real architecture, for measuring an engine's speed with dummy weights.

From an architecture facts file (config/models/<name>.json) it writes a Hugging Face checkpoint directory that
vLLM serves with ``--load-format dummy``: ``config.json`` of a Qwen3-Next (``Qwen3NextForCausalLM`` with its
MTP layers, the tiny model's config at the architecture's shape) for the ``gdn_moe`` family, or of a Nemotron-H
(``NemotronHForCausalLM``: Mamba-2, attention and latent-MoE layers in the facts file's pattern, with its MTP
pattern) for the ``mamba2_moe`` family, and a tokenizer, but no weight files.

The tokenizer is the committed tiny tokenizer (byte-level BPE on standard-library source, so code prompts keep
their exact lengths) with its vocabulary padded up to the architecture's: random weights generate any id below
``vocab_size``, and every one must decode. The padding entries have no BPE merge that makes them, so encoding never
produces one, and each decodes to a tab and its id (``"\\t<248319>"``), which the copy workload's draw of
printable vocabulary tokens leaves out.

With ``--quantization nvfp4`` the config also carries ModelOpt's NVFP4 ``quantization_config``, so vLLM builds
its layers as NVFP4 (on Hopper through its Marlin W4A16 kernels) and fills them with dummy 4-bit weights: the
bytes a step reads are an NVFP4 checkpoint's, and larger shapes fit one GPU. What it quantises is ModelOpt's recipe
for these hybrids (wmtp.analyze.costmodel.NVFP4_PARTS counts the same): the attention projections and the MoE's
experts, not the recurrent layers (Gated DeltaNet, Mamba-2), the routers, the lm_head or the MTP head.

Needs only ``tokenizers`` beyond the standard library: it runs in the pipeline's own environment.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from wmtp.layout import TRAINED_CHECKPOINT
from wmtp.model.tiny import TinyShape, write_tokenizer_config

log = logging.getLogger(__name__)

# Nemotron-H's letter for each layer the facts file's legend makes (hybrid_override_pattern): Mamba-2, attention,
# MoE.
NEMOTRON_LETTERS = {("mamba2",): "M", ("attn",): "*", ("moe",): "E"}
# What the facts file's layer_pattern legend calls a layer's mixer, and Qwen3-Next's layer_types for it.
MIXERS = {"gdn": "linear_attention", "attn": "full_attention"}
# The tokenizer the padded one starts from: small, committed, and trained on the workload's corpus.
BASE_TOKENIZER = TRAINED_CHECKPOINT / "tokenizer.json"
# The padding entries, in the byte-level alphabet: "ĉ" is the tab byte, so an entry decodes to "\t<id>".
PAD_TOKEN = "ĉ<{id}>"


QUANTIZATIONS = ("none", "nvfp4")
# Module names (fnmatch patterns over vLLM's layer prefixes) an NVFP4 checkpoint keeps at 16 bits, by family: the
# recurrent layers (Gated DeltaNet; Mamba-2's in and out projections), the routers (and Nemotron-H's latent
# projections around its experts), the lm_head and the MTP head.
NVFP4_KEPT = {
    "gdn_moe": ["lm_head", "*linear_attn*", "*mlp.gate", "*shared_expert_gate", "*mtp*"],
    "mamba2_moe": ["lm_head", "*mixer.in_proj", "*mixer.out_proj", "*mixer.gate", "*latent_proj", "*mtp*"],
}


def quantization_config(scheme: str, family: str = "gdn_moe") -> dict[str, Any] | None:
    """The ``quantization_config`` of a dummy checkpoint of ``family`` quantised as ``scheme`` ("none": no key at
    all)."""
    if scheme == "none":
        return None
    if scheme != "nvfp4":
        raise ArchitectureError(
            f"quantization {scheme!r}: a dummy checkpoint is written as {' or '.join(QUANTIZATIONS)}"
        )
    # ModelOpt's NVFP4 as vLLM reads it from config.json: 4-bit weights in groups of 16 with FP8 scales; the KV
    # cache stays 16-bit, as in the studies' unquantised checkpoints.
    return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": list(NVFP4_KEPT[family])}


class ArchitectureError(ValueError):
    """A facts file this generator cannot write a checkpoint of; the message names the file and the key."""


def shape_from_architecture(arch: Mapping[str, Any], max_position_embeddings: int, source: str) -> TinyShape:
    """The Qwen3-Next shape of a ``gdn_moe`` facts file; ``source`` (its path) names it in errors."""
    family = arch.get("family")
    if family != "gdn_moe":
        raise ArchitectureError(f"{source}: family {family!r} is not a Qwen3-Next (gdn_moe)")
    legend = arch["pattern_legend"]
    layer_types = []
    for i, letter in enumerate(arch["layer_pattern"]):
        mixer, ffn = legend[letter]
        if mixer not in MIXERS or ffn != "moe":
            raise ArchitectureError(
                f"{source}: layer_pattern[{i}] {letter!r} is {mixer} + {ffn}; Qwen3-Next layers are gdn or attn + moe"
            )
        layer_types.append(MIXERS[mixer])
    attention, gdn, moe = arch["attention"], arch["gdn"], arch["moe"]
    if moe.get("shared_experts") != 1:
        shared = moe.get("shared_experts")
        raise ArchitectureError(f"{source}: moe.shared_experts must be 1 for Qwen3-Next (got {shared})")
    return TinyShape(
        vocab_size=arch["vocab_size"],
        hidden_size=arch["hidden_size"],
        num_hidden_layers=len(layer_types),
        num_attention_heads=attention["num_q_heads"],
        num_key_value_heads=attention["num_kv_heads"],
        head_dim=attention["head_dim"],
        linear_key_head_dim=gdn["k_head_dim"],
        linear_value_head_dim=gdn["v_head_dim"],
        linear_num_key_heads=gdn["num_k_heads"],
        linear_num_value_heads=gdn["num_v_heads"],
        num_experts=moe["num_experts"],
        num_experts_per_tok=moe["top_k"],
        moe_intermediate_size=moe["expert_intermediate_size"],
        shared_expert_intermediate_size=moe["shared_intermediate_size"],
        max_position_embeddings=max_position_embeddings,
        layer_types=layer_types,
    )


def dummy_config(shape: TinyShape, mtp_layers: int, conv_kernel: int = 4) -> dict[str, Any]:
    """config.json of a Qwen3-Next at ``shape``: the keys and defaults that wmtp.model.tiny writes through
    transformers' Qwen3NextConfig (tests compare it with the committed tiny checkpoint's), without transformers."""
    layer_types = shape.resolved_layer_types()
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "decoder_sparse_step": 1,
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
        "eos_token_id": 0,
        "pad_token_id": 0,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "initializer_range": 0.02,
        # Every layer is MoE (mlp_only_layers is empty): the dense size is never built.
        "intermediate_size": 4 * shape.hidden_size,
        "layer_types": layer_types,
        "linear_conv_kernel_dim": conv_kernel,
        "linear_key_head_dim": shape.linear_key_head_dim,
        "linear_num_key_heads": shape.linear_num_key_heads,
        "linear_num_value_heads": shape.linear_num_value_heads,
        "linear_value_head_dim": shape.linear_value_head_dim,
        "max_position_embeddings": shape.max_position_embeddings,
        "mlp_only_layers": [],
        "moe_intermediate_size": shape.moe_intermediate_size,
        "norm_topk_prob": True,
        "num_attention_heads": shape.num_attention_heads,
        "num_experts": shape.num_experts,
        "num_experts_per_tok": shape.num_experts_per_tok,
        "num_hidden_layers": len(layer_types),
        "num_key_value_heads": shape.num_key_value_heads,
        "num_nextn_predict_layers": mtp_layers,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"partial_rotary_factor": 0.25, "rope_theta": 10000.0, "rope_type": "default"},
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": shape.shared_expert_intermediate_size,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": shape.vocab_size,
    }


def nemotron_pattern(pattern: str, legend: Mapping[str, Any], where: str) -> str:
    """A facts file's layer pattern in Nemotron-H's letters (M Mamba-2, * attention, E MoE)."""
    out = []
    for i, letter in enumerate(pattern):
        parts = tuple(legend[letter])
        if parts not in NEMOTRON_LETTERS:
            raise ArchitectureError(f"{where}[{i}] {letter!r} is {' + '.join(parts)}; Nemotron-H layers are one of "
                                    "mamba2, attn or moe")  # fmt: skip
        out.append(NEMOTRON_LETTERS[parts])
    return "".join(out)


def nemotron_config(arch: Mapping[str, Any], max_position_embeddings: int, source: str) -> dict[str, Any]:
    """config.json of a Nemotron-H (vLLM's NemotronHConfig keys) at a ``mamba2_moe`` facts file's shape: its layer
    and MTP patterns, Mamba-2 heads and groups, attention heads (no position embedding), and the latent MoE (routed
    experts in ``moe.latent_size``, the shared expert in the hidden size, ReLU² experts)."""
    if arch.get("family") != "mamba2_moe":
        raise ArchitectureError(f"{source}: family {arch.get('family')!r} is not a Nemotron-H (mamba2_moe)")
    legend, attention, mamba, moe, mtp = (arch[k] for k in ("pattern_legend", "attention", "mamba2", "moe", "mtp"))
    pattern = nemotron_pattern(arch["layer_pattern"], legend, f"{source}: layer_pattern")
    mtp_pattern = nemotron_pattern(mtp["layer_pattern"], legend, f"{source}: mtp.layer_pattern")
    if moe.get("shared_experts") != 1 or moe.get("activation") != "relu2":
        raise ArchitectureError(f"{source}: Nemotron-H's MoE has one shared expert and ReLU² experts (got "
                                f"{moe.get('shared_experts')}, {moe.get('activation')!r})")  # fmt: skip
    hidden = arch["hidden_size"]
    return {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "vocab_size": arch["vocab_size"],
        "tie_word_embeddings": bool(arch.get("tie_word_embeddings", False)),
        "hidden_size": hidden,
        "num_hidden_layers": len(pattern),
        "hybrid_override_pattern": pattern,
        "mtp_hybrid_override_pattern": mtp_pattern,
        "num_nextn_predict_layers": int(mtp["num_layers"]),
        "num_attention_heads": attention["num_q_heads"],
        "num_key_value_heads": attention["num_kv_heads"],
        "head_dim": attention["head_dim"],
        "attention_bias": False,
        "max_position_embeddings": max_position_embeddings,
        "mamba_num_heads": mamba["num_heads"],
        "mamba_head_dim": mamba["head_dim"],
        "mamba_n_groups": mamba["n_groups"],
        "ssm_state_size": mamba["state_size"],
        "mamba_d_conv": mamba["conv_kernel"],
        # Mamba-2's inner width over the hidden size, which vLLM sizes the in-projection by.
        "mamba_expand": mamba["num_heads"] * mamba["head_dim"] // hidden,
        "mamba_hidden_act": "silu",
        "n_routed_experts": moe["num_experts"],
        "num_experts_per_tok": moe["top_k"],
        "moe_intermediate_size": moe["expert_intermediate_size"],
        "n_shared_experts": 1,
        "moe_shared_expert_intermediate_size": moe["shared_intermediate_size"],
        "moe_latent_size": moe.get("latent_size"),
        "mlp_hidden_act": "relu2",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "layer_norm_epsilon": 1e-05,
        "use_cache": True,
    }


def padded_tokenizer(tokenizer: Mapping[str, Any], vocab_size: int) -> dict[str, Any]:
    """A BPE tokenizer.json whose vocabulary is padded with unreachable entries (PAD_TOKEN) up to ``vocab_size``."""
    vocab = dict(tokenizer["model"]["vocab"])
    ids = set(vocab.values()) | {t["id"] for t in tokenizer.get("added_tokens", [])}
    if ids != set(range(len(ids))):
        raise ArchitectureError("the base tokenizer's ids are not 0..n-1 without gaps; padding would leave holes")
    if vocab_size < len(ids):
        raise ArchitectureError(f"vocab_size {vocab_size} is below the base tokenizer's {len(ids)} tokens")
    for i in range(len(ids), vocab_size):
        vocab[PAD_TOKEN.format(id=i)] = i
    out = dict(tokenizer)
    out["model"] = {**tokenizer["model"], "vocab": vocab}
    return out


def write_dummy(
    architecture: Path, out_dir: Path, max_position_embeddings: int, quantization: str = "none"
) -> dict[str, Any]:
    """Write config.json, tokenizer.json, tokenizer_config.json and wmtp-model.json; returns the config."""
    arch = json.loads(architecture.read_text())
    if arch.get("family") == "mamba2_moe":
        config = nemotron_config(arch, max_position_embeddings, str(architecture))
        vocab_size = int(config["vocab_size"])
    else:
        shape = shape_from_architecture(arch, max_position_embeddings, str(architecture))
        config = dummy_config(shape, int(arch["mtp"]["num_layers"]), int(arch["gdn"].get("conv_kernel", 4)))
        vocab_size = shape.vocab_size
    quant = quantization_config(quantization, str(arch.get("family")))
    if quant is not None:
        config["quantization_config"] = quant
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = padded_tokenizer(json.loads(BASE_TOKENIZER.read_text()), vocab_size)
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    write_tokenizer_config(out_dir, max_position_embeddings)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    manifest = {
        "architecture": arch.get("name"),
        "facts_file": architecture.name,
        "weights": "none (dummy)",
        "quantization": quantization,
    }
    (out_dir / "wmtp-model.json").write_text(json.dumps(manifest, indent=2))
    log.info("wrote %s: %d layers, vocab %d, no weights", out_dir, config["num_hidden_layers"], vocab_size)
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m wmtp.model.dummy", description=__doc__.splitlines()[0])
    parser.add_argument("--architecture", type=Path, required=True, help="config/models/<name>.json")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--max-position-embeddings", type=int, required=True, help="the model's max_model_len in the study"
    )
    parser.add_argument(
        "--quantization", choices=QUANTIZATIONS, default="none", help="the weights' format vLLM builds (default none)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        write_dummy(args.architecture, args.out, args.max_position_embeddings, args.quantization)
    except ArchitectureError as err:
        log.error("%s", err)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
