"""One cell per device on a machine, across every Snakemake invocation and every checkout.

Snakemake's ``gpu=1`` resource serialises the cells of one invocation; two invocations (two studies, or
two clones) each have their own budget. A cell therefore also takes an exclusive ``flock`` on a file
named after its device in a machine-wide folder (``$WMTP_LOCK_DIR``, default ``wmtp-locks`` in the
system's temporary directory) before its server starts, and holds it until the server is gone. The kernel
drops the lock when the process dies, however it dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

WAIT_NOTE_S = 30.0


def lock_dir() -> Path:
    return Path(os.environ.get("WMTP_LOCK_DIR") or Path(tempfile.gettempdir()) / "wmtp-locks")


def device_key(device: str, gpu_index: int | None = None, visible: str | None = None) -> str:
    """``cpu`` for a CPU engine; for a GPU, the device the cell sees (CUDA_VISIBLE_DEVICES's first entry)."""
    if device != "cuda":
        return "cpu"
    if gpu_index is not None:
        return f"gpu{gpu_index}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    first = (visible or "0").split(",")[0].strip() or "0"
    return "gpu" + "".join(c if c.isalnum() or c in "-_" else "_" for c in first)


@contextlib.contextmanager
def device_lock(key: str, poll_s: float = 1.0) -> Iterator[Path]:
    """Hold the machine-wide lock of one device; waits (saying so) while another cell holds it."""
    folder = lock_dir()
    folder.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):
        folder.chmod(0o1777)  # shared by every user's cells, like /tmp
    path = folder / f"{key}.lock"
    with path.open("a+") as handle:
        started = time.monotonic()
        next_note = started
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= next_note:
                    handle.seek(0)
                    holder = handle.read().strip() or "another process"
                    log.info("waiting for %s (held by %s, %.0f s so far)", path, holder, time.monotonic() - started)
                    next_note = time.monotonic() + WAIT_NOTE_S
                time.sleep(poll_s)
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
        try:
            yield path
        finally:
            with contextlib.suppress(OSError):
                handle.truncate(0)
            fcntl.flock(handle, fcntl.LOCK_UN)
