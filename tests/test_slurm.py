"""The embedded study through a real SLURM (scripts/ci/slurm-up.sh: one node, fake gpu:2 gres) with the
shipped slurm profile: the tiny model and the cell become sbatch jobs, the cell asks for a GPU and gets
CUDA_VISIBLE_DEVICES, the raw files appear, and the localrules (engine, collect, report) run here.

A small matrix keeps it to a few minutes on a 2-core box: one arm (mtp), one rung, one repeat, a few output
tokens; the engine is the one `make engine` builds (tests/conftest.py), results go to tmp. In CI (CI=true)
a SLURM that is not up is a failure, not a skip; elsewhere the test starts it with the script when it can.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import engines_dir

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[1]
ENGINES = engines_dir()
UP_SCRIPT = REPO / "scripts" / "ci" / "slurm-up.sh"
DOWN_SCRIPT = REPO / "scripts" / "ci" / "slurm-down.sh"
CELL = "model~tiny/engine~vllm-cpu/arm~mtp/k~3/c~1"
RUNG = 256
SNAKEMAKE_TIMEOUT_S = 1200
IN_CI = os.environ.get("CI", "").lower() in ("true", "1")


def _not_ready() -> str | None:
    """Why SLURM cannot take jobs here, or None when it can."""
    for tool in ("sbatch", "squeue", "scontrol", "sinfo"):
        if not shutil.which(tool):
            return f"{tool} is not installed"
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
    if ping.returncode != 0 or "UP" not in ping.stdout:
        return f"slurmctld does not answer: {(ping.stdout + ping.stderr).strip()[:200]}"
    states = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30).stdout.split()
    if not any(s.startswith(("idle", "mix", "alloc")) for s in states):
        return f"no node takes jobs (states: {states})"
    return None


@pytest.fixture(scope="module")
def slurm():
    reason = _not_ready()
    if reason is None:
        yield
        return
    if IN_CI:
        pytest.fail(f"SLURM is not up in CI: {reason}. .ci/run starts it with {UP_SCRIPT.relative_to(REPO)}")
    if os.geteuid() != 0:
        pytest.skip(f"SLURM is not up ({reason}) and starting it needs root: run {UP_SCRIPT} as root")
    proc = subprocess.run(["timeout", "600", str(UP_SCRIPT)], capture_output=True, text=True)
    reason = _not_ready()
    try:
        if reason is not None:
            pytest.skip(f"could not start SLURM with {UP_SCRIPT} ({reason}): {proc.stderr[-1500:]}")
        yield
    finally:  # the test started SLURM's daemons, so it stops them
        subprocess.run([str(DOWN_SCRIPT)], capture_output=True, timeout=120, check=False)


def _cell_process_env(results: Path) -> dict[str, str]:
    """The environment of the running ``wmtp ... cell`` process of this test (read from /proc)."""
    found = subprocess.run(["pgrep", "-f", "--", f"-m wmtp .* cell .*{results}"], capture_output=True, text=True)
    for pid in found.stdout.split():
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
        if "SLURM_JOB_ID" in env:
            return env
    return {}


def _ci_profile(tmp: Path) -> Path:
    """The shipped profile with only sizes shrunk to this box (2 cores, 24 GB); gpu=1 stays as shipped."""
    profile = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
    profile["set-resources"]["cell"].update(mem_mb=8000, cpus_per_task=2, runtime=30)
    profile["set-resources"]["tiny_model"].update(mem_mb=4000, runtime=15)
    profile["default-resources"].update(mem_mb=1000, runtime=10)
    profile.update(
        {
            "latency-wait": 15,
            "retries": 0,
            "local-cores": 2,
            # Poll soon and often: cells here take a minute or two, not hours.
            "slurm-init-seconds-before-status-checks": 5,
            "slurm-keep-successful-logs": True,
            "slurm-logdir": str(tmp / "slurm_logs"),
        }
    )
    out = tmp / "profile-slurm-ci"
    out.mkdir()
    (out / "config.yaml").write_text(yaml.safe_dump(profile))
    return out


@pytest.fixture(scope="module")
def slurm_run(slurm, tmp_path_factory, engine_python):
    tmp = tmp_path_factory.mktemp("slurm")
    raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    raw.update(
        study="embedded-slurm",
        results_dir=str(tmp / "results"),
        engines_dir=str(ENGINES),
        models_dir=str(tmp / "models"),
        arms=[{"name": "mtp", "k": [3]}],
        # the random-weight model: its generation is a batch job without a GPU, next to the cell's
        models=[{"name": "tiny", "generate": "tiny", "seed": 0, "max_model_len": 4096}],
    )
    raw["protocol"].update(
        rungs=[RUNG], workloads=["code"], repeats=1, output_tokens=12, warmup_requests=1, warmup_output_tokens=4
    )
    study = tmp / "study.yaml"
    study.write_text(yaml.safe_dump(raw))
    profile = _ci_profile(tmp)
    log = tmp / "snakemake.log"
    argv = [
        "timeout",
        "--kill-after=30",
        str(SNAKEMAKE_TIMEOUT_S),
        sys.executable,
        "-m",
        "snakemake",
        "--workflow-profile",
        str(profile),
        "--configfile",
        str(study),
        "--nolock",
        # The engine is shared with the other tests: its manifest's age decides, not its params.
        "--rerun-triggers",
        "mtime",
    ]
    cell_env: dict[str, str] = {}
    with log.open("w") as out:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if not cell_env:  # the cell's own process, inside its SLURM job: what environment did it get?
                cell_env = _cell_process_env(tmp / "results")
            time.sleep(1.0)
    text = log.read_text()
    jobs = {
        m.group(2): m.group(1)
        for m in re.finditer(r"submitted with SLURM jobid (\d+) \(log: \S*/slurm_logs/rule_(\w+)/", text)
    }
    if proc.returncode != 0:
        ids = list(jobs.values())
        if ids:
            subprocess.run(["scancel", *ids], capture_output=True)
        pytest.fail(f"snakemake through SLURM failed ({proc.returncode}); last lines of {log}:\n{text[-4000:]}")
    job_info = {}
    for rule, job_id in jobs.items():
        shown = subprocess.run(["scontrol", "-d", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
        job_info[rule] = shown
    return {
        "tmp": tmp,
        "log": text,
        "jobs": jobs,
        "job_info": job_info,
        "cell_env": cell_env,
        "results": tmp / "results" / "embedded-slurm",
    }


def test_cells_become_slurm_jobs(slurm_run):
    assert set(slurm_run["jobs"]) == {"tiny_model", "cell"}, slurm_run["log"][-3000:]
    for rule in ("engine", "collect", "report"):  # localrules never reach sbatch
        assert f"rule_{rule}/" not in slurm_run["log"]


def test_the_cell_job_asked_for_a_gpu_and_got_one(slurm_run):
    cell, tiny = slurm_run["job_info"]["cell"], slurm_run["job_info"]["tiny_model"]
    assert "JobState=COMPLETED" in cell, cell
    # --gpus=1 comes from the shipped profile's set-resources.
    assert re.search(r"TresPerJob=\S*gpu[:=]1", cell) and "JOB_GRES=gpu:1" in cell, cell
    assert "gpu" not in re.sub(r"\b(Command|WorkDir|StdOut|StdErr|StdIn)=\S*", "", tiny), tiny
    # The cell process ran inside that job and SLURM gave it one of the node's (fake) GPUs.
    env = slurm_run["cell_env"]
    assert env, "never saw the cell's process while it ran"
    assert env["SLURM_JOB_ID"] == slurm_run["jobs"]["cell"]
    assert env.get("CUDA_VISIBLE_DEVICES") in ("0", "1"), env.get("CUDA_VISIBLE_DEVICES")


def test_raw_files_tidy_tables_and_report(slurm_run):
    raw = slurm_run["results"] / "raw" / CELL
    manifest = json.loads((raw / "manifest.json").read_text())
    assert manifest["cell_id"] == CELL and manifest["exit_status"] is not None
    requests = pd.read_parquet(raw / "requests.parquet")
    measured = requests[~requests["warmup"]]
    assert (measured["rung"] == RUNG).all() and (measured["prompt_tokens"] == RUNG).all()
    rungs = pd.read_parquet(slurm_run["results"] / "tidy" / "rungs.parquet")
    assert list(rungs["arm"]) == ["mtp"] and (rungs["tok_per_verify"] >= 1).all()
    html = (slurm_run["results"] / "report" / "index.html").read_text()
    assert "<html" in html.lower()
