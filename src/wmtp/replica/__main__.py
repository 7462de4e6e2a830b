"""``python -m wmtp.replica``: the replica's command line."""

from __future__ import annotations

import os

from wmtp.replica.cli import main

os.environ.setdefault("PYTHONUNBUFFERED", "1")
raise SystemExit(main())
