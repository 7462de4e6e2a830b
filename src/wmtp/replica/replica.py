"""``python -m wmtp.replica.replica`` runs the replica's command line (:mod:`wmtp.replica.cli`)."""

from __future__ import annotations

import os

from wmtp.replica.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
