"""The workflow itself: lint, a dry run per shipped study, and the Spark profile as a user types it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]


def run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([*SNAKEMAKE, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def job_counts(output: str) -> dict[str, int]:
    table = output.split("Job stats:", 1)[1]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.MULTILINE)}


def test_lint_is_clean():
    out = run("--lint")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Lints for" not in out.stdout + out.stderr, out.stdout + out.stderr


def scratch_dirs(tmp_path: Path) -> list[str]:
    """Snakemake arguments that put a dry run's results, models and engines under ``tmp_path``."""
    return [
        "--config",
        f"results_dir={tmp_path}/results",
        f"models_dir={tmp_path}/models",
        f"engines_dir={tmp_path}/engines",
    ]


def test_dry_run_embedded_study(tmp_path):
    out = run("-n", *scratch_dirs(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    jobs = job_counts(out.stdout)
    assert jobs["cell"] == 5 and jobs["engine"] == 1 and jobs["trained_model"] == 1
    assert jobs["admission"] == 1 and jobs["collect"] == 1 and jobs["report"] == 1


@pytest.fixture
def spark_model_placeholder():
    """The Spark study's checkpoint path, as an empty placeholder (only for the dry run)."""
    path = REPO / "models" / "Qwen3.6-35B-A3B-NVFP4-Fast"
    created = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    yield path
    if created:
        shutil.rmtree(path)
        if not any((REPO / "models").iterdir()):
            (REPO / "models").rmdir()


def test_spark_profile_dry_run_as_typed(spark_model_placeholder):
    out = run("-n", "--profile", "spark", "-j1")
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout + out.stderr
    assert "config/studies/spark-128k.yaml" in text
    jobs = job_counts(out.stdout)
    assert jobs["cell"] == 2 and jobs["engine"] == 1
    assert "tiny_model" not in jobs
    assert "results/spark-128k/raw/model~qwen3.6-35b-a3b-nvfp4/engine~vllm/arm~mtp/k~3/c~1/manifest.json" in text
    # Cells hold the GPU: the profile allows one at a time.
    assert re.search(r"resources: .*gpu=1", text)


def test_h200_study_dry_run(tmp_path):
    """The H200 study, measured in pieces, plans its weightless model, its engine, every piece it lists, a collect
    per group of pieces and its step file; no whole cell and no report (tests/test_pieces.py has the rest)."""
    out = run("-n", "--configfile", "config/studies/h200-vllm.yaml", *scratch_dirs(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    jobs = job_counts(out.stdout)
    assert jobs["dummy_model"] == 1 and jobs["engine"] == 1 and jobs["piece"] == 27
    assert jobs["collect_pieces"] == 6 and jobs["step_table"] == 1
    assert not {"cell", "collect", "report", "tiny_model", "trained_model"} & set(jobs)
    assert re.search(r"-m wmtp\.model\.dummy --architecture \S*/config/models/qwen3\.6-35b-a3b\.json ", out.stdout)
    assert "--max-position-embeddings 1049600" in out.stdout


def test_the_h200_sglang_study_plans_its_pieces_on_the_carried_sglang(tmp_path):
    """SGLang's H200 study: the same weightless model, the carried SGLang as its engine, each listed piece, a step
    file; every server exports its metrics and drafts on FlashAttention, which the SGLang plugin windows."""
    out = run("-n", "-p", "--configfile", "config/studies/h200-sglang.yaml", *scratch_dirs(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    jobs = job_counts(out.stdout)
    assert jobs["dummy_model"] == 1 and jobs["engine"] == 1 and jobs["piece"] == 12 and jobs["step_table"] == 1
    assert not {"cell", "collect", "report"} & set(jobs)
    assert "results/h200-sglang/steps/qwen3.6-35b-a3b~sglang.csv" in out.stdout


def test_the_sglang_proofs_study_judges_its_recorded_answers(tmp_path):
    out = run("-n", "--configfile", "config/studies/h200-sglang-proofs.yaml", *scratch_dirs(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    jobs = job_counts(out.stdout)
    assert jobs["piece"] == 4 and jobs["lossless_pieces"] == 1 and jobs["step_table"] == 1


def test_the_h200_profile_study_plans_one_traced_server_per_arm(tmp_path):
    from wmtp.config import load_study

    study = load_study(REPO / "config" / "studies" / "h200-vllm-profile.yaml")
    assert study.protocol.profile_iterations == 8 and study.protocol.concurrency == [1]
    assert sorted(c.arm for c in study.cells()) == ["mtp", "none", "wmtp"]
    out = run("-n", "--configfile", "config/studies/h200-vllm-profile.yaml", *scratch_dirs(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    jobs = job_counts(out.stdout)
    assert jobs["piece"] == 2 and jobs["collect_pieces"] == 1
    # What h200_background.sh asks for once every piece is there: the step file and the trace table.
    listed = subprocess.run(
        [sys.executable, "-m", "wmtp", "pieces", "--config", "config/studies/h200-vllm-profile.yaml", "--step-files"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    assert [Path(line).name for line in listed.stdout.split()] == ["qwen3.6-35b-a3b~vllm.csv", "traces.csv"]


def test_the_tuned_h200_study_serves_its_attention_options_and_its_step_file_keeps_them(tmp_path):
    """The tuned engine's servers get --attention-config as one argv word, and the step file's column reads it back
    from that argv: the report tells this engine from the default one by it."""
    from wmtp.analyze.tidy import attention_config
    from wmtp.config import load_study
    from wmtp.engines.base import ServeRequest
    from wmtp.engines.vllm import serve_argv

    study = load_study(REPO / "config" / "studies" / "h200-vllm-tuned.yaml")
    (engine,) = study.engines
    cell = next(c for c in study.cells() if c.arm == "wmtp")
    request = ServeRequest(
        python="python3", model_dir="m", served_name="m", port=1, max_model_len=1049600, draft=cell,
        engine_args=tuple(engine.serve_args),
    )  # fmt: skip
    assert attention_config(serve_argv(request)) == "flash_attn_max_num_splits_for_cuda_graph=128"
    out = run("-n", "--configfile", "config/studies/h200-vllm-tuned.yaml", *scratch_dirs(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    jobs = job_counts(out.stdout)
    assert jobs["piece"] == 2 and jobs["collect_pieces"] == 1 and jobs["step_table"] == 1
    assert "results/h200-vllm-tuned/steps/qwen3.6-35b-a3b~vllm-tuned.csv" in out.stdout


def test_the_h100_study_serves_the_35b_at_128k_under_a_name_of_its_own(tmp_path):
    """The 35B's weights leave an H100 room for 128K, not 1M: the model is served at 128K plus the output and the
    draft's tokens, under a name that keeps its step file apart from the H200's: every arm in three servers, the
    window-off control in one."""
    from wmtp.config import load_study

    study = load_study(REPO / "config" / "studies" / "h100-vllm.yaml")
    (model,) = study.models
    rung = max(study.protocol.rungs)
    assert rung + study.protocol.output_tokens + 3 <= model.max_model_len < 2 * rung
    assert model.name != load_study(REPO / "config" / "studies" / "h200-vllm.yaml").models[0].name
    out = run("-n", "--configfile", "config/studies/h100-vllm.yaml", *scratch_dirs(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    jobs = job_counts(out.stdout)
    assert jobs["dummy_model"] == 1 and jobs["piece"] == 10 and jobs["step_table"] == 1
    assert "results/h100-vllm/steps/qwen3.6-35b-a3b-128k~vllm.csv" in out.stdout


def test_the_float32_state_study_serves_the_35b_with_its_checkpoints_state_dtype_under_a_name_of_its_own(tmp_path):
    """vLLM 0.24 keeps a Qwen3-Next's recurrent state in bf16 unless told: every server of this study is told float32,
    the state the facts file gives, and its step file is its own, never h200-vllm's."""
    from wmtp.config import load_study
    from wmtp.engines.base import ServeRequest, flag_value
    from wmtp.engines.vllm import serve_argv

    study = load_study(REPO / "config" / "studies" / "h200-vllm-f32-state.yaml")
    (engine,) = study.engines
    (model,) = study.models
    facts = json.loads((REPO / "config" / "models" / f"{model.architecture}.json").read_text())
    for cell in study.cells():
        request = ServeRequest(
            python="python3", model_dir="m", served_name="m", port=1, max_model_len=model.max_model_len, draft=cell,
            engine_args=tuple(engine.serve_args), model_args=tuple(model.serve_args),
        )  # fmt: skip
        assert flag_value(serve_argv(request), "--mamba-ssm-cache-dtype") == facts["dtypes"]["recurrent_state"]
    out = run("-n", "--configfile", "config/studies/h200-vllm-f32-state.yaml", *scratch_dirs(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    jobs = job_counts(out.stdout)
    assert jobs["dummy_model"] == 1 and jobs["piece"] == 3 and jobs["step_table"] == 1
    assert "results/h200-vllm-f32-state/steps/qwen3.6-35b-a3b-f32-state~vllm.csv" in out.stdout


def test_the_paper_shapes_study_writes_three_nvfp4_dummies_and_plans_a_piece_per_model_and_arm(tmp_path):
    out = run("-n", "--configfile", "config/studies/h200-paper-shapes.yaml", *scratch_dirs(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    jobs = job_counts(out.stdout)
    assert jobs["dummy_model"] == 3 and jobs["piece"] == 9 and jobs["step_table"] == 3
    for facts in ("qwen3.6-35b-a3b", "qwen3.5-122b-a10b", "nemotron-3-super-120b-a12b"):
        assert re.search(rf"-m wmtp\.model\.dummy --architecture \S*/config/models/{re.escape(facts)}\.json .*"
                         r"--max-position-embeddings 1040576 --quantization nvfp4 ", out.stdout), facts  # fmt: skip


def test_the_paper_shapes_qwen_servers_keep_the_recurrent_state_in_the_checkpoints_float32():
    """The dummy of a Qwen is a Qwen3-Next, whose state vLLM 0.24 keeps in bf16 unless told; Nemotron-H's it keeps
    in float32 by itself."""
    from wmtp.config import load_study
    from wmtp.engines.base import ServeRequest, flag_value
    from wmtp.engines.vllm import serve_argv

    study = load_study(REPO / "config" / "studies" / "h200-paper-shapes.yaml")
    (engine,) = study.engines
    told = {}
    for model in study.models:
        facts = json.loads((REPO / "config" / "models" / f"{model.architecture}.json").read_text())
        cell = next(c for c in study.cells() if c.model == model.name and c.arm == "wmtp")
        request = ServeRequest(
            python="python3", model_dir="m", served_name="m", port=1, max_model_len=model.max_model_len, draft=cell,
            engine_args=tuple(engine.serve_args), model_args=tuple(model.serve_args),
        )  # fmt: skip
        told[facts["family"]] = flag_value(serve_argv(request), "--mamba-ssm-cache-dtype")
        if facts["family"] == "gdn_moe":
            assert told["gdn_moe"] == facts["dtypes"]["recurrent_state"] == "float32", model.name
    assert told == {"gdn_moe": "float32", "mamba2_moe": None}


def test_bad_config_fails_before_anything_runs(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "config" / "config.yaml").read_text().replace("k: [3]", "k: [0]"))
    out = run("-n", "--configfile", str(bad))
    assert out.returncode != 0
    assert "arms[1].k[0] must be ≥ 1 for arm 'mtp' (got 0)" in out.stdout + out.stderr


def files_under(folder: Path) -> set[str]:
    """Every path under ``folder``, not following links (results/engines may link to a large shared folder)."""
    found = set()
    for root, dirs, files in os.walk(folder):
        found.update(os.path.join(root, name) for name in dirs + files)
    return found


def broken_spark_study(tmp_path: Path) -> Path:
    """The Spark study with one bracket left open on line 22 (its engine's packages)."""
    text = (REPO / "config" / "studies" / "spark-128k.yaml").read_text()
    assert text.splitlines()[21] == '    packages: ["vllm==0.24.0"]'
    study = tmp_path / "broken.yaml"
    study.write_text(text.replace('packages: ["vllm==0.24.0"]', 'packages: ["vllm==0.24.0"', 1))
    return study


# How a user names a study: plain, after the Spark profile (the default profile applies after it) and with the SLURM
# workflow profile (which replaces the default one). A study file that cannot be read stops each of them.
ENTRY_POINTS = {
    "plain": [],
    "spark": ["--profile", "spark", "-j1"],
    "slurm": ["--workflow-profile", "slurm"],
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_yaml_error_stops_every_entry_point_before_the_dag_and_verbose_names_the_line(tmp_path, entry):
    """Snakemake reads --configfile before any workflow code runs: its own sentence names no line, and its
    --verbose shows the YAML error it carries (docs/design.md, "Reading a study file")."""
    study = broken_spark_study(tmp_path)
    before = files_under(REPO / "results")
    out = run("-n", *ENTRY_POINTS[entry], "--configfile", str(study))
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "Config file is not valid JSON or YAML" in text, text
    assert "Building DAG" not in text
    verbose = run("-n", "--verbose", *ENTRY_POINTS[entry], "--configfile", str(study))
    text = verbose.stdout + verbose.stderr
    assert verbose.returncode != 0, text
    # The unclosed bracket begins on line 22; the parser notices on line 23.
    assert f'in "{study}", line 22, column 15' in text, text
    assert f'in "{study}", line 23, column 5' in text, text
    assert "Building DAG" not in text
    assert files_under(REPO / "results") == before


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_missing_study_file_is_named(tmp_path, entry):
    missing = tmp_path / "no-such-study.yaml"
    before = files_under(REPO / "results")
    out = run("-n", *ENTRY_POINTS[entry], "--configfile", str(missing))
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert f"No such file or directory: '{missing}'" in text, text
    assert "Building DAG" not in text
    assert files_under(REPO / "results") == before


def test_check_config_names_the_file_line_and_column(tmp_path):
    study = broken_spark_study(tmp_path)
    check = [sys.executable, "-m", "wmtp", "check-config", "--config"]
    out = subprocess.run([*check, str(study)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert (
        f"config: {study}, line 23, column 5: expected ',' or ']', but got '<scalar>' "
        "(while parsing a flow sequence that begins at line 22, column 15)"
    ) in out.stderr, out.stderr
    missing = tmp_path / "no-such-study.yaml"
    out = subprocess.run([*check, str(missing)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert f"config: study file {missing} does not exist" in out.stderr, out.stderr


def test_a_wrong_value_names_the_file_and_the_key(tmp_path):
    """A file Snakemake could read is read again by wmtp: the message names the file before the key."""
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "config" / "config.yaml").read_text().replace("k: [3]", "k: [0]"))
    out = run("-n", "--configfile", str(bad))
    assert out.returncode != 0
    assert f"{bad}: config: arms[1].k[0] must be ≥ 1 for arm 'mtp' (got 0)" in out.stdout + out.stderr


def test_a_dry_run_writes_nothing(tmp_path):
    """Parsing the workflow (a dry run, or a second invocation beside a running one) never writes a file."""
    results = tmp_path / "results"
    out = run("-n", "--config", f"results_dir={results}", f"models_dir={tmp_path}/models")
    assert out.returncode == 0, out.stdout + out.stderr
    assert not results.exists() and not (tmp_path / "models").exists()


def test_another_study_inherits_nothing_from_the_embedded_default(spark_model_placeholder):
    """--configfile replaces config/config.yaml: the Spark study's cells measure code prompts only (the embedded
    study also has the copy task) and the plan names the Spark study's own results."""
    out = run("-n", "-p", "--configfile", "config/studies/spark-128k.yaml", "--forceall")
    assert out.returncode == 0, out.stdout + out.stderr
    cell_commands = [line for line in out.stdout.splitlines() if " cell --study-json " in line]
    assert len(cell_commands) == 2
    for line in cell_commands:
        assert '"workloads": ["code"]' in line and '"copy"' not in line
        assert '"study": "spark-128k"' in line
    assert "results/embedded" not in out.stdout


def test_the_code_that_computes_the_tables_and_the_report_is_their_input(tmp_path):
    """A change to how a table or the report is computed must rerun it: Snakemake's own code trigger sees only a
    rule's shell command, so the source files are inputs."""
    out = run(
        "-n",
        "--forceall",
        "--config",
        f"results_dir={tmp_path}/results",
        f"models_dir={tmp_path}/models",
        f"engines_dir={tmp_path}/engines",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    inputs = {
        m.group(1): m.group(2)
        for m in re.finditer(r"^(?:local)?rule (\w+):\n\s+input: (.*)$", out.stdout, re.MULTILINE)
    }
    for rule, source in (
        ("collect", "analyze/tidy.py"),
        ("derive", "analyze/derive.py"),
        ("report", "report/sections.py"),
    ):
        assert f"src/wmtp/{source}" in inputs[rule], (rule, inputs.get(rule))


def test_the_report_reads_the_step_files_and_trace_tables_the_study_names(tmp_path):
    """A real engine's step files and a profiling study's trace tables reach the report as the study names them
    (replica.engine_steps, replica.traces), never as a glob of a folder: a study that names none hands the report
    none."""
    out = run("-n", "-p", *scratch_dirs(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    report = next(line for line in out.stdout.splitlines() if " report --study " in line)
    steps = "measurements/h200/vllm_qwen3.6-35b-a3b.csv measurements/h200/vllm-tuned/vllm_qwen3.6-35b-a3b.csv"
    assert report.endswith(f"--engine-steps {steps} --traces measurements/h200/vllm-profile/traces.csv")
    study = tmp_path / "no-steps.yaml"
    text = (REPO / "config" / "config.yaml").read_text()
    text = re.sub(r"  engine_steps: \[.*\]\n", "", text)
    study.write_text(re.sub(r"  traces: \[.*\]\n", "", text))
    out = run("-n", "-p", "--configfile", str(study), *scratch_dirs(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    report = next(line for line in out.stdout.splitlines() if " report --study " in line)
    assert re.search(r"--engine-steps\s+--traces\s*$", report) and "vllm_" not in report and "traces.csv" not in report
