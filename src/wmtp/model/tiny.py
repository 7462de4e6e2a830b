"""The tiny hybrid MTP checkpoint of the embedded default, built offline and deterministically.

A Qwen3-Next-shaped model (Gated-DeltaNet layers + one full-attention layer, a small MoE) with one
MTP layer (``mtp.*`` tensors, as vLLM's ``Qwen3NextMTP`` loads them) and a byte-level BPE tokenizer
trained on Python standard-library source — the "coding agent with files pasted in" text of the Spark study.

Runs inside the engine environment (it needs torch, transformers and tokenizers, which the vLLM
build brings), so the config it writes is one the installed transformers reads back.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from wmtp.config import corpus_files

log = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
# A minimal chat template for the tiny tokenizers, so that chat prompts (protocol.prompt_format: chat) run end to end
# on the CPU: role headers around each message and, like Qwen's, an empty thinking block when enable_thinking is
# false, so that the template arguments demonstrably reach the server.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@dataclass(frozen=True)
class TinyShape:
    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 4
    full_attention_every: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    # 128 is in the CPU attention backend's list of supported head sizes.
    head_dim: int = 128
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_num_key_heads: int = 4
    linear_num_value_heads: int = 8
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    shared_expert_intermediate_size: int = 128
    max_position_embeddings: int = 32768
    layer_types: list[str] = field(default_factory=list)

    def resolved_layer_types(self) -> list[str]:
        if self.layer_types:
            return list(self.layer_types)
        return [
            "full_attention" if (i + 1) % self.full_attention_every == 0 else "linear_attention"
            for i in range(self.num_hidden_layers)
        ]


def train_tokenizer(
    vocab_size: int, out_dir: Path, max_chars: int = 4_000_000, files: Iterable[Path] | None = None
) -> None:
    """Byte-level BPE on standard-library source: every text encodes, nothing is unknown.

    ``files`` (default: the whole corpus) lets a trained model keep its held-out files out.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts: list[str] = []
    total = 0
    for path in corpus_files() if files is None else files:
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    write_tokenizer_config(out_dir, 1_000_000)


def write_tokenizer_config(out_dir: Path, model_max_length: int) -> None:
    """The tokenizer_config.json of the generated checkpoints: EOS as pad, no BOS, the tiny chat template."""
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS_TOKEN,
                "bos_token": None,
                "pad_token": EOS_TOKEN,
                "add_bos_token": False,
                "model_max_length": model_max_length,
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )


def _split_fused_experts(state: dict, num_experts: int) -> dict:
    """transformers 5 keeps experts fused; vLLM's loader reads the per-expert checkpoint layout."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            inter = tensor.shape[1] // 2
            for e in range(num_experts):
                out[f"{prefix}{e}.gate_proj.weight"] = tensor[e, :inter].contiguous()
                out[f"{prefix}{e}.up_proj.weight"] = tensor[e, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(num_experts):
                out[f"{prefix}{e}.down_proj.weight"] = tensor[e].contiguous()
        else:
            out[name] = tensor
    return out


def qwen3_next_config(shape: TinyShape, layer_types: list[str]):
    """The transformers config of a tiny Qwen3-Next with these layers (the MTP layer uses one full-attention layer)."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=4 * shape.hidden_size,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        linear_key_head_dim=shape.linear_key_head_dim,
        linear_value_head_dim=shape.linear_value_head_dim,
        linear_num_key_heads=shape.linear_num_key_heads,
        linear_num_value_heads=shape.linear_num_value_heads,
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.num_experts_per_tok,
        moe_intermediate_size=shape.moe_intermediate_size,
        shared_expert_intermediate_size=shape.shared_expert_intermediate_size,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=0,
        pad_token_id=0,
    )


