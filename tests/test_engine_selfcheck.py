"""The engine build's behavioural self-check: a real windowed draft on the CPU build, counted by the plugin."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import ENGINE_NAME, engines_dir

from wmtp.config import EngineSpec
from wmtp.engines.build import SELFCHECK_MODEL, EngineBuildError, behaviour_check

CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _selfcheck(engine_python: str, extra_env: dict[str, str]) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **CPU_ENV, **extra_env}
    # The engine's vLLM cache, which the cells share (wmtp.cli): a fresh one costs a subprocess importing vLLM.
    env.setdefault("VLLM_CACHE_ROOT", str(engines_dir() / ENGINE_NAME / "cache" / "vllm"))
    return subprocess.run(
        [engine_python, "-m", "wmtp.plugin.selfcheck", "--model", str(SELFCHECK_MODEL)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )


@pytest.mark.engine
def test_the_self_check_counts_windowed_drafts_and_skipped_blocks(engine_python):
    out = _selfcheck(engine_python, {})
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("WMTP-SELFCHECK "))
    found = json.loads(line.split(" ", 1)[1])
    assert found["windowed_forwards"] > 0
    # every decode forward after the prompt (p0 >= prompt) drops the blocks between the sink's (ceil(16 / B)) and
    # the one holding p0 - 128; the first forward, over the prompt itself (p0 = 0), drops none
    block, prompt = found["block_size"], found["prompt_tokens"]
    per_forward = (prompt - 128) // block - -(-16 // block)
    assert found["blocks_skipped"] >= (found["windowed_forwards"] - 1) * per_forward > 0


@pytest.mark.engine
def test_the_self_check_fails_with_the_plugins_message_when_the_hook_does_nothing(engine_python, tmp_path):
    (tmp_path / "control.json").write_text(json.dumps({"skip_window": True}))
    out = _selfcheck(engine_python, {"WMTP_PLUGIN_TEST_DIR": str(tmp_path)})
    assert out.returncode == 1
    assert "wmtp self-check failed: the windowed draft never ran" in out.stderr
    assert "0 of " in out.stderr and "draft forwards windowed" in out.stderr


def _spec(**kw) -> EngineSpec:
    return EngineSpec(name="e", kind="vllm", **kw)


def test_the_behaviour_check_is_not_run_where_it_cannot_be(tmp_path):
    gpu = behaviour_check("/nonexistent/python", _spec(device="cuda"), {})
    assert gpu["status"] == "not run" and "GPU" in gpu["why"]
    refused = behaviour_check("/nonexistent/python", _spec(device="cpu"), {"hook_points_refused": "no"})
    assert refused == {"status": "not run", "why": "the hook check refused this vLLM"}


def test_a_behaviour_check_that_prints_no_result_fails_the_build(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'the engine crashed' >&2\nexit 3\n")
    python.chmod(0o755)
    with pytest.raises(EngineBuildError, match=r"(?s)did not run .*exit 3.*the engine crashed"):
        behaviour_check(str(python), _spec(device="cpu"), {})


def _fake_engine(tmp_path, probe: dict):
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nif [ \"$1\" = -c ]; then echo 'WMTP-PROBE {json.dumps(probe)}'; fi\n")
    python.chmod(0o755)
    return EngineSpec(name="old", kind="vllm", device="cuda", source="python", python=str(python))


def test_a_hook_check_that_fails_fails_the_build_only_where_the_study_windows(tmp_path):
    from wmtp.engines.build import CHECKS_VERSION, build_engine

    spec = _fake_engine(tmp_path, {"vllm": "0.24.0", "hook_points_refused": "vLLM 0.24.0: fields ['_seq_lens_cpu']"})
    manifest = build_engine(spec, tmp_path / "plain")
    assert manifest["versions"]["hook_points_refused"].startswith("vLLM 0.24.0")
    assert manifest["checks_version"] == CHECKS_VERSION
    with pytest.raises(EngineBuildError, match=r"runs windowed arms on it, but vLLM 0\.24\.0"):
        build_engine(spec, tmp_path / "windowed", windowed=True)
    # an engine built for none/mtp is checked again when the study adds a windowed arm
    with pytest.raises(EngineBuildError, match="runs windowed arms"):
        build_engine(spec, tmp_path / "plain", windowed=True)


def test_an_interpreter_given_by_name_is_recorded_by_its_path(tmp_path, monkeypatch):
    from wmtp.engines.build import build_engine

    python = _fake_engine(tmp_path, {"vllm": "0.24.0"}).python
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    spec = EngineSpec(name="named", kind="vllm", device="cuda", source="python", python="python")
    manifest = build_engine(spec, tmp_path / "named")
    assert manifest["python"] == python and manifest["spec"]["python"] == "python"
