"""An engine server process that is ours to stop: own session, health wait, no leftovers."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

log = logging.getLogger(__name__)


class ServerError(RuntimeError):
    pass


def _die_with_parent() -> None:
    """In the child: SIGKILL it when the process that started it dies, even by SIGKILL (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class ServerProcess:
    """Start ``argv`` in its own process group; ``stop()`` ends the whole group."""

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        log_path: Path,
        base_url: str,
        health_path: str = "/health",
        make_dirs: Sequence[str] = (),
    ):
        self.argv = argv
        # Directories the server expects to exist (its temp and cache folders, as its adapter names them).
        self.make_dirs = tuple(make_dirs)
        self.env = env
        self.log_path = log_path
        self.base_url = base_url
        self.health_path = health_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        for directory in self.make_dirs:
            Path(directory).mkdir(parents=True, exist_ok=True)
        log_file = self.log_path.open("ab")
        full_env = {**os.environ, **self.env}
        log.info("starting server: %s", " ".join(self.argv))
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        log_file.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_healthy(self, timeout_s: float, progress_every_s: float = 15.0) -> float:
        """Seconds until /health answered 200; raises with the log's tail if the server died."""
        started = time.monotonic()
        next_note = started + progress_every_s
        with httpx.Client(timeout=5.0) as client:
            while True:
                if not self.alive():
                    code = self.proc.returncode if self.proc else None
                    raise ServerError(
                        f"server exited with code {code} before it was healthy; "
                        f"last lines of {self.log_path}:\n{_tail(self.log_path)}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.base_url + self.health_path).status_code == 200:
                        return time.monotonic() - started
                now = time.monotonic()
                if now - started > timeout_s:
                    raise ServerError(
                        f"server not healthy after {timeout_s:.0f} s; last lines of "
                        f"{self.log_path}:\n{_tail(self.log_path)}"
                    )
                if now >= next_note:
                    log.info("waiting for the server to become healthy (%.0f s so far)", now - started)
                    next_note = now + progress_every_s
                time.sleep(1.0)

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM the process group, then SIGKILL what is left; returns the exit code."""
        if self.proc is None:
            return None
        pgid = self.proc.pid  # start_new_session makes the child its own group leader
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.warning("server did not stop in %.0f s; killing its process group", grace_s)
        # Workers may outlive the leader: always sweep the group, and wait until it is really gone.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        deadline = time.monotonic() + 20
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def group_alive(pgid: int) -> bool:
    """True while any process of the group exists (used by tests to prove nothing is left)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie leader still counts for killpg; look for live members in /proc.
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False