def write_checkpoint(out_dir: Path, state: dict, config, num_experts: int, manifest: dict) -> dict:
    """config.json, model.safetensors (vLLM's per-expert layout) and ``wmtp-model.json`` with file hashes.

    ``state`` holds the target's tensors under transformers' names plus the ``mtp.*`` tensors; the
    tokenizer files must already be in ``out_dir``. Returns the manifest as written.
    """
    import torch
    from safetensors.torch import save_file

    state = {k: v.detach().to(torch.bfloat16) for k, v in state.items()}
    state = _split_fused_experts(state, num_experts)
    state = {k: state[k].contiguous() for k in sorted(state)}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    cfg = config.to_dict()
    cfg.update(
        architectures=["Qwen3NextForCausalLM"],
        model_type="qwen3_next",
        torch_dtype="bfloat16",
        dtype="bfloat16",
        num_nextn_predict_layers=1,
    )
    for key in ("_name_or_path", "transformers_version", "id2label", "label2id"):
        cfg.pop(key, None)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    manifest = {
        **manifest,
        "torch": torch.__version__,
        "files": {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out_dir.iterdir())
            if p.name != "wmtp-model.json"
        },
    }
    (out_dir / "wmtp-model.json").write_text(json.dumps(manifest, indent=2))
    log.info("wrote %s (%d tensors)", out_dir, len(state))
    return manifest


def build_tiny(out_dir: Path, seed: int = 0, shape: TinyShape | None = None, zero_lm_head: bool = False) -> dict:
    """Write config.json, model.safetensors and the tokenizer; returns the build's manifest."""
    import torch
    from transformers import Qwen3NextForCausalLM

    shape = shape or TinyShape()
    out_dir.mkdir(parents=True, exist_ok=True)
    log.info("training the tokenizer (vocab %d) on standard-library source", shape.vocab_size)
    train_tokenizer(shape.vocab_size, out_dir)

    layer_types = shape.resolved_layer_types()
    config = qwen3_next_config(shape, layer_types)
    log.info("initialising the target (%d layers: %s) from seed %d", len(layer_types), layer_types, seed)
    torch.manual_seed(seed)
    target = Qwen3NextForCausalLM(config)
    state = {k: v.detach().to(torch.bfloat16) for k, v in target.state_dict().items()}

    # The MTP layer is a full-attention decoder layer of its own, initialised like the target's.
    torch.manual_seed(seed + 1)
    mtp_model = Qwen3NextForCausalLM(qwen3_next_config(shape, ["full_attention"]))
    prefix = "model.layers.0."
    for name, tensor in mtp_model.state_dict().items():
        if name.startswith(prefix):
            state["mtp.layers.0." + name[len(prefix) :]] = tensor.detach().to(torch.bfloat16)
    generator = torch.Generator().manual_seed(seed + 2)
    hidden = shape.hidden_size
    state["mtp.fc.weight"] = (torch.randn(hidden, 2 * hidden, generator=generator) * 0.02).to(torch.bfloat16)
    # Qwen3-Next norms scale by (1 + weight): zeros are the identity scale.
    for norm in ("mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.norm.weight"):
        state[norm] = torch.zeros(hidden, dtype=torch.bfloat16)
    if zero_lm_head:
        # Every logit ties at 0, so target and draft both pick token 0: 100 % acceptance.
        state["lm_head.weight"] = torch.zeros_like(state["lm_head.weight"])
    return write_checkpoint(
        out_dir, state, config, shape.num_experts, {"seed": seed, "shape": asdict(shape), "zero_lm_head": zero_lm_head}
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m wmtp.model.tiny", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--zero-lm-head",
        action="store_true",
        help="all-zero lm_head: target and draft always agree (100 %% acceptance)",
    )
    parser.add_argument(
        "--shape", type=json.loads, default={}, help="JSON overrides of TinyShape, e.g. '{\"hidden_size\": 512}'"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    build_tiny(args.out, seed=args.seed, shape=TinyShape(**args.shape), zero_lm_head=args.zero_lm_head)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
