"""The whole H200 replica measurement in one command, run on the GPU machine from the repo root.

    python scripts/device/replica_sweep.py --out "$OUT"            # full sweep, all four models
    python scripts/device/replica_sweep.py --out "$OUT" --quick    # checks + attention bench + 2 points

It measures, in one process: the device-to-device copy bandwidth (the roofline reference),
correctness of the decode-attention and recurrence kernels against float32 on fresh random
inputs, the attention kernels' achieved bandwidth, and the acceptance-free step time of native
vs windowed MTP at each (model, context, k) with per-component times.  CSVs (replica_*.csv) are
written to --out as it goes, so a timeout still leaves data; a summary table is printed last.

S and W: neither the Spark study nor the Windowed-MTP paper gives values; we use S = 64, W = 4032
(4,096 draft-visible tokens), the window of SGLang's own long-context tests that
config/studies/paper-1m.yaml adopts, so the replica and the engine study measure the same arms.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

from wmtp.replica import replica  # noqa: E402

MODELS = [
    "config/models/qwen3.6-35b-a3b.json",
    "config/models/qwen3.5-122b-a10b.json",
    "config/models/nemotron-3-super-120b-a12b.json",
    "config/models/qwen3-next-80b-a3b.json",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "results/replica/raw/h200")))
    ap.add_argument("--quick", action="store_true", help="first call: checks, attention bench, two points")
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--deadline-s", type=float, default=540.0, help="start no new point after this")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="passed to wmtp.replica.replica sweep")
    args = ap.parse_args()
    models = [str(ROOT / m) for m in args.models]
    common = ["sweep", "--out", str(args.out), "--sink", "64", "--window", "4032", "--deadline-s", str(args.deadline_s)]
    if args.quick:
        bench = [
            *common,
            "--models",
            *models,
            "--attn-bench",
            "128k,1m",
            "--contexts",
            "none",
            "--ks",
            "3",
            "--reps",
            "20",
        ]
        rc = replica.main([*bench, *args.extra])
        if rc:
            return rc
        argv = [*common, "--models", models[0], "--contexts", "2k,1m", "--ks", "3", "--reps", "20"]
        return replica.main([*argv, *args.extra])
    argv = [*common, "--models", *models, "--contexts", "2k,32k,128k,256k,512k,1m", "--ks", "1,3,5", "--reps", "30"]
    return replica.main([*argv, *args.extra])


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
