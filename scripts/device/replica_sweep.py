"""The whole H200 replica measurement in one command, run on the GPU machine from the repo root.

    python scripts/device/replica_sweep.py --out "$OUT"            # the floor table and the batch sweep
    python scripts/device/replica_sweep.py --out "$OUT" --quick    # checks + two points of the 35B

It measures, in one process: the device-to-device copy bandwidth (the floor's bandwidth),
correctness of the decode-attention and fused kernels (each block's delta against torch), and the
acceptance-free step time of none, native and windowed MTP at each (model, context, k, batch)
that fits, with per-component times, each next to its bytes/bandwidth floor.  CSVs (replica_*.csv)
are written to --out as it goes, so a timeout still leaves data; a summary table is printed last.

S and W: wmtp.config's PAPER_SINK and PAPER_WINDOW (4,096 draft-visible tokens), the window the Windowed-MTP
paper's public artifact runs and config/studies/paper-1m.yaml adopts, so the replica and the engine study
measure the same arms.
Batches 1, 2, 4, 8: the paper's batch sweep on the 35B, as far as an H200's memory holds at each context.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from wmtp.config import PAPER_SINK, PAPER_WINDOW  # noqa: E402
from wmtp.replica.cli import main as replica_main  # noqa: E402

MODELS = [
    "config/models/qwen3.6-35b-a3b.json",
    "config/models/qwen3-next-80b-a3b.json",
    "config/models/qwen3.5-122b-a10b.json",
    "config/models/nemotron-3-super-120b-a12b.json",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "results/replica/raw/h200")))
    ap.add_argument("--quick", action="store_true", help="checks and two points of the 35B")
    ap.add_argument("--models", nargs="+", default=MODELS[:2])
    ap.add_argument("--contexts", default="128k,512k,1m")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--reps", default="10")
    ap.add_argument("--deadline-s", type=float, default=500.0, help="start no new point after this")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="passed to wmtp.replica sweep")
    args = ap.parse_args()
    models = [str(ROOT / m) for m in args.models]
    common = ["sweep", "--out", str(args.out), "--sink", str(PAPER_SINK), "--window", str(PAPER_WINDOW)]
    common += ["--deadline-s", str(args.deadline_s)]
    if args.quick:
        argv = [*common, "--models", models[0], "--contexts", "128k,1m", "--ks", "3", "--batches", "1,4"]
        return replica_main([*argv, "--reps", "10", *args.extra])
    argv = [*common, "--models", *models, "--contexts", args.contexts, "--ks", "1,3,5", "--batches", args.batches]
    return replica_main([*argv, "--reps", args.reps, *args.extra])


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
