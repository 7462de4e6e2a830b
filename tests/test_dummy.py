"""The weightless checkpoint of a real architecture (wmtp.model.dummy): its config, its padded tokenizer."""

from __future__ import annotations

import json
import random
import subprocess
import time
from pathlib import Path

import pytest

from wmtp.analyze import costmodel
from wmtp.layout import TRAINED_CHECKPOINT
from wmtp.measure.identity import model_fingerprint
from wmtp.measure.tasks import workload_task
from wmtp.measure.workload import PromptFactory
from wmtp.model import dummy
from wmtp.model.tiny import TinyShape

REPO = Path(__file__).resolve().parents[1]
QWEN36 = REPO / "config" / "models" / "qwen3.6-35b-a3b.json"
NEMOTRON = REPO / "config" / "models" / "nemotron-3-super-120b-a12b.json"
MAX_LEN = 1_049_600


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dummy")
    dummy.write_dummy(QWEN36, out, MAX_LEN)
    return out


def test_the_config_has_the_architectures_shape(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    arch = json.loads(QWEN36.read_text())
    assert config["model_type"] == "qwen3_next" and config["architectures"] == ["Qwen3NextForCausalLM"]
    assert config["num_hidden_layers"] == len(arch["layer_pattern"]) == 40
    assert config["layer_types"].count("full_attention") == 10
    assert config["layer_types"][:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert config["num_nextn_predict_layers"] == arch["mtp"]["num_layers"]
    assert config["vocab_size"] == 248_320 and config["max_position_embeddings"] == MAX_LEN
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (16, 2, 256)
    assert (config["linear_num_key_heads"], config["linear_num_value_heads"]) == (16, 32)
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"]) == (256, 8, 512)
    assert not any(p.suffix == ".safetensors" for p in checkpoint.iterdir())


def test_the_config_matches_what_the_tiny_builder_writes_through_transformers():
    """The committed tiny checkpoint's config.json was written by wmtp.model.tiny through Qwen3NextConfig: at its
    shape the dummy config gives every key it writes the same value."""
    written = json.loads((TRAINED_CHECKPOINT / "config.json").read_text())
    manifest = json.loads((TRAINED_CHECKPOINT / "wmtp-model.json").read_text())
    config = dummy.dummy_config(TinyShape(**manifest["shape"]), mtp_layers=1)
    assert {key: written[key] for key in config} == config


def test_a_family_other_than_gdn_moe_is_no_qwen3_next_shape():
    arch = json.loads(NEMOTRON.read_text())
    with pytest.raises(dummy.ArchitectureError, match=r"nemotron-3-super-120b-a12b\.json: family 'mamba2_moe' is not"):
        dummy.shape_from_architecture(arch, MAX_LEN, str(NEMOTRON))


def test_a_nemotron_dummy_has_the_facts_files_patterns_and_latent_moe(tmp_path):
    arch = json.loads(NEMOTRON.read_text())
    config = dummy.write_dummy(NEMOTRON, tmp_path, MAX_LEN)
    assert config["architectures"] == ["NemotronHForCausalLM"] and config["model_type"] == "nemotron_h"
    pattern = config["hybrid_override_pattern"]
    assert len(pattern) == config["num_hidden_layers"] == len(arch["layer_pattern"]) == 88
    assert (pattern.count("M"), pattern.count("E"), pattern.count("*")) == (40, 40, 8)
    assert config["mtp_hybrid_override_pattern"] == "*E" and config["num_nextn_predict_layers"] == 1
    # Mamba-2's 128 heads of 64 are twice the hidden size; routed experts in the latent 1,024, the shared in 4,096
    assert config["mamba_expand"] == 2 and config["moe_latent_size"] == 1024
    assert (config["n_routed_experts"], config["num_experts_per_tok"]) == (512, 22)
    assert config["max_position_embeddings"] == MAX_LEN and config["vocab_size"] == 131072
    assert not any(p.suffix == ".safetensors" for p in tmp_path.iterdir())


def test_the_cost_model_reads_back_from_a_nemotron_dummy_the_facts_it_was_written_from(tmp_path):
    """The byte floor of a Nemotron-H cell comes from its config.json: the same model as the facts file."""
    from dataclasses import replace

    config = dummy.write_dummy(NEMOTRON, tmp_path, MAX_LEN)
    facts = costmodel.load_model(NEMOTRON)
    assert replace(costmodel.model_from_hf_config(config), name=facts.name) == facts


def test_a_layer_nemotron_h_does_not_build_is_refused():
    arch = json.loads(NEMOTRON.read_text())
    arch["pattern_legend"]["E"] = ["mamba2", "moe"]
    with pytest.raises(dummy.ArchitectureError, match=r"layer_pattern\[1\] 'E' is mamba2 \+ moe"):
        dummy.nemotron_config(arch, MAX_LEN, "x.json")


@pytest.mark.engine
def test_the_engines_transformers_reads_the_nemotron_dummy_as_its_layers(engine_python, tmp_path):
    """The CPU engine's transformers (NemotronHConfig) reads the dummy's config.json: 40 Mamba-2, 40 MoE and 8
    attention layers, the latent MoE and the MTP pattern."""
    dummy.write_dummy(NEMOTRON, tmp_path, MAX_LEN)
    probe = (
        "import collections, json, sys\n"
        "from transformers import AutoConfig\n"
        "c = AutoConfig.from_pretrained(sys.argv[1])\n"
        "print('PROBE ' + json.dumps({'kind': type(c).__name__, 'layers': collections.Counter(c.layers_block_type),\n"
        "    'latent': c.moe_latent_size, 'mtp': c.mtp_hybrid_override_pattern, 'groups': c.n_groups}))\n"
    )
    proc = subprocess.run([engine_python, "-c", probe, str(tmp_path)], capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    seen = json.loads(lines[-1].removeprefix("PROBE "))
    assert seen["kind"] == "NemotronHConfig" and seen["latent"] == 1024 and seen["mtp"] == "*E" and seen["groups"] == 8
    assert seen["layers"] == {"linear_attention": 40, "moe": 40, "full_attention": 8}


def test_a_layer_the_legend_does_not_make_of_gdn_or_attn_and_moe_is_refused():
    arch = json.loads(QWEN36.read_text())
    arch["pattern_legend"]["L"] = ["gdn", "dense"]
    with pytest.raises(dummy.ArchitectureError, match=r"layer_pattern\[0\] 'L' is gdn \+ dense"):
        dummy.shape_from_architecture(arch, MAX_LEN, "x.json")


def test_every_id_below_vocab_size_decodes_and_loads_in_seconds(checkpoint):
    from tokenizers import Tokenizer

    started = time.monotonic()
    tokenizer = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    assert time.monotonic() - started < 5.0
    assert tokenizer.get_vocab_size() == 248_320
    ids = [*random.Random(0).sample(range(2048, 248_320), 2000), 2047, 248_319]
    for i in ids:
        assert tokenizer.decode([i]) != "" or i < 2048
    assert tokenizer.decode([248_319]) == "\t<248319>"
    assert tokenizer.decode(ids)  # a whole generation of arbitrary ids at once


def test_code_text_encodes_as_with_the_base_tokenizer(checkpoint):
    from tokenizers import Tokenizer

    base = Tokenizer.from_file(str(TRAINED_CHECKPOINT / "tokenizer.json"))
    padded = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    text = Path(json.__file__).read_text() + Path(random.__file__).read_text()
    assert padded.encode(text).ids == base.encode(text).ids


def test_the_code_and_copy_workloads_keep_their_exact_lengths(checkpoint):
    factory = PromptFactory(checkpoint / "tokenizer.json")
    for workload in ("code", "copy"):
        task = workload_task(factory, workload, 4096, 0, "test")
        assert len(factory.encode(task.text)) == 4096
    # The padding never joins the copy task's draw of printable tokens.
    assert not any(token.startswith(("\t", " \t")) for token in factory.rare_tokens)


def test_a_weightless_checkpoint_has_a_fingerprint_that_follows_its_config(checkpoint, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in checkpoint.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    before = model_fingerprint(copy)
    config = json.loads((copy / "config.json").read_text())
    config["num_nextn_predict_layers"] = 2
    (copy / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(copy) != before


def test_the_cli_refuses_another_family_with_exit_2(tmp_path):
    dense = tmp_path / "dense-8b.json"
    dense.write_text(json.dumps({**json.loads(QWEN36.read_text()), "family": "dense"}))
    argv = ["--architecture", str(dense), "--out", str(tmp_path / "x"), "--max-position-embeddings", "8"]
    assert dummy.main(argv) == 2
    assert not (tmp_path / "x").exists()


# The layers vLLM's Qwen3-Next builds, by prefix, and whether an NVFP4 checkpoint of ModelOpt's recipe keeps each
# at 16 bits.
NVFP4_LAYERS = {
    "model.layers.0.linear_attn.in_proj_qkvz": True,
    "model.layers.0.linear_attn.out_proj": True,
    "model.layers.0.mlp.gate": True,
    "model.layers.0.mlp.shared_expert_gate": True,
    "lm_head": True,
    "mtp.layers.0.self_attn.qkv_proj": True,
    "model.layers.3.self_attn.qkv_proj": False,
    "model.layers.3.self_attn.o_proj": False,
    "model.layers.0.mlp.experts": False,
    "model.layers.0.mlp.shared_expert.gate_up_proj": False,
}


def test_an_nvfp4_dummy_carries_modelopts_config_and_the_cost_model_counts_its_bytes(tmp_path):
    dummy.write_dummy(QWEN36, tmp_path, MAX_LEN, "nvfp4")
    config = json.loads((tmp_path / "config.json").read_text())
    quant = config["quantization_config"]
    assert (quant["quant_method"], quant["quant_algo"], quant["group_size"]) == ("modelopt", "NVFP4", 16)
    assert json.loads((tmp_path / "wmtp-model.json").read_text())["quantization"] == "nvfp4"
    nvfp4 = costmodel.model_from_hf_config(config)
    plain = costmodel.model_from_hf_config({key: v for key, v in config.items() if key != "quantization_config"})
    assert plain.quantized_parts == () and nvfp4.quantized_parts == costmodel.NVFP4_PARTS
    # The verify forward's weights: the attention and expert weights it touches at 4.5 bits instead of 16, the rest
    # as they were (each of the 40 MoE layers' router, 2,048 × 256, and shared-expert gate, 2,048, among them); the
    # draft (16-bit) and the KV unchanged.
    tokens = 4
    routing = 40 * (2048 * 256 + 2048)
    quantised = (
        sum(
            costmodel.layer_params_touched(plain, (part,), tokens)
            for layer in plain.layers
            for part in layer
            if part in ("attn", "moe")
        )
        - routing
    )
    bf16, fp4 = (costmodel.verify_bytes(s, 131072, tokens) for s in (plain, nvfp4))
    assert bf16.weights - fp4.weights == pytest.approx(quantised * (2 - 0.5625))
    assert (fp4.kv, fp4.state, fp4.lm_head) == (bf16.kv, bf16.state, bf16.lm_head)
    assert costmodel.draft_bytes(nvfp4, 131072, "mtp") == costmodel.draft_bytes(plain, 131072, "mtp")


def test_a_checkpoint_quantised_otherwise_is_not_counted_as_16_bit(tmp_path):
    dummy.write_dummy(QWEN36, tmp_path, MAX_LEN)
    config = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in config
    fp8 = {**config, "quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}}
    with pytest.raises(ValueError, match="knows NVFP4 only"):
        costmodel.model_from_hf_config(fp8)
    # what needs the KV and state alone reads the model without its weights' format
    assert costmodel.model_from_hf_config(fp8, weights=False).quantized_parts == ()
    fp8_kv = {"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8"}
    with pytest.raises(ValueError, match="quantises the KV cache"):
        costmodel.model_from_hf_config({**config, "quantization_config": fp8_kv})
    # compressed-tensors' NVFP4 (RedHatAI's builds), at the top of a multimodal config beside its text block
    packed = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"format": "nvfp4-pack-quantized"}}}
    multimodal = {"text_config": config, "quantization_config": packed}
    assert costmodel.model_from_hf_config(multimodal).quantized_parts == costmodel.NVFP4_PARTS
    with pytest.raises(dummy.ArchitectureError, match="nvfp4"):
        dummy.write_dummy(QWEN36, tmp_path / "fp8", MAX_LEN, "fp8")


# The same for vLLM's Nemotron-H: Mamba-2 mixers (in_proj, out_proj), attention mixers (qkv_proj, o_proj), MoE mixers
# (gate, fc1/fc2_latent_proj, experts, shared_experts).
NEMOTRON_NVFP4_LAYERS = {
    "model.layers.0.mixer.in_proj": True,
    "model.layers.0.mixer.out_proj": True,
    "model.layers.1.mixer.gate": True,
    "model.layers.1.mixer.fc1_latent_proj": True,
    "model.layers.1.mixer.fc2_latent_proj": True,
    "lm_head": True,
    "mtp.layers.0.mixer.qkv_proj": True,
    "model.layers.1.mixer.experts": False,
    "model.layers.1.mixer.shared_experts.up_proj": False,
    "model.layers.7.mixer.qkv_proj": False,
    "model.layers.7.mixer.o_proj": False,
}


@pytest.mark.engine
@pytest.mark.parametrize(("facts", "layers"), [(QWEN36, NVFP4_LAYERS), (NEMOTRON, NEMOTRON_NVFP4_LAYERS)])
def test_vllm_reads_an_nvfp4_dummy_as_modelopt_fp4_keeping_the_recurrent_layers_16_bit(
    engine_python, tmp_path, facts, layers
):
    """vLLM's own ModelOpt parser on the dummy's config.json: the method it picks, the group size, and which layers
    it leaves unquantised (those the cost model counts at 16 bits)."""
    dummy.write_dummy(facts, tmp_path, MAX_LEN, "nvfp4")
    probe = (
        "import json, sys\n"
        "from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config\n"
        "quant = json.load(open(sys.argv[1]))['quantization_config']\n"
        "config = ModelOptNvFp4Config.from_config(quant)\n"
        "print('PROBE ' + json.dumps({'method': ModelOptNvFp4Config.override_quantization_method(quant, None),\n"
        "    'group_size': config.group_size,\n"
        "    'excluded': {p: config.is_layer_excluded(p) for p in json.loads(sys.argv[2])}}))\n"
    )
    proc = subprocess.run(
        [engine_python, "-c", probe, str(tmp_path / "config.json"), json.dumps(list(layers))],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    seen = json.loads(lines[-1].removeprefix("PROBE "))
    assert seen["method"] == "modelopt_fp4" and seen["group_size"] == 16
    assert seen["excluded"] == layers
