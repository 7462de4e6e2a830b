"""What would kill a server after it started is refused when the study is read, in one line naming the key and value.

Each test shows one refusal (or warning) with its message, and what the study may say instead.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from wmtp.config import (
    GENERATED_MAX_POSITIONS,
    ConfigError,
    EngineSpec,
    load_study,
    serve_block_size,
    study_from_dict,
    study_warnings,
)
from wmtp.layout import TRAINED_CHECKPOINT

REPO = Path(__file__).resolve().parents[1]
SGLANG = {"name": "sg", "kind": "sglang", "packages": ["sglang==0.5.21"]}


def refused(raw: dict, *fragments: str, base_dir: Path | str = ".") -> str:
    with pytest.raises(ConfigError) as info:
        study_from_dict(raw, base_dir=base_dir)
    message = str(info.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def checkpoint(directory: Path, config: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


# --- wmtp-ring on vLLM -------------------------------------------------------------------------------


def test_ring_arm_on_a_vllm_engine_runs_without_prefix_caching(embedded_raw):
    assert embedded_raw["arms"][3]["name"] == "wmtp-ring"  # the embedded study's own ring arm
    assert "wmtp-ring" in {c.arm for c in study_from_dict(embedded_raw).cells()}


def test_ring_arm_on_a_vllm_engine_with_prefix_caching_is_refused(embedded_raw):
    assert embedded_raw["arms"][3]["name"] == "wmtp-ring"
    embedded_raw["models"][0].setdefault("serve_args", []).append("--enable-prefix-caching")
    refused(
        embedded_raw,
        "config: arms[3].name 'wmtp-ring' cannot run on engines[0] 'vllm-cpu' (vllm) with models[0]",
        "frees KV blocks a prefix-cache hit would need",
        "add --no-enable-prefix-caching",
    )


def test_ring_arm_on_sglang_is_refused_before_anything_runs(embedded_raw):
    embedded_raw["engines"] = [SGLANG]
    embedded_raw["arms"] = [{"name": "wmtp-ring", "k": [3], "sink": [16], "window": [256]}]
    refused(embedded_raw, "config: arms[0].name 'wmtp-ring' cannot run on engines[0]", "SGLang engine has none")


def test_a_window_shorter_than_its_sink_is_refused(embedded_raw):
    embedded_raw["arms"][2].update(sink=[16, 512], window=[256])
    refused(embedded_raw, "config: arms[2].window[0] = 256 is smaller than arms[2].sink[1] = 512")


# --- room for the last draft ----------------------------------------------------------------------------


def test_a_longest_request_without_room_for_its_draft_is_refused(embedded_raw):
    # The embedded study: rungs up to 16,384, 64 output tokens, k = 3. 16,450 holds the longest request but not its
    # last step's whole draft; 16,451 holds both.
    embedded_raw["models"][0]["max_model_len"] = 16384 + 64 + 2
    refused(
        embedded_raw,
        "config: the longest rung 16384 plus 64 output tokens and a draft of k = 3 does not fit below "
        "models[0].max_model_len = 16450 (model 'tiny')",
        "raise it to 16451",
    )
    embedded_raw["models"][0]["max_model_len"] = 16384 + 64 + 3
    assert study_from_dict(embedded_raw).model("tiny").max_model_len == 16451
    # Without a drafting arm there is no draft to make room for.
    embedded_raw["models"][0]["max_model_len"] = 16384 + 64
    embedded_raw["arms"] = [{"name": "none"}]
    assert study_from_dict(embedded_raw).model("tiny").max_model_len == 16448


# --- warm-up length ----------------------------------------------------------------------------------


def test_warmup_longer_than_the_model_is_refused(embedded_raw):
    embedded_raw["protocol"]["warmup_prompt_tokens"] = 16630
    embedded_raw["protocol"]["warmup_output_tokens"] = 16
    refused(
        embedded_raw,
        "config: protocol.warmup_prompt_tokens = 16630 plus protocol.warmup_output_tokens = 16 does not fit below "
        "models[0].max_model_len = 16640 (model 'tiny')",
    )
    embedded_raw["protocol"]["warmup_prompt_tokens"] = 16624
    assert study_from_dict(embedded_raw).protocol.warmup_prompt_tokens == 16624


def test_warmup_defaults_are_checked_too(embedded_raw):
    del embedded_raw["protocol"]["warmup_prompt_tokens"], embedded_raw["protocol"]["warmup_output_tokens"]
    embedded_raw["protocol"].update(rungs=[8], output_tokens=8, workloads=["code"])
    embedded_raw["arms"] = [{"name": "none"}]
    embedded_raw["models"][0]["max_model_len"] = 64
    refused(embedded_raw, "protocol.warmup_prompt_tokens = 64 plus protocol.warmup_output_tokens = 16")


# --- max_model_len against the checkpoint's own length -----------------------------------------------


def test_max_model_len_above_the_checkpoints_positions_is_refused(embedded_raw, tmp_path):
    model = checkpoint(tmp_path / "big", {"max_position_embeddings": 8192})
    embedded_raw["models"][0] = {"name": "big", "path": str(model), "max_model_len": 16640}
    refused(
        embedded_raw,
        "config: models[0].max_model_len = 16640 is above the model's max_position_embeddings = 8192 "
        f"({model}/config.json), which engines[0] 'vllm-cpu' refuses at start-up",
        'set VLLM_ALLOW_LONG_MAX_MODEL_LEN: "1" in engines[0].env',
    )


def test_multimodal_checkpoints_are_read_through_text_config(embedded_raw, tmp_path):
    model = checkpoint(tmp_path / "vl", {"text_config": {"max_position_embeddings": 8192}, "vision_config": {}})
    embedded_raw["models"][0] = {"name": "vl", "path": str(model), "max_model_len": 16640}
    refused(embedded_raw, "models[0].max_model_len = 16640", "max_position_embeddings = 8192")
    (model / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 16640}}))
    assert study_from_dict(embedded_raw).model("vl").max_model_len == 16640


def test_what_lets_an_engine_serve_beyond_the_checkpoints_length(embedded_raw, tmp_path):
    model = checkpoint(tmp_path / "big", {"max_position_embeddings": 8192})
    embedded_raw["models"][0] = {"name": "big", "path": str(model), "max_model_len": 16640}
    raw = copy.deepcopy(embedded_raw)
    raw["engines"][0]["env"]["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    study_from_dict(raw)
    raw = copy.deepcopy(embedded_raw)
    raw["models"][0]["serve_args"] = ["--hf-overrides", '{"max_position_embeddings": 16640}']
    study_from_dict(raw)
    # A RoPE factor stretches the length by rules that differ between engines: not refused here.
    (model / "config.json").write_text(
        json.dumps({"max_position_embeddings": 8192, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    )
    study_from_dict(embedded_raw)
    # With the original length given, neither engine stretches it.
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 8192, "rope_scaling": rope}))
    refused(embedded_raw, "max_position_embeddings = 8192")


def test_a_malformed_config_override_is_refused(embedded_raw, tmp_path):
    model = checkpoint(tmp_path / "big", {"max_position_embeddings": 32768})
    embedded_raw["models"][0] = {"name": "big", "path": str(model), "max_model_len": 16640}
    embedded_raw["models"][0]["serve_args"] = ["--hf-overrides", "{max_position_embeddings: 1}"]
    refused(embedded_raw, "config: models[0].serve_args --hf-overrides is not JSON")


def test_generated_models_use_the_shape_they_are_built_with(embedded_raw):
    from wmtp.model.tiny import TinyShape
    from wmtp.model.train import TRAINED_SHAPE

    committed = json.loads((TRAINED_CHECKPOINT / "config.json").read_text())
    assert (
        GENERATED_MAX_POSITIONS
        == TinyShape().max_position_embeddings
        == TRAINED_SHAPE.max_position_embeddings
        == committed["max_position_embeddings"]
    )
    embedded_raw["models"][0]["max_model_len"] = GENERATED_MAX_POSITIONS + 1
    refused(
        embedded_raw,
        f"models[0].max_model_len = {GENERATED_MAX_POSITIONS + 1} is above the model's max_position_embeddings = "
        f"{GENERATED_MAX_POSITIONS} (the generated checkpoint's shape)",
    )


# --- generate: dummy ---------------------------------------------------------------------------------


def _dummy(embedded_raw: dict, **model) -> dict:
    entry = {
        "name": "dummy",
        "generate": "dummy",
        "architecture": "qwen3.6-35b-a3b",
        "max_model_len": 16640,
        "serve_args": ["--load-format", "dummy"],
    }
    embedded_raw["models"] = [{**entry, **model}]
    return embedded_raw


def test_a_dummy_model_names_a_gdn_moe_architecture_and_loads_dummy_weights(embedded_raw):
    study = study_from_dict(_dummy(embedded_raw))
    assert study.model("dummy").architecture == "qwen3.6-35b-a3b"


def test_a_dummy_model_served_without_dummy_weights_is_refused(embedded_raw):
    refused(_dummy(embedded_raw, serve_args=[]), "config: models[0].serve_args must hold --load-format dummy")
    overridden = ["--load-format", "dummy", "--load-format=safetensors"]  # the last one is what vLLM uses
    refused(_dummy(embedded_raw, serve_args=overridden), "--load-format dummy")


def test_a_dummy_model_of_another_family_or_unknown_architecture_is_refused(embedded_raw, monkeypatch, tmp_path):
    from wmtp import config

    facts = json.loads(config.architecture_file("qwen3.6-35b-a3b").read_text())
    (tmp_path / "dense-8b.json").write_text(json.dumps({**facts, "family": "dense"}))
    monkeypatch.setattr(config, "ARCHITECTURES_DIR", tmp_path)
    refused(
        _dummy(embedded_raw, architecture="dense-8b"),
        "models[0].architecture 'dense-8b': dense-8b.json is of family 'dense'; a dummy checkpoint is written for "
        "gdn_moe, mamba2_moe only",
    )
    monkeypatch.undo()
    # Nemotron-H (Mamba-2 and latent MoE) is one
    study = study_from_dict(_dummy(embedded_raw, architecture="nemotron-3-super-120b-a12b"))
    assert study.model("dummy").architecture == "nemotron-3-super-120b-a12b"
    refused(_dummy(embedded_raw, architecture="nope"), "models[0].architecture 'nope': no ", "known: ")
    raw = _dummy(embedded_raw)
    del raw["models"][0]["architecture"]
    refused(raw, "models[0].architecture must name the dummy model's architecture")


def test_architecture_belongs_to_dummy_models_only(embedded_raw):
    embedded_raw["models"][0]["architecture"] = "qwen3.6-35b-a3b"
    refused(embedded_raw, "models[0].architecture only applies to generate: dummy")


def test_quantization_belongs_to_dummy_models_only_and_leaves_an_unquantised_identity_alone(embedded_raw):
    from wmtp.measure.identity import cell_identity

    embedded_raw["models"][0]["quantization"] = "nvfp4"
    refused(embedded_raw, "models[0].quantization only applies to generate: dummy")
    plain = study_from_dict(_dummy(embedded_raw))
    assert plain.model("dummy").quantization is None
    nvfp4 = study_from_dict(_dummy(embedded_raw, quantization="nvfp4"))
    assert nvfp4.model("dummy").quantization == "nvfp4"
    # the key is left out of an unquantised model's dump: its cells keep the identities they had
    assert "quantization" not in plain.model("dummy").model_dump()
    cell = next(iter(nvfp4.cells()))
    assert cell_identity(nvfp4, cell)["model"]["quantization"] == "nvfp4"


def test_a_dummy_checkpoint_is_as_long_as_its_max_model_len(embedded_raw):
    # wmtp.model.dummy writes max_model_len as max_position_embeddings: no 32K limit of the tiny shapes.
    study = study_from_dict(_dummy(embedded_raw, max_model_len=1_049_600))
    assert study.model("dummy").max_model_len == 1_049_600


def test_a_dummy_models_identity_follows_its_architecture_file(embedded_raw, monkeypatch, tmp_path):
    from wmtp import config
    from wmtp.measure.identity import cell_identity, identity_hash

    study = study_from_dict(_dummy(embedded_raw))
    cell = study.cells()[0]
    before = identity_hash(cell_identity(study, cell))
    facts = json.loads(config.architecture_file("qwen3.6-35b-a3b").read_text())
    facts["moe"]["top_k"] = 4
    (tmp_path / "qwen3.6-35b-a3b.json").write_text(json.dumps(facts))
    monkeypatch.setattr(config, "ARCHITECTURES_DIR", tmp_path)
    assert identity_hash(cell_identity(study, cell)) != before


def test_paper_study_serves_beyond_the_native_length_on_purpose(repo, tmp_path, monkeypatch):
    # Its SGLang engine allows a --context-length beyond config.json's; without that the checkpoints are refused.
    monkeypatch.chdir(tmp_path)
    raw = yaml.safe_load((repo / "config" / "studies" / "paper-1m.yaml").read_text())
    for model in raw["models"]:
        checkpoint(tmp_path / model["path"], {"text_config": {"max_position_embeddings": 262144}})
    study_from_dict(raw, base_dir=tmp_path)
    del raw["engines"][0]["env"]["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"]
    refused(raw, "models[0].max_model_len", "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", base_dir=tmp_path)


# --- a window that covers everything -----------------------------------------------------------------


def test_a_window_that_covers_every_token_warns_and_runs(embedded_raw, caplog):
    # The longest rung is 16384 and 64 tokens are generated: sink 16 + window 16432 reaches 16448.
    embedded_raw["arms"][2]["window"] = [256, 16431, 16432]
    with caplog.at_level(logging.WARNING, logger="wmtp.config"):
        study = study_from_dict(embedded_raw)
    assert len(study.cells()) == 6
    want = (
        "config: arms[2].sink[0] = 16 plus arms[2].window[2] = 16432 covers the longest rung 16384 plus 64 output "
        "tokens: the draft drops nothing, so arm 'wmtp' measures the same as 'mtp' (what a window-off control is for); "
        "otherwise use a window below 16432"
    )
    assert study_warnings(study) == [want]
    assert [r.getMessage() for r in caplog.records if r.name == "wmtp.config"] == [want]


def test_check_config_prints_the_warning(embedded_raw, tmp_path, capsys):
    from wmtp.cli import main

    embedded_raw["arms"][2]["window"] = [20000]
    study_file = tmp_path / "wide.yaml"
    study_file.write_text(yaml.safe_dump(embedded_raw))
    assert main(["check-config", "--config", str(study_file)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("is valid: 4 cells")
    assert out[1].startswith("  warning: config: arms[2].sink[0] = 16 plus arms[2].window[0] = 20000 covers"), out


def test_a_window_off_the_engines_block_size_warns(embedded_raw):
    embedded_raw["engines"][0]["serve_args"] += ["--block-size=128"]
    embedded_raw["arms"][2]["window"] = [256, 300]
    got = study_warnings(study_from_dict(embedded_raw))
    assert got == [
        "config: arms[2].sink[0] = 16 is not a multiple of engine 'vllm-cpu''s --block-size 128: its draft reads "
        "whole blocks, so 128 tokens (the cells record the effective value)",
        "config: arms[2].window[1] = 300 is not a multiple of engine 'vllm-cpu''s --block-size 128: its draft "
        "reads whole blocks, so 300 to 427 tokens (the cells record the effective value)",
        "config: arms[3].sink[0] = 16 is not a multiple of engine 'vllm-cpu''s --block-size 128: its draft reads "
        "whole blocks, so 128 tokens (the cells record the effective value)",
    ]


@pytest.mark.parametrize(
    ("argv", "block"),
    [(["--block-size", "64"], 64), (["--dtype", "bf16", "--block-size=32"], 32), (["--dtype", "bf16"], None)],
)
def test_serve_block_size(argv, block):
    assert serve_block_size(argv) == block


def test_shipped_studies_warn_of_nothing_but_the_window_off_control(repo):
    assert study_warnings(load_study(repo / "config" / "config.yaml")) == []
    warned = study_warnings(load_study(repo / "config" / "studies" / "h200-vllm.yaml"))
    assert len(warned) == 1 and "arms[2].window[1] = 1049600" in warned[0] and "window-off control" in warned[0]


# --- the study file itself ---------------------------------------------------------------------------


BAD_YAML = """study: bad
engines:
  - name: vllm-cpu
    kind: vllm
