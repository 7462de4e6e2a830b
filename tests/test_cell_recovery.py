"""A cell's error path and its leftovers, and the machine-wide device lock (no server needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from wmtp import layout
from wmtp.measure import cell as cell_mod
from wmtp.measure.lock import device_key, device_lock


def _finished_staging(out_dir: Path, pid: int, identity: str) -> Path:
    staging = out_dir / f"{cell_mod.STAGING_PREFIX}{pid}"
    staging.mkdir(parents=True)
    for name in layout.RAW_SUCCESS_FILES:
        (staging / name).write_text(f"{name} of run {pid}")
    (staging / layout.MANIFEST_FILE).write_text(json.dumps({"identity_hash": identity}))
    return staging


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_complete_staging_of_a_dead_run_is_adopted_not_measured_again(tmp_path):
    staging = _finished_staging(tmp_path, _dead_pid(), "abc")
    assert cell_mod.recover_staging(tmp_path, "abc")
    assert not staging.exists()
    assert json.loads((tmp_path / layout.MANIFEST_FILE).read_text())["identity_hash"] == "abc"
    assert all((tmp_path / name).exists() for name in layout.RAW_SUCCESS_FILES)


def test_an_adopted_staging_keeps_the_traces_of_a_profiled_cell(tmp_path):
    staging = _finished_staging(tmp_path, _dead_pid(), "abc")
    (staging / layout.PROFILE_DIR).mkdir()
    (staging / layout.PROFILE_DIR / "rank0.1.pt.trace.json.gz").write_bytes(b"trace")
    assert cell_mod.recover_staging(tmp_path, "abc")
    assert (tmp_path / layout.PROFILE_DIR / "rank0.1.pt.trace.json.gz").read_bytes() == b"trace"


def test_finished_measurements_of_another_identity_are_kept_aside(tmp_path):
    pid = _dead_pid()
    _finished_staging(tmp_path, pid, "old")
    assert not cell_mod.recover_staging(tmp_path, "new")
    kept = tmp_path / f"{cell_mod.KEPT_PREFIX}{pid}"
    assert (kept / layout.REQUESTS_FILE).read_text() == f"{layout.REQUESTS_FILE} of run {pid}"
    assert not (tmp_path / layout.MANIFEST_FILE).exists()


def test_an_interrupted_staging_without_measurements_is_removed(tmp_path):
    staging = tmp_path / f"{cell_mod.STAGING_PREFIX}{_dead_pid()}"
    staging.mkdir()
    (staging / layout.SERVER_LOG).write_text("started")
    assert not cell_mod.recover_staging(tmp_path, "x")
    assert not staging.exists()


def test_a_live_process_staging_is_left_alone(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        staging = _finished_staging(tmp_path, sleeper.pid, "abc")
        assert not cell_mod.recover_staging(tmp_path, "abc")
        assert staging.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_failed_final_move_keeps_every_finished_file_and_says_where(tmp_path, monkeypatch):
    """The cell folder refuses writes (made read-only mid-run): nothing finished is deleted, and the record
    of why lands in the staging folder with an error line naming both places."""
    out_dir = tmp_path / "cell"
    out_dir.mkdir()
    staging = _finished_staging(out_dir, os.getpid(), "abc")
    os.replace(staging / layout.REQUESTS_FILE, out_dir / layout.REQUESTS_FILE)  # the move got this far
    real_write = Path.write_text

    def refuse_in_cell_folder(self: Path, *args, **kwargs):
        if self.parent == out_dir:
            raise PermissionError(13, "Permission denied", str(self))
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", refuse_in_cell_folder)
    messages: list[str] = []
    monkeypatch.setattr(cell_mod.log, "error", lambda msg, *a: messages.append(msg % a))
    keep = cell_mod._fail(out_dir, staging, "cell-id", OSError("move failed"), {"m": 1}, finished=True)
    assert keep
    assert all((staging / name).exists() for name in layout.RAW_SUCCESS_FILES)
    record = json.loads((staging / layout.FAILURE_FILE).read_text())
    assert record["measurements_kept_in"] == str(staging) and record["message"] == "move failed"
    assert any("cannot write" in m and str(staging) in m for m in messages), messages


def test_device_keys():
    assert device_key("cpu") == "cpu"
    assert device_key("cuda", 3) == "gpu3"
    assert device_key("cuda", visible="GPU-1a2b,GPU-3c") == "gpuGPU-1a2b"
    assert device_key("cuda", visible="") == "gpu0"


HOLDER = textwrap.dedent("""
    import sys, time
    from wmtp.measure.lock import device_lock
    with device_lock("gpu0"):
        print("held", flush=True)
        time.sleep(float(sys.argv[1]))
""")


def test_a_second_cell_on_the_same_device_waits_for_the_first(tmp_path, monkeypatch):
    """Two processes (as two Snakemake invocations would be): the second gets the device only after the first."""
    monkeypatch.setenv("WMTP_LOCK_DIR", str(tmp_path))
    env = {**os.environ, "WMTP_LOCK_DIR": str(tmp_path)}
    first = subprocess.Popen([sys.executable, "-c", HOLDER, "2"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert first.stdout.readline().strip() == "held"
        started = time.monotonic()
        with device_lock("gpu0", poll_s=0.05):
            waited = time.monotonic() - started
        # The holder keeps the lock 2 s after saying so: the second waits that long, not a poll interval.
        assert waited > 1.5, f"the lock was granted after {waited:.2f} s, while the first holder still held it"
        with device_lock("gpu1", poll_s=0.05):  # another device is free meanwhile
            pass
    finally:
        first.kill()
        first.wait()


def test_the_lock_dies_with_its_holder(tmp_path, monkeypatch):
    monkeypatch.setenv("WMTP_LOCK_DIR", str(tmp_path))
    env = {**os.environ, "WMTP_LOCK_DIR": str(tmp_path)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, "60"], stdout=subprocess.PIPE, text=True, env=env)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    started = time.monotonic()
    with device_lock("gpu0", poll_s=0.05):
        assert time.monotonic() - started < 5
