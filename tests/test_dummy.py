"""The weightless checkpoint of a real architecture (wmtp.model.dummy): its config, its padded tokenizer."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

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


def test_a_family_other_than_gdn_moe_is_refused_by_file_and_family():
    arch = json.loads(NEMOTRON.read_text())
    with pytest.raises(dummy.ArchitectureError, match=r"nemotron-3-super-120b-a12b\.json: family 'mamba2_moe'"):
        dummy.shape_from_architecture(arch, MAX_LEN, str(NEMOTRON))


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
    argv = ["--architecture", str(NEMOTRON), "--out", str(tmp_path / "x"), "--max-position-embeddings", "8"]
    assert dummy.main(argv) == 2
    assert not (tmp_path / "x").exists()
