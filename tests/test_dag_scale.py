"""Dry runs at scale: the paper's 1M study builds its DAG, and a matrix of more than 1,000 cells builds its
DAG quickly (goal: under 5 s of DAG building on top of Snakemake's own start-up).

Checkpoint directories are placeholders the tests create in tmp (the config checks that they exist);
nothing runs. Snakemake is timed by the CPU time of its process (user + sys), which a busy CI box inflates
far less than wall-clock time; both are printed (``pytest -s``) and the CPU time is asserted.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DAG_BUDGET_S = float(os.environ.get("WMTP_DAG_BUDGET_S", "5"))


def _placeholders(raw: dict, tmp: Path) -> dict:
    """The study with its results in tmp and each checkpoint path an empty directory in tmp."""
    raw = dict(
        raw, results_dir=str(tmp / "results"), engines_dir=str(tmp / "engines"), models_dir=str(tmp / "generated")
    )
    models = []
    for model in raw["models"]:
        model = dict(model)
        if model.get("path"):
            model["path"] = str(tmp / "models" / Path(model["path"]).name)
            Path(model["path"]).mkdir(parents=True, exist_ok=True)
        models.append(model)
    raw["models"] = models
    return raw


def _dry_run(config: Path, *extra: str) -> tuple[subprocess.CompletedProcess, float, float]:
    """``snakemake -n`` from the repo root; returns the process, its wall time and its CPU time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--nolock", "--configfile", str(config), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, wall, cpu


def _job_counts(output: str) -> dict[str, int]:
    table = output.split("Job stats:", 1)[1]
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+)\s+(\d+)$", table, re.MULTILINE)}


def test_paper_1m_dry_run(tmp_path):
    raw = _placeholders(yaml.safe_load((REPO / "config" / "studies" / "paper-1m.yaml").read_text()), tmp_path)
    assert max(raw["protocol"]["rungs"]) == 1_040_000
    assert {a["name"] for a in raw["arms"]} == {"none", "mtp", "wmtp"} and len(raw["protocol"]["concurrency"]) > 1
    assert [e["kind"] for e in raw["engines"]] == ["sglang"] and raw["engines"][0]["device"] == "cuda"
    assert all(m.get("hf_id") for m in raw["models"]) and len(raw["models"]) == 3
    config = tmp_path / "paper-1m.yaml"
    config.write_text(yaml.safe_dump(raw))
    proc, _, _ = _dry_run(config)
    counts = _job_counts(proc.stdout)
    # 3 models × (none + mtp: 3 k + wmtp: 3 k × 1 sink × 1 window) × 2 concurrencies.
    assert counts["cell"] == 42 and counts["engine"] == 1 and counts["report"] == 1
    assert "--speculative-algorithm" not in proc.stdout  # the server argv is built when a cell runs, not in the DAG


def _big_matrix(tmp: Path) -> tuple[Path, int]:
    """2 engines × 4 models × (none + mtp 5 k + wmtp 5 k × 2 sinks × 4 windows) × 3 concurrencies = 1,104."""
    ks = [1, 2, 3, 4, 5]
    raw = {
        "study": "dag-scale",
        "engines": [
            {"name": "sglang", "kind": "sglang", "device": "cuda", "packages": ["sglang==0.5.21"]},
            {"name": "vllm", "kind": "vllm", "device": "cuda", "packages": ["vllm==0.24.0"]},
        ],
        "models": [{"name": f"m{i}", "path": f"models/m{i}", "max_model_len": 1_049_600} for i in range(4)],
        "arms": [
            {"name": "none"},
            {"name": "mtp", "k": ks},
            {"name": "wmtp", "k": ks, "sink": [0, 64], "window": [1024, 2048, 4032, 8192]},
        ],
        "protocol": {"rungs": [8192, 131072, 1_048_576], "repeats": 2, "concurrency": [1, 2, 4]},
    }
    n_cells = 2 * 4 * (1 + 5 + 5 * 2 * 4) * 3
    config = tmp / "big.yaml"
    config.write_text(yaml.safe_dump(_placeholders(raw, tmp)))
    return config, n_cells


def test_dag_of_more_than_1000_cells_builds_fast(tmp_path):
    config, n_cells = _big_matrix(tmp_path)
    assert n_cells >= 1000
    one = _placeholders(
        {
            **yaml.safe_load(config.read_text()),
            "study": "dag-one",
            "engines": yaml.safe_load(config.read_text())["engines"][:1],
            "arms": [{"name": "none"}],
            "protocol": {"rungs": [8192], "repeats": 1, "concurrency": [1]},
        },
        tmp_path,
    )
    one["models"] = one["models"][:1]
    one_config = tmp_path / "one.yaml"
    one_config.write_text(yaml.safe_dump(one))
    # Warm the file cache and the bytecode once, then measure.
    _dry_run(one_config, "-q")
    _, base_wall, base_cpu = _dry_run(one_config, "-q")
    _, wall, cpu = _dry_run(config, "-q")
    proc, _, _ = _dry_run(config)
    assert _job_counts(proc.stdout)["cell"] == n_cells
    dag_cpu = cpu - base_cpu
    print(
        f"\nsnakemake -n for {n_cells} cells: {wall:.2f} s wall, {cpu:.2f} s CPU; one cell: {base_wall:.2f} s wall, "
        f"{base_cpu:.2f} s CPU; the DAG of {n_cells} cells: {dag_cpu:.2f} s CPU ({1000 * dag_cpu / n_cells:.1f} ms "
        "a cell)"
    )
    assert dag_cpu < DAG_BUDGET_S, (
        f"building the DAG of {n_cells} cells took {dag_cpu:.2f} s of CPU beyond "
        f"Snakemake's start-up ({cpu:.2f} s in all, {wall:.2f} s wall); "
        f"goal {DAG_BUDGET_S} s"
    )
