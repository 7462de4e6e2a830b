"""The replica's command line: ``sweep`` (GPU measurement, CSVs) and ``tidy`` (CSVs + floor -> parquet)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from wmtp.replica.kernels import ATTN_BACKENDS, HAVE_TRITON, AttnLaunch, torch
from wmtp.replica.tidy import tidy


def _ints(s: str) -> list[int]:
    """'2k,1m,3' -> [2048, 1048576, 3]."""
    out = []
    for part in s.split(","):
        part = part.strip().lower()
        mult = 1
        if part.endswith("k"):
            part, mult = part[:-1], 1024
        elif part.endswith("m"):
            part, mult = part[:-1], 1 << 20
        out.append(int(float(part) * mult))
    return out


def _ints_or_none(s: str) -> list[int]:
    return [] if s.strip().lower() in ("", "none") else _ints(s)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m wmtp.replica", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sw = sub.add_parser("sweep", help="measure on a CUDA GPU; CSVs into --out")
    sw.add_argument("--models", nargs="+", type=Path, required=True, help="config/models/*.json files")
    # No defaults here: the study file's `replica:` (wmtp.config.ReplicaSettings) is the one place they live,
    # and a direct run names its design point in full.
    sw.add_argument("--contexts", type=_ints_or_none, required=True, help="e.g. 2k,32k,1m; none: no sweep points")
    sw.add_argument("--ks", type=_ints, required=True, help="draft depths, e.g. 1,3,5")
    sw.add_argument("--sink", type=int, required=True)
    sw.add_argument("--window", type=int, required=True)
    sw.add_argument("--reps", type=int, required=True, help="timed CUDA-graph replays per piece")
    sw.add_argument("--batches", type=_ints, default=[1], help="concurrent requests per step, e.g. 1,2,4,8")
    sw.add_argument("--backend", choices=("auto", *ATTN_BACKENDS), default="auto")
    sw.add_argument("--splits", type=int, default=None, help="KV chunks per range (default: auto)")
    sw.add_argument("--no-graphs", action="store_true")
    sw.add_argument("--no-components", action="store_true")
    sw.add_argument("--no-checks", action="store_true")
    sw.add_argument("--attn-bench", type=_ints, default=[], help="contexts for the attention bandwidth table")
    sw.add_argument("--attn-block-n", type=int, default=None, help="split-KV kernel: keys per block")
    sw.add_argument("--attn-warps", type=int, default=None)
    sw.add_argument("--attn-stages", type=int, default=None)
    sw.add_argument("--deadline-s", type=float, default=1e9, help="stop starting new points after this")
    sw.add_argument("--device", default="cuda", help="cuda (measurements) or cpu (a dry run at tiny shapes)")
    sw.add_argument("--out", type=Path, required=True)
    td = sub.add_parser("tidy", help="raw replica CSVs + cost model -> tidy parquet")
    td.add_argument("--raw", type=Path, required=True)
    td.add_argument("--models-dir", type=Path, default=Path("config/models"))
    td.add_argument("--bandwidth", type=float, default=None, help="bytes/s (default: the measured copy rate)")
    td.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)
    if args.cmd == "tidy":
        return tidy(args.raw, args.models_dir, args.out, args.bandwidth)
    return _sweep(args)


def _sweep(args: argparse.Namespace) -> int:
    from wmtp.replica import sweep as sw  # torch and Triton are needed from here on

    cfg = sw.SweepConfig(
        models=args.models,
        contexts=args.contexts,
        ks=args.ks,
        batches=args.batches,
        sink=args.sink,
        window=args.window,
        reps=args.reps,
        backend=args.backend,
        splits=args.splits,
        use_graphs=not args.no_graphs,
        components=not args.no_components,
        deadline_s=args.deadline_s,
        checks=not args.no_checks,
        device=args.device,
        out=args.out,
        launch=AttnLaunch().with_override((args.attn_block_n, args.attn_warps, args.attn_stages)),
    )
    if args.attn_bench:
        if torch is None or (sw.is_cuda(cfg.device) and not torch.cuda.is_available()):
            sw.log.error("--attn-bench needs a CUDA GPU")
            return 2
        sink = sw.CsvSink(cfg.out)
        bw = sw.copy_bandwidth(device=cfg.device)
        sink.write("replica_bandwidth", bw)
        timer = sw.GraphTimer(cfg.use_graphs, device=cfg.device)
        seen = set()
        for i, path in enumerate(cfg.models):
            spec = sw.cm.load_model(path)
            shape = (spec.attention.num_q_heads, spec.attention.num_kv_heads, spec.attention.head_dim)
            if shape in seen:
                continue
            seen.add(shape)
            sw.attention_bandwidth(
                spec,
                args.attn_bench,
                (1, 4, 6),
                timer,
                sink,
                bw["bandwidth"],
                cfg.reps,
                backends=("triton", "aten") if HAVE_TRITON and sw.is_cuda(cfg.device) else ("aten",),
                split_factors=(1.0, 2.0, 4.0) if i == 0 else (1.0,),
                variants=sw.TRITON_VARIANTS if i == 0 else ((None, None, None),),
                launch=cfg.launch,
            )
        if not cfg.contexts:
            return 0
    return sw.run_sweep(cfg)