models:
  - name: tiny
    generate: trained: yes
"""


def test_yaml_error_names_the_file_and_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("bad.yaml").write_text(BAD_YAML)
    with pytest.raises(ConfigError) as info:
        load_study("bad.yaml")
    assert str(info.value) == "config: bad.yaml, line 7, column 22: mapping values are not allowed here"


def test_missing_study_file(tmp_path):
    with pytest.raises(ConfigError, match=r"^config: study file .*nowhere\.yaml does not exist$"):
        load_study(tmp_path / "nowhere.yaml")


def test_check_config_on_a_broken_file_prints_one_line_and_exits_2(tmp_path):
    (tmp_path / "bad.yaml").write_text(BAD_YAML)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "wmtp", "check-config", "--config", "bad.yaml"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].endswith("ERROR wmtp: config: bad.yaml, line 7, column 22: mapping values are not allowed here"), (
        lines
    )


# --- names a command is given ------------------------------------------------------------------------


def test_unknown_engine_or_model_lists_the_known_ones(repo):
    study = load_study(repo / "config" / "config.yaml")
    with pytest.raises(
        ConfigError, match=r"^config: no engine named 'nope' in study 'embedded' \(its engines: vllm-cpu\)$"
    ):
        study.engine("nope")
    with pytest.raises(ConfigError, match=r"^config: no model named 'nope' in study 'embedded' \(its models: tiny\)$"):
        study.model("nope")


def test_engine_build_of_an_unknown_engine_exits_2(repo, tmp_path, capsys):
    from wmtp.cli import main

    config = str(repo / "config" / "config.yaml")
    argv = ["engine-build", "--config", config, "--engine", "nope", "--out", str(tmp_path / "manifest.json")]
    assert main(argv) == 2
    assert "config: no engine named 'nope' in study 'embedded' (its engines: vllm-cpu)" in capsys.readouterr().err
    assert not (tmp_path / "manifest.json").exists()


# --- binding beyond loopback -------------------------------------------------------------------------


def test_remote_bind_is_refused_without_allow_remote(embedded_raw):
    embedded_raw["engines"][0]["serve_args"] += ["--host", "0.0.0.0"]
    refused(
        embedded_raw,
        "config: engines[0].serve_args --host 0.0.0.0 would open engine 'vllm-cpu' to the network unauthenticated",
        "bind a loopback address (127.0.0.1), or set engines[0].allow_remote: true and give an API key "
        "(--api-key in serve_args or VLLM_API_KEY in env)",
    )


def test_remote_bind_from_a_models_serve_args(embedded_raw):
    embedded_raw["models"][0]["serve_args"] = ["--host=10.1.2.3"]
    refused(embedded_raw, "config: models[0].serve_args --host 10.1.2.3 would open engine 'vllm-cpu'")


def test_allow_remote_still_needs_an_api_key(embedded_raw):
    engine = embedded_raw["engines"][0]
    engine["serve_args"] += ["--host", "0.0.0.0"]
    engine["allow_remote"] = True
    refused(
        embedded_raw,
        "config: engines[0].serve_args --host 0.0.0.0 with engines[0].allow_remote: true has no API key, so the "
        "server would be unauthenticated; give --api-key in serve_args or VLLM_API_KEY in env",
    )
    with_flag = copy.deepcopy(embedded_raw)
    with_flag["engines"][0]["serve_args"] += ["--api-key", "s3cret"]
    assert study_from_dict(with_flag).engine("vllm-cpu").allow_remote
    engine["env"]["VLLM_API_KEY"] = "s3cret"
    study_from_dict(embedded_raw)


def test_sglang_reads_no_vllm_key(embedded_raw):
    embedded_raw["arms"] = [arm for arm in embedded_raw["arms"] if arm["name"] != "wmtp-ring"]
    embedded_raw["engines"] = [{**SGLANG, "allow_remote": True, "env": {"VLLM_API_KEY": "s3cret"}}]
    embedded_raw["engines"][0]["serve_args"] = ["--host", "0.0.0.0"]
    refused(embedded_raw, "has no API key", "give --api-key in serve_args")
    embedded_raw["engines"][0]["serve_args"] += ["--api-key=s3cret"]
    study_from_dict(embedded_raw)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_loopback_binds_are_fine(embedded_raw, host):
    embedded_raw["engines"][0]["serve_args"] += ["--host", host]
    study_from_dict(embedded_raw)


def test_allow_remote_is_a_boolean_and_travels_with_the_resolved_study(embedded_raw):
    embedded_raw["engines"][0]["allow_remote"] = "yes"
    refused(embedded_raw, "config.engines[0].allow_remote", "'yes'")
    serve_args = [*embedded_raw["engines"][0]["serve_args"], "--host", "0.0.0.0", "--api-key", "k"]
    embedded_raw["engines"][0].update(allow_remote=True, serve_args=serve_args)
    study = study_from_dict(embedded_raw)
    # The rules hand the cell and engine-build commands this dump; an engine left at the default dumps as before.
    assert study_from_dict(study.model_dump(mode="json", exclude_none=True)).engine("vllm-cpu").allow_remote
    assert "allow_remote" not in EngineSpec(name="e", kind="vllm").model_dump()


# --- a weightless model on an engine that cannot hold it ---------------------------------------------


def _dummy_on_cpu(raw: dict) -> dict:
    raw["models"].append(
        {"name": "big", "generate": "dummy", "architecture": "qwen3.6-35b-a3b", "max_model_len": 32768,
         "serve_args": ["--load-format", "dummy"]}
    )  # fmt: skip
    return raw


def test_a_weightless_gpu_shape_on_a_cpu_engine_is_refused_by_its_bytes(embedded_raw):
    from wmtp.engines.capacity import check_weightless_fit, weightless_bytes

    study = study_from_dict(_dummy_on_cpu(embedded_raw))
    # the 35B shape in bf16: about 66 GiB of weights, whatever memory the machine has
    assert 60 * 2**30 < weightless_bytes("qwen3.6-35b-a3b") < 75 * 2**30
    with pytest.raises(ConfigError, match=r"models\[1\] 'big' .* allocates 6\d GiB .* engine 'vllm-cpu'"):
        check_weightless_fit(study, memory_bytes=24 * 2**30)
    check_weightless_fit(study, memory_bytes=512 * 2**30)  # a machine that holds it


def test_check_config_refuses_it_before_any_server_starts(embedded_raw, tmp_path, capsys):
    from wmtp.cli import main

    study_file = tmp_path / "big.yaml"
    study_file.write_text(yaml.safe_dump(_dummy_on_cpu(embedded_raw)))
    assert main(["check-config", "--config", str(study_file)]) == 2
    assert "allocates" in capsys.readouterr().err
