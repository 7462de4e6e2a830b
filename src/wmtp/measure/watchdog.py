"""Ends a server's process group when the cell that started it dies, whatever killed the cell.

A server's own children (vLLM's engine core and workers) do not die with the cell by themselves:
PR_SET_PDEATHSIG reaches only the direct child, and SIGKILL gives the cell no chance to clean up. The
watchdog runs in its own session, so it outlives the cell; it waits on the cell's pidfd (immune to pid
reuse) and, when the cell is gone, terminates the server's process group, then kills what is left. It
exits by itself once the group is gone.

    python -m wmtp.measure.watchdog --parent PID --pgid PGID [--remove DIR ...]

``--remove`` names the cell's own temporary folders (the server's sockets and compile scratch): a cell killed
outright cannot remove them itself, so the watchdog does, once the server is gone.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

POLL_S = 0.5
GRACE_S = 5.0


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of a process group."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def end_group(pgid: int, grace_s: float = GRACE_S) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def watch(parent_pid: int, pgid: int, remove: Sequence[str] = ()) -> int:
    try:
        parent = os.pidfd_open(parent_pid)
    except ProcessLookupError:
        _orphaned(pgid, remove)
        return 0
    poller = select.poll()
    poller.register(parent, select.POLLIN)
    while True:
        if poller.poll(POLL_S * 1000):  # readable: the parent has exited
            _orphaned(pgid, remove)
            return 0
        if not group_members(pgid):  # the cell stopped its server itself
            return 0


def _orphaned(pgid: int, remove: Sequence[str]) -> None:
    """The cell is gone: end its server, then remove the folders only the cell would have removed."""
    end_group(pgid)
    for folder in remove:
        shutil.rmtree(folder, ignore_errors=True)


def start(parent_pid: int, pgid: int, remove: Sequence[str] = ()) -> subprocess.Popen:
    """Start a watchdog for ``pgid`` that outlives ``parent_pid`` (its own session, no inherited stdio)."""
    extra = [arg for folder in remove for arg in ("--remove", str(folder))]
    return subprocess.Popen(
        [sys.executable, "-m", "wmtp.measure.watchdog", "--parent", str(parent_pid), "--pgid", str(pgid), *extra],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m wmtp.measure.watchdog", description=__doc__.splitlines()[0])
    parser.add_argument("--parent", type=int, required=True, help="the cell's pid")
    parser.add_argument("--pgid", type=int, required=True, help="the server's process group")
    parser.add_argument("--remove", action="append", default=[], help="a folder to remove if the cell dies")
    args = parser.parse_args(argv)
    return watch(args.parent, args.pgid, args.remove)


if __name__ == "__main__":
    raise SystemExit(main())
