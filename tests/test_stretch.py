"""A checkpoint stretched by RoPE scaling written into a copy of its config, weights linked (rule stretched_model)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from wmtp.config import ConfigError, study_from_dict
from wmtp.model.stretch import stretched_config, write_stretched

REPO = Path(__file__).resolve().parents[1]
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144}
# The shape of Qwen3.5/3.6's multimodal config: RoPE parameters in the text config, beside its mrope sections.
MULTIMODAL = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "text_config": {
        "max_position_embeddings": 262144,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": [11, 11, 10],
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000,
            "rope_type": "default",
        },
        "num_attention_heads": 16,
    },
    "vision_config": {"depth": 27},
}


def test_the_scaling_joins_the_text_configs_rope_parameters_and_keeps_the_rest():
    out = stretched_config(MULTIMODAL, YARN)
    rope = out["text_config"]["rope_parameters"]
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0 and rope["original_max_position_embeddings"] == 262144
    assert rope["mrope_section"] == [11, 11, 10] and rope["partial_rotary_factor"] == 0.25
    assert out["text_config"]["num_attention_heads"] == 16 and out["vision_config"] == {"depth": 27}
    assert "rope_scaling" not in out and "rope_scaling" not in out["text_config"]
    assert MULTIMODAL["text_config"]["rope_parameters"]["rope_type"] == "default"  # the original is not changed
    # The stretched length, where the text config keeps its length: 262,144 × 4.
    assert out["text_config"]["max_position_embeddings"] == 1_048_576 and "max_position_embeddings" not in out
    assert MULTIMODAL["text_config"]["max_position_embeddings"] == 262144


def test_a_plain_config_without_rope_parameters_gets_rope_scaling():
    out = stretched_config({"max_position_embeddings": 32768, "rope_theta": 1e6}, YARN)
    assert out["rope_scaling"] == YARN and out["rope_theta"] == 1e6
    assert out["max_position_embeddings"] == 1_048_576


def test_a_scaling_without_its_original_length_leaves_the_length_as_it_is():
    out = stretched_config({"max_position_embeddings": 32768}, {"rope_type": "yarn", "factor": 4.0})
    assert out["max_position_embeddings"] == 32768


def test_the_stretched_folder_links_every_file_but_its_config(tmp_path):
    source = tmp_path / "ckpt"
    shutil.copytree(REPO / "src" / "wmtp" / "model" / "tiny-trained", source)
    (source / "wmtp-download.json").write_text("{}")
    before = (source / "config.json").read_text()
    out = tmp_path / "stretched"
    for _ in range(2):  # a second run replaces what the first wrote
        written = write_stretched(source, out, YARN)
    assert json.loads(written.read_text())["rope_parameters"]["factor"] == 4.0
    assert not written.is_symlink() and (source / "config.json").read_text() == before
    linked = {p.name for p in out.iterdir() if p.is_symlink()}
    assert linked == {"model.safetensors", "tokenizer.json", "tokenizer_config.json", "wmtp-model.json"}
    assert (out / "model.safetensors").resolve() == (source / "model.safetensors").resolve()
    assert not (out / "wmtp-download.json").exists()


def test_a_source_without_a_config_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"holds no config\.json"):
        write_stretched(tmp_path, tmp_path / "out", YARN)


def _study(tmp_path: Path, **model: object) -> dict:
    raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    checkpoint = tmp_path / "ckpt"
    if not checkpoint.exists():
        shutil.copytree(REPO / "src" / "wmtp" / "model" / "tiny-trained", checkpoint)
    length = raw["models"][0]["max_model_len"]
    raw["models"] = [{"name": "long", "path": str(checkpoint), "max_model_len": length, "rope_scaling": YARN, **model}]
    raw["models_dir"] = str(tmp_path / "models")
    raw["results_dir"] = str(tmp_path / "results")
    return raw


def test_cells_serve_the_stretched_copy(tmp_path):
    study = study_from_dict(_study(tmp_path))
    assert study.model_dir("long") == tmp_path / "models" / "long"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_scaling": {"rope_type": "yarn"}}, "must give a factor above 1"),
        ({"rope_scaling": {"factor": 1}}, "must give a factor above 1"),
        ({"serve_args": ["--hf-overrides", "{}"]}, "also --hf-overrides in serve_args"),
    ],
)
def test_a_scaling_that_cannot_be_written_or_would_be_overridden_is_refused(tmp_path, change, message):
    with pytest.raises(ConfigError, match=message):
        study_from_dict(_study(tmp_path, **change))


def test_a_generated_model_cannot_be_stretched(tmp_path):
    raw = _study(tmp_path)
    raw["models"][0].pop("path")
    raw["models"][0]["generate"] = "tiny"
    with pytest.raises(ConfigError, match=r"rope_scaling needs models\[0\]\.path"):
        study_from_dict(raw)


def test_snakemake_writes_the_stretched_copy_before_any_cell(tmp_path):
    study = tmp_path / "study.yaml"
    study.write_text(yaml.safe_dump(_study(tmp_path) | {"engines_dir": str(tmp_path / "engines")}))
    snakemake = [sys.executable, "-m", "snakemake", "--cores", "1", "--nolock"]

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*snakemake, *args], cwd=REPO, capture_output=True, text=True, timeout=300)

    planned = run("-n", "--configfile", str(study))
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert "rule stretched_model:" in planned.stdout and "rope_type" in planned.stdout
    target = tmp_path / "models" / "long" / "config.json"
    made = run(str(target), "--configfile", str(study))
    assert made.returncode == 0, made.stdout + made.stderr
    assert json.loads(target.read_text())["rope_parameters"]["rope_type"] == "yarn"
    assert (tmp_path / "models" / "long" / "model.safetensors").is_symlink()
    assert (tmp_path / "models" / "long.log").is_file()
