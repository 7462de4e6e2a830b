"""Faults against the real vLLM CPU server, through Snakemake: nothing lost, nothing left behind, no stale result.

One module-scoped run, three server starts, read by the tests below:

A. the cell process is SIGKILLed while its server runs: every process of the server is gone within 30 s;
   the model path holds spaces and ``$(touch …)``, which reaches no shell;
B. a plain rerun, and Ctrl-C (SIGINT to Snakemake's process group) while the server runs: the server is
   gone within 10 s and the cell leaves failure.json;
C. a plain rerun completes the cell; then dry runs show that changing the protocol reruns that cell, and
   adding a model runs only the new model's cell.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml
from conftest import engines_dir, wait_for

from wmtp import layout
from wmtp.measure.server import group_alive
from wmtp.measure.watchdog import group_members
from wmtp.model.train import install_fixture

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[1]
CELL = "model~tiny/engine~vllm-cpu/arm~none/c~1"
KILL_BUDGET_S = 30
INTERRUPT_BUDGET_S = 10


def _snakemake(study: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "snakemake", "--cores", "2", "--resources", "gpu=1", "--nolock",
            "--configfile", str(study), *extra]  # fmt: skip


def _serving_server(log: Path, proc: subprocess.Popen, seen: set[int]) -> int:
    """The process group of a server the cell log names that is not in ``seen``, once it runs its engine core.

    Snakemake starts a failed job's log afresh, so servers are told apart by pid, not by count.

    Faults are injected while the server starts (tens of seconds on a CPU): the tiny model serves a whole
    sweep in under a second once healthy, too short a window to hit reliably.
    """

    def started():
        text = log.read_text() if log.exists() else ""
        pids = [int(p) for p in re.findall(r"server pid (\d+)", text) if int(p) not in seen]
        return pids[0] if pids else None

    pgid = wait_for(started, 900, f"a server start after {sorted(seen)}", proc)
    seen.add(pgid)
    wait_for(lambda: len(group_members(pgid)) >= 2, 300, "the server's engine core process", proc)
    return pgid


def _gone_within(pgid: int, budget_s: float) -> float | None:
    """Seconds until no process of the group is left, or None if some outlived the budget."""
    started = time.monotonic()
    while time.monotonic() - started < budget_s:
        if not group_alive(pgid):
            return time.monotonic() - started
        time.sleep(0.1)
    return None


def _parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def wait_gone(path: Path, budget_s: float) -> bool:
    """Whether ``path`` still exists after waiting up to ``budget_s`` for it to go."""
    deadline = time.monotonic() + budget_s
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return path.exists()


def _short_tmp_of(pid: int) -> Path | None:
    """The cell's short temporary folder, as its server was given it (TMPDIR: the engine's sockets live there)."""
    for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
        if entry.startswith(b"TMPDIR="):
            found = Path(entry[len(b"TMPDIR=") :].decode())
            return found if found.name.startswith("wmtp-") else None
    return None


@pytest.fixture(scope="module")
def faults(tmp_path_factory, engine_python):
    tmp = tmp_path_factory.mktemp("faults")
    marker = f"PWNED-{uuid.uuid4().hex[:8]}"
    model_dir = tmp / "models dir" / f"a b $(touch {marker})x"
    # The committed checkpoint, copied: any servable model will do here, and building one costs an engine start-up.
    install_fixture(model_dir, seed=0)
    raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    raw.pop("replica", None)
    raw.update(
        study="faults",
        results_dir=str(tmp / "results"),
        engines_dir=str(engines_dir()),
        models_dir=str(tmp / "generated"),
        replica={"raw": str(REPO / "measurements" / "h200")},
        models=[{"name": "tiny", "path": str(model_dir), "max_model_len": 2048}],
        arms=[{"name": "none"}],
    )
    raw["protocol"].update(
        rungs=[512], repeats=1, output_tokens=16, warmup_requests=1, warmup_prompt_tokens=64, workloads=["code"]
    )
    study = tmp / "study.yaml"
    study.write_text(yaml.safe_dump(raw))
    results = tmp / "results" / "faults"
    cell_dir = results / "raw" / CELL
    cell_log = results / "logs" / "cells" / f"{CELL}.log"
    facts: dict = {"marker": marker}
    seen: set[int] = set()

    # A: SIGKILL of the cell process while its server serves.
    killed_tmp = None
    with (tmp / "snakemake-a.log").open("w") as out:
        proc = subprocess.Popen(_snakemake(study), cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        try:
            pgid = _serving_server(cell_log, proc, seen)
            cell_pid = _parent_of(pgid)
            killed_tmp = _short_tmp_of(pgid)
            os.kill(cell_pid, signal.SIGKILL)
            facts["a_gone_s"] = _gone_within(pgid, KILL_BUDGET_S)
            facts["a_rc"] = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    # A SIGKILLed cell cannot remove its short temporary folder: its watchdog does, once the server is gone.
    facts["a_tmp_named"] = killed_tmp is not None
    facts["a_tmp_left"] = killed_tmp is not None and wait_gone(killed_tmp, KILL_BUDGET_S)
    facts["a_files"] = sorted(p.name for p in cell_dir.iterdir()) if cell_dir.exists() else []

    # B: a plain rerun; Ctrl-C to Snakemake's whole process group, as a terminal sends it.
    with (tmp / "snakemake-b.log").open("w") as out:
        proc = subprocess.Popen(
            _snakemake(study), cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            pgid = _serving_server(cell_log, proc, seen)
            os.killpg(proc.pid, signal.SIGINT)
            facts["b_gone_s"] = _gone_within(pgid, INTERRUPT_BUDGET_S)
            facts["b_rc"] = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    facts["b_failure"] = (cell_dir / "failure.json").exists()

    # C: a plain rerun completes.
    third = subprocess.run(_snakemake(study), cwd=REPO, capture_output=True, text=True, timeout=1500)
    facts["c_rc"], facts["c_out"] = third.returncode, third.stdout + third.stderr
    facts["c_files"] = sorted(p.name for p in cell_dir.iterdir())

    # D: a finished cell's table cut short: a plain run sets its files aside and measures it again.
    requests_file = cell_dir / "requests.parquet"
    with requests_file.open("r+b") as f:
        f.truncate(100)
    fourth = subprocess.run(_snakemake(study), cwd=REPO, capture_output=True, text=True, timeout=1500)
    facts["d_rc"], facts["d_out"] = fourth.returncode, fourth.stdout + fourth.stderr
    facts["d_intact"] = requests_file.stat().st_size > 100 and not layout.damaged_files(cell_dir)
    facts["d_aside"] = sorted(str(p.relative_to(cell_dir)) for p in cell_dir.glob("damaged-*/requests.parquet"))
    facts["d_aside_size"] = [p.stat().st_size for p in cell_dir.glob("damaged-*/requests.parquet")]

    # E: the tidy tables removed: a plain run makes them again.
    shutil.rmtree(results / "tidy")
    fifth = subprocess.run(_snakemake(study), cwd=REPO, capture_output=True, text=True, timeout=1500)
    facts["e_rc"], facts["e_out"] = fifth.returncode, fifth.stdout + fifth.stderr
    facts["e_tidy"] = sorted(p.name for p in (results / "tidy").glob("*.parquet"))

    # F: a finished study plans nothing.
    dry = subprocess.run(_snakemake(study, "-n"), cwd=REPO, capture_output=True, text=True, timeout=600)
    facts["f_rc"], facts["f_out"] = dry.returncode, dry.stdout + dry.stderr

    # G: a study of the other kind (a windowed arm) on the same engine, in one plain run.
    windowed = {**raw, "study": "faults-windowed", "arms": [{"name": "wmtp", "k": [3], "sink": [16], "window": [256]}]}
    windowed_study = tmp / "windowed.yaml"
    windowed_study.write_text(yaml.safe_dump(windowed))
    sixth = subprocess.run(_snakemake(windowed_study), cwd=REPO, capture_output=True, text=True, timeout=1500)
    facts["g_rc"], facts["g_out"] = sixth.returncode, sixth.stdout + sixth.stderr
    windowed_results = tmp / "results" / "faults-windowed"
    facts["g_measured"] = [
        str(p.parent.relative_to(windowed_results)) for p in windowed_results.glob("raw/**/manifest.json")
    ]
    facts["g_report"] = (windowed_results / "report" / "index.html").exists()
    facts["pwned"] = [str(p) for p in (REPO, tmp, Path.cwd()) if (p / marker).exists()]
    for place in facts["pwned"]:
        (Path(place) / marker).unlink()
    (tmp / "facts.json").write_text(json.dumps({k: v for k, v in facts.items() if not k.endswith("_out")}, indent=2))
    return {"tmp": tmp, "study": study, "raw": raw, "results": results, "cell_dir": cell_dir, "facts": facts}


def test_a_killed_cell_leaves_no_server_process_and_no_temporary_folder(faults, record_property):
    facts = faults["facts"]
    record_property("seconds_until_the_server_group_was_gone", facts["a_gone_s"])
    assert facts["a_rc"] != 0
    assert facts["a_gone_s"] is not None, f"a server process outlived its killed cell by {KILL_BUDGET_S} s"
    assert "manifest.json" not in facts["a_files"]
    assert facts["a_tmp_named"] and not facts["a_tmp_left"], "the killed cell's temporary folder was left behind"


def test_ctrl_c_stops_the_cell_within_seconds_and_records_why(faults, record_property):
    facts = faults["facts"]
    record_property("seconds_until_the_server_group_was_gone", facts["b_gone_s"])
    assert facts["b_rc"] != 0
    assert facts["b_gone_s"] is not None, f"the server outlived Ctrl-C by {INTERRUPT_BUDGET_S} s"
    assert facts["b_failure"], "an interrupted cell leaves failure.json"


def test_a_plain_rerun_completes_and_leaves_nothing_behind(faults):
    facts = faults["facts"]
    assert facts["c_rc"] == 0, facts["c_out"][-3000:]
    assert set(facts["c_files"]) >= {"manifest.json", "requests.parquet", "counters.parquet", "server.log"}
    leftovers = [f for f in facts["c_files"] if f.startswith((".staging-", "kept-")) or f == "failure.json"]
    assert not leftovers, leftovers


def test_a_model_path_with_spaces_and_a_command_reaches_no_shell(faults):
    facts = faults["facts"]
    assert not facts["pwned"], f"$(touch …) in the model path ran: {facts['pwned']}"
    manifest = json.loads((faults["cell_dir"] / "manifest.json").read_text())
    assert manifest["model_dir"] == faults["raw"]["models"][0]["path"]
    # The engine's own KV capacity, read from its start-up log line, is recorded with the cell.
    assert manifest["kv_cache"]["kv_cache_tokens"] > 0 and manifest["kv_cache"]["max_model_len"] == 2048


def _dry_cells(study: Path) -> int:
    proc = subprocess.run(_snakemake(study, "-n"), cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = re.search(r"^cell\s+(\d+)$", proc.stdout, re.MULTILINE)
    return int(found.group(1)) if found else 0


def test_a_changed_protocol_reruns_the_cell_and_a_new_model_runs_only_its_own(faults):
    if faults["facts"]["c_rc"] != 0:
        pytest.fail("the cell did not complete")
    tmp, raw = faults["tmp"], faults["raw"]
    assert _dry_cells(faults["study"]) == 0
    changed = tmp / "changed.yaml"
    changed.write_text(yaml.safe_dump({**raw, "protocol": {**raw["protocol"], "output_tokens": 24}}))
    assert _dry_cells(changed) == 1
    more = tmp / "more.yaml"
    second = {**raw["models"][0], "name": "tiny2"}
    more.write_text(yaml.safe_dump({**raw, "models": [*raw["models"], second]}))
    assert _dry_cells(more) == 1  # tiny2's cell; tiny's is untouched


def test_collect_refuses_cells_of_different_protocols(faults, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(faults["cell_dir"], other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["identity"]["protocol"]["output_tokens"] = 999
    (other / "manifest.json").write_text(json.dumps(manifest))
    proc = subprocess.run(
        [sys.executable, "-m", "wmtp", "collect", "--out", str(tmp_path / "tidy"),
         str(faults["cell_dir"] / "manifest.json"), str(other / "manifest.json")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "different protocols" in proc.stderr and "output_tokens: 16 vs 999" in proc.stderr


def test_a_damaged_table_is_set_aside_and_the_cell_measured_again_by_a_plain_run(faults):
    facts = faults["facts"]
    assert facts["d_rc"] == 0, facts["d_out"][-3000:]
    assert facts["d_intact"], "the cell was not measured again"
    # the damaged file is kept, as it was, beside the new measurement
    assert len(facts["d_aside"]) == 1 and facts["d_aside_size"] == [100]


def test_removed_tidy_tables_are_made_again_by_a_plain_run(faults):
    facts = faults["facts"]
    assert facts["e_rc"] == 0, facts["e_out"][-3000:]
    assert facts["e_tidy"] == sorted(f"{name}.parquet" for name in layout.TIDY_TABLES)


def test_a_finished_study_plans_nothing(faults):
    facts = faults["facts"]
    assert facts["f_rc"] == 0 and "Nothing to be done" in facts["f_out"], facts["f_out"][-3000:]


def test_a_study_of_the_other_kind_runs_whole_in_one_plain_run(faults):
    facts = faults["facts"]
    assert facts["g_rc"] == 0, facts["g_out"][-3000:]
    assert facts["g_measured"] == ["raw/model~tiny/engine~vllm-cpu/arm~wmtp/k~3/s~16/w~256/c~1"]
    assert facts["g_report"]
