"""Processes we start are ours to stop: the whole group goes, also when the starter dies."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

from wmtp.measure.server import ServerError, ServerProcess, free_port, group_alive

# A "server" that forks a worker (like vLLM's engine core) and answers /health.
FAKE_SERVER = textwrap.dedent("""
    import http.server, os, sys, time
    if os.fork() == 0:
        time.sleep(3600)
        sys.exit(0)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def test_stop_kills_the_whole_group(tmp_path):
    port = free_port()
    server = ServerProcess(
        [sys.executable, "-c", FAKE_SERVER, str(port)], {}, tmp_path / "s.log", f"http://127.0.0.1:{port}"
    )
    with server:
        assert server.wait_healthy(timeout_s=30) < 30
        pgid = server.pid
        assert group_alive(pgid)
    assert not group_alive(pgid)


def test_server_that_dies_is_reported_with_its_log(tmp_path):
    server = ServerProcess(
        [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"],
        {},
        tmp_path / "s.log",
        f"http://127.0.0.1:{free_port()}",
    )
    with server:
        try:
            server.wait_healthy(timeout_s=30)
        except ServerError as err:
            assert "exited with code 3" in str(err) and "no model here" in str(err)
        else:
            raise AssertionError("a dead server was reported healthy")


def test_server_dies_with_a_killed_starter(tmp_path):
    """A cell killed by SIGKILL cannot run its finally: the server must not outlive it."""
    port = free_port()
    starter = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from wmtp.measure.server import ServerProcess
        s = ServerProcess([sys.executable, "-c", {FAKE_SERVER!r}, "{port}"], {{}}, Path({str(tmp_path / "s.log")!r}),
                          "http://127.0.0.1:{port}")
        s.start(); s.wait_healthy(30); print(s.pid, flush=True); time.sleep(3600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())
    assert group_alive(pid)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode == 0:
        time.sleep(0.2)
    assert subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0
    # The fake's forked worker has no death signal of its own (vLLM's engine core watches its parent).
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
