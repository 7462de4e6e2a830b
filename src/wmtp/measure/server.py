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

from wmtp.measure import watchdog

log = logging.getLogger(__name__)


class ServerError(RuntimeError):
    pass


class PortTaken(ServerError):
    """Another process holds the port: retry on a fresh one."""


# Lines a server prints when its port was taken between our choosing it and its binding it.
PORT_IN_USE = ("Address already in use", "[Errno 98]")


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


def listening_inodes(port: int) -> set[int]:
    """Socket inodes listening on ``port`` on this machine (IPv4 and IPv6), from /proc/net."""
    inodes: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], int(fields[9])
                if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(inode)
    return inodes


def socket_owners(inodes: set[int]) -> dict[int, int]:
    """pid → process group of every process holding one of these socket inodes."""
    wanted = {f"socket:[{i}]" for i in inodes}
    owners: dict[int, int] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            links = {os.readlink(fd) for fd in (proc / "fd").iterdir()}
            if links & wanted:
                owners[int(proc.name)] = os.getpgid(int(proc.name))
        except (OSError, ValueError):
            continue
    return owners


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


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
        verify_owner: bool = True,
        orphan_dirs: Sequence[str] = (),
    ):
        self.argv = argv
        # Directories the server expects to exist (its temp and cache folders, as its adapter names them).
        self.make_dirs = tuple(make_dirs)
        # Folders of the cell's own that its watchdog removes if the cell dies before it can.
        self.orphan_dirs = tuple(orphan_dirs)
        # A container's port is published by its runtime's proxy, which is not in our process group.
        self.verify_owner = verify_owner
        self.env = env
        self.log_path = log_path
        self.base_url = base_url
        self.health_path = health_path
        self.proc: subprocess.Popen | None = None
        self.watchdog: subprocess.Popen | None = None

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
        if sys.platform == "linux" and hasattr(os, "pidfd_open"):
            self.watchdog = watchdog.start(os.getpid(), self.proc.pid, self.orphan_dirs)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def port(self) -> int:
        return int(self.base_url.rsplit(":", 1)[1].split("/")[0])

    def check_owns_port(self) -> None:
        """The process answering on our port must be one of ours: another server there is not measured.

        Linux only (reads /proc); elsewhere the check is skipped.
        """
        if not self.verify_owner or not Path("/proc/net/tcp").exists() or self.proc is None:
            return
        owners = socket_owners(listening_inodes(self.port))
        if not owners:
            return  # a container runtime's proxy or another namespace: nothing to compare against
        if any(group == self.proc.pid for group in owners.values()):
            return
        pid = sorted(owners)[0]
        raise ServerError(
            f"port {self.port} answers, but it belongs to pid {pid} ({_cmdline(pid)[:200]}), not to the server "
            f"we started (process group {self.proc.pid}); stop that process or let the cell pick another port"
        )

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
                    if any(marker in _tail(self.log_path, 60) for marker in PORT_IN_USE):
                        raise PortTaken(f"port {self.port} was taken before the server could bind it")
                    raise ServerError(
                        f"server exited with code {code} before it was healthy; "
                        f"last lines of {self.log_path}:\n{_tail(self.log_path)}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.base_url + self.health_path).status_code == 200:
                        self.check_owns_port()
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
        if self.watchdog is not None:
            self.watchdog.kill()
            self.watchdog.wait()
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
    return bool(watchdog.group_members(pgid))
