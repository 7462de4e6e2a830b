"""Processes we start are ours to stop: the whole group goes, also when the starter dies."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from wmtp.measure.server import (
    PortTaken,
    ServerError,
    ServerProcess,
    free_port,
    group_alive,
    listening_inodes,
    socket_owners,
)

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
                          "http://127.0.0.1:{port}", orphan_dirs=[{str(tmp_path / "cell-tmp")!r}])
        s.start(); s.wait_healthy(30); print(s.pid, flush=True); time.sleep(3600)
    """)
    (tmp_path / "cell-tmp" / "sockets").mkdir(parents=True)
    proc = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())
    assert group_alive(pid)
    proc.kill()
    proc.wait()
    # The fake's forked worker has no death signal of its own, like vLLM's engine core: the watchdog ends it.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and group_alive(pid):
        time.sleep(0.2)
    left = group_alive(pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    assert not left, "a process of the server's group outlived the killed starter by 30 s"
    # and the starter's own temporary folder went with it
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (tmp_path / "cell-tmp").exists():
        time.sleep(0.1)
    assert not (tmp_path / "cell-tmp").exists()


STRANGER = textwrap.dedent("""
    import http.server, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def test_a_stranger_answering_on_the_port_is_not_taken_for_our_server(tmp_path):
    port = free_port()
    stranger = subprocess.Popen([sys.executable, "-c", STRANGER, str(port)])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not listening_inodes(port):
            time.sleep(0.1)
        # Ours never binds: it sleeps, as a slow-starting engine would, while the stranger answers 200.
        server = ServerProcess(
            [sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path / "s.log", f"http://127.0.0.1:{port}"
        )
        with server, pytest.raises(ServerError, match=f"belongs to pid {stranger.pid}"):
            server.wait_healthy(timeout_s=20)
    finally:
        stranger.kill()
        stranger.wait()


def test_our_own_server_owns_its_port(tmp_path):
    port = free_port()
    server = ServerProcess(
        [sys.executable, "-c", FAKE_SERVER, str(port)], {}, tmp_path / "s.log", f"http://127.0.0.1:{port}"
    )
    with server:
        server.wait_healthy(timeout_s=30)
        owners = socket_owners(listening_inodes(port))
        assert set(owners.values()) == {server.pid}


def test_a_port_taken_before_the_bind_is_told_apart(tmp_path):
    port = free_port()
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    try:
        server = ServerProcess(
            [sys.executable, "-c", FAKE_SERVER, str(port)], {}, tmp_path / "s.log", f"http://127.0.0.1:{port}"
        )
        with server, pytest.raises(PortTaken):
            server.wait_healthy(timeout_s=30)
    finally:
        holder.close()
