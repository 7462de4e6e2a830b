"""A profiling study's cell: vLLM's own torch profiler traces each measured request's decode, and the cell keeps the
traces beside its raw files. Against the real vLLM CPU server; the study refuses what the cells cannot profile."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import REPO, engines_dir

from wmtp.config import ConfigError, load_study, study_from_dict
from wmtp.engines.base import CellRefused
from wmtp.engines.vllm import prefill_steps, serve_argv
from wmtp.layout import PROFILE_DIR, trace_file


def _raw(tmp_path: Path, **protocol: object) -> dict:
    raw = load_study(REPO / "config" / "config.yaml").model_dump(mode="json", exclude_none=True)
    raw.update(study="profiled", results_dir=str(tmp_path / "results"), engines_dir=str(engines_dir()))
    raw.pop("replica", None)
    raw["protocol"].update(protocol)
    return raw


def test_a_study_profiles_only_what_the_cells_can_trace(tmp_path):
    assert study_from_dict(_raw(tmp_path, profile_iterations=8)).protocol.profile_iterations == 8
    with pytest.raises(ConfigError, match=r"profile_iterations traces one request at a time.*concurrency \[1\]"):
        study_from_dict(_raw(tmp_path, profile_iterations=8, concurrency=[1, 2]))
    raw = _raw(tmp_path, profile_iterations=8)
    raw["engines"][0]["kind"] = "sglang"
    with pytest.raises(ConfigError, match=r"engines\[0\] .* is sglang; only vLLM's profiler"):
        study_from_dict(raw)
    # A study that does not profile keeps its cells' identities: the key is left out of its dump at 0.
    assert "profile_iterations" not in study_from_dict(_raw(tmp_path)).model_dump()["protocol"]


def test_the_server_is_asked_for_its_torch_profiler_only_when_the_cell_profiles(tmp_path):
    study = study_from_dict(_raw(tmp_path))
    cell = next(c for c in study.cells() if c.arm == "wmtp")
    from wmtp.engines.base import ServeRequest

    plain = ServeRequest(python="python", model_dir="m", served_name="m", port=1, max_model_len=64, draft=cell)
    assert "--profiler-config" not in serve_argv(plain)
    assert "--max-num-batched-tokens" not in serve_argv(plain)
    traced = ServeRequest(
        python="python", model_dir="m", served_name="m", port=1, max_model_len=64, draft=cell,
        profile_dir=tmp_path / "p", profile_iterations=6, profile_prompt_tokens=20_000,
    )  # fmt: skip
    argv = serve_argv(traced)
    config = json.loads(argv[argv.index("--profiler-config") + 1])
    assert config["torch_profiler_dir"] == str((tmp_path / "p").resolve()) and config["max_iterations"] == 6
    # 20,000 prompt tokens in chunks of 8,192 are three prefill steps; the trace starts at the second decode step.
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "8192" and config["delay_iterations"] == 5
    # A chunk the study sets is the one counted, and not set twice.
    own = serve_argv(replace(traced, engine_args=("--max-num-batched-tokens", "4096")))
    assert own.count("--max-num-batched-tokens") == 1
    assert json.loads(own[own.index("--profiler-config") + 1])["delay_iterations"] == 7
    # A chunk the engine would read but the cell cannot count is refused before any server starts.
    with pytest.raises(CellRefused, match=r"--max-num-batched-tokens '8k': a profiled server needs it as a plain"):
        serve_argv(replace(traced, engine_args=("--max-num-batched-tokens=8k",)))


def test_a_prefill_takes_one_engine_step_a_chunk():
    assert [prefill_steps(n, 8192) for n in (1, 8192, 8193, 131_072, 1_048_576)] == [1, 1, 2, 16, 128]


@pytest.mark.engine
@pytest.mark.timeout(900)
def test_each_measured_request_leaves_a_trace_of_its_decode(engine_python, tmp_path):
    """Through Snakemake: the cell rule keeps the traces among its outputs, and rule trace_table reads them."""
    raw = _raw(
        tmp_path,
        rungs=[1024],
        repeats=[2],
        output_tokens=1500,
        warmup_requests=1,
        profile_iterations=4,
        workloads=["code"],
    )
    raw.update(models_dir=str(tmp_path / "models"))
    raw["arms"] = [{"name": "wmtp", "k": [3], "sink": [16], "window": [256]}]
    study_file = tmp_path / "profiled.yaml"
    study_file.write_text(yaml.safe_dump(raw))
    study = study_from_dict(raw, base_dir=tmp_path)
    (cell,) = study.cells()
    traces_csv = trace_file(tmp_path / "results" / "profiled")
    snakemake = [sys.executable, "-m", "snakemake", "--cores", "2", "--resources", "gpu=1", "--nolock"]
    done = subprocess.run(
        [*snakemake, "--configfile", str(study_file), "--", str(traces_csv)],
        cwd=REPO, capture_output=True, text=True, timeout=840,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "results" / "profiled" / "raw" / cell.cell_id

    requests = pd.read_parquet(out / "requests.parquet")
    measured = requests[~requests["warmup"]]
    assert len(measured) == 2 and requests[requests["warmup"]]["profile_traces"].isna().all()
    traces = [list(t) for t in measured["profile_traces"]]
    # Each request its own traces, none shared, every one in the cell's profile folder.
    assert all(traces) and not set(traces[0]) & set(traces[1])
    files = sorted((out / PROFILE_DIR).glob("*.pt.trace.json*"))
    assert sorted(str(f.relative_to(out)) for f in files) == sorted(t for one in traces for t in one)
    for name in traces[0]:
        with gzip.open(out / name, "rt") as handle:
            events = json.load(handle)["traceEvents"]
        # vLLM's annotation of each engine step: decode steps of the one request (no prefill in them), at most the
        # iterations asked for (and the one that stopped it), with the engine's attention ops inside.
        steps = [str(e["name"]) for e in events if str(e.get("name", "")).startswith("execute_context_")]
        assert steps and all(re.fullmatch(r"execute_context_0\(0\)_generation_1\(\d+\)", n) for n in steps), steps
        assert len(steps) <= 5
        assert any("attention" in str(e.get("name", "")) for e in events)

    # The trace table reads the same traces: a row per traced request, its steps those of a k-3 draft (1 to 4 tokens
    # a step), and no device time on the CPU build (the wall time is the host's).
    table = pd.read_csv(traces_csv)
    assert len(table) == 2 and set(table["trace"]) == {t for one in traces for t in one}
    assert table["steps"].between(1, 5).all() and table["tokens_per_step"].between(1, 4).all()
    assert (table["wall_us"] > 0).all() and (table["device_busy_us"] == 0).all() and set(table["component"]) == {"none"}
