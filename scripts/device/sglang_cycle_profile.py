"""Where the SGLang plugin's time goes: native MTP beside the windowed draft, timed and traced, on one GPU.

On the tiny trained model the windowed arm's cycle measured twice native MTP's, and so did the window-off control (a
window wider than every prompt, nothing dropped): the plugin's mechanics, not the window, cost it. The plugin's own
host time, about 1.2 ms a cycle, explains a fifth of that. This serves the arms one after the other, each in a
process of its own as a server would be, as ``sglang_gpu_proofs.py`` serves them (SGLang 0.5.17's offline engine:
the tokenizer manager in this process, the scheduler in another; CUDA graphs, fa3 for target and draft; the proofs'
instrument off, as in a cell):

- ``mtp``: native MTP (NEXTN, k = 3);
- ``wmtp``: the plugin at S = 16, W = 256;
- ``window-off``: the plugin at S = 16, W = 1,000,000;
- ``window-off-backend-in-main``: the same, with SGLang's attention backend imported in this process before the
  engine starts, as a plugin that imports it on registering would in every process SGLang loads plugins in (the
  plugin of ``measurements/h100/sglang_tiny*`` did). In a server the main process is the tokenizer manager, whose
  clock times a request: if this arm's cycle is longer than ``window-off``'s, that import is what cost it; the
  plugin wraps the backend only as SGLang imports it;
- ``mtp-again``: native MTP once more, so that the order of the arms is not read as a cost.

For each, after two warm-up requests: ``REPEATS`` requests of the read-set prompt (12,288 tokens) timed on the host
clock (every arm answers the same tokens, so whole requests compare), then one more traced by SGLang's own
profiler (torch.profiler, CPU and GPU activity, in the scheduler's process). Each trace is summed up without knowing
the engine (``wmtp.analyze.traces.host_device_summary``): device span and busy time, kernels, launches, graph
replays, host waits and their time, the host's PyTorch operations by name and time, and SGLang's own ranges
(``draft``, ``verify``, ``draft_extend``) with the period at which the scheduler repeats them, its cycle on its own
clock beside the request's.

    PYTHONPATH=src:/tmp/wmtp-sglang/site python3 scripts/device/sglang_cycle_profile.py \\
        --prompts .gpu-inputs/proofs/prompts.json --out "$OUT/sglang-profile" [--arms mtp wmtp ...]

All five arms take about ten minutes; ``--arms`` runs some of them (in the order given), so that a run that must
end within a limit can be split in two. Writes ``sglang_cycle_profile.json`` (the summaries, the timings, the
plugin's counters, the load average) after each arm, and each arm's trace.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sglang_gpu_proofs as proofs  # the proofs' engine, prompt and request

REPEATS = 5
WINDOW_OFF = (proofs.SINK, 1_000_000)
# Each arm's window (None: native MTP) and whether this process, the tokenizer manager's, imports SGLang's attention
# backend before the engine starts.
ARMS: dict[str, tuple[tuple[int, int] | None, bool]] = {
    "mtp": (None, False),
    "wmtp": ((proofs.SINK, proofs.WINDOW), False),
    "window-off": (WINDOW_OFF, False),
    "window-off-backend-in-main": (WINDOW_OFF, True),
    "mtp-again": (None, False),
}


def _traces(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and ".trace.json" in p.name)


def profile_arm(name: str, ids: list[int], out_dir: Path) -> dict:
    """One arm, in this process (which must be fresh: SGLang loads its plugins once a process)."""
    from wmtp.analyze.traces import TraceError, host_device_summary, read_trace
    from wmtp.plugin import sglang_hookpoints as hp
    from wmtp.plugin import stats as wstats

    window, backend_first = ARMS[name]
    stats_dir = out_dir / "stats" / name
    stats_dir.mkdir(parents=True, exist_ok=True)
    os.environ.pop(hp.SETTINGS_ENV, None)
    os.environ[wstats.ENV] = str(stats_dir)
    if window is not None:
        # Read by the plugin in each of SGLang's processes as it loads: set before the engine starts them.
        os.environ[hp.SETTINGS_ENV] = json.dumps({"sink": window[0], "window": window[1]})
    if backend_first:
        importlib.import_module(hp.BACKEND_MODULE)  # before the server's arguments are read
    started = time.monotonic()
    engine = proofs._engine()
    found: dict = {
        "window": window,
        "backend_imported_first": backend_first,
        # Whether this process holds the backend once the engine runs: where SGLang imports it here anyway, the two
        # window-off arms differ in when, not whether.
        "backend_imported_in_main_process": hp.BACKEND_MODULE in sys.modules,
        "start_s": round(time.monotonic() - started, 1),
    }
    import torch

    found["gpu"] = torch.cuda.get_device_name(0)
    for _ in range(2):
        proofs._generate(engine, ids)
    walls, answers = [], []
    for _ in range(REPEATS):
        started = time.perf_counter()
        answers.append(proofs._generate(engine, ids))
        walls.append(time.perf_counter() - started)
    found["request_s"] = {"median": statistics.median(walls), "min": min(walls), "max": max(walls), "n": len(walls)}
    found["tokens_per_verify"] = answers[-1]["tokens_per_verify"]
    found["answer"] = answers[-1]["ids"]
    trace_dir = out_dir / "traces" / name
    trace_dir.mkdir(parents=True, exist_ok=True)
    # Stacks and shapes off: recording them lengthens the host's work, which is what is measured.
    engine.start_profile(output_dir=str(trace_dir), activities=["CPU", "GPU"], with_stack=False, record_shapes=False)
    proofs._generate(engine, ids)
    engine.stop_profile()  # returns once the scheduler has written its trace
    traces = _traces(trace_dir)
    found["traces"] = [str(p.relative_to(out_dir)) for p in traces]
    try:
        found["summary"] = host_device_summary(read_trace(traces[0])) if traces else None
    except TraceError as err:
        found["summary"] = {"error": str(err)}
    engine.shutdown()
    del engine
    gc.collect()
    found["plugin_counters"] = wstats.summarize(wstats.read(stats_dir)) if window is not None else None
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS), metavar="ARM",
                        help=f"which arms, in this order (default: all, {', '.join(ARMS)})")  # fmt: skip
    parser.add_argument("--in-this-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.in_this_process:
        (arm,) = args.arms
        ids = list(json.loads(args.prompts.read_text())[proofs.READ_SET_PROMPT])
        found = profile_arm(arm, ids, args.out)
        (args.out / "arms" / f"{arm}.json").write_text(json.dumps(found))
        return 0
    return run_arms(args.arms, args.prompts, args.out)


def run_arms(arms: list[str], prompts: Path, out: Path) -> int:
    """Each arm in a fresh process, one after the other; the summary written after each. This process touches no
    GPU: it would hold a CUDA context beside every arm's engine."""
    from importlib.metadata import version

    (out / "arms").mkdir(parents=True, exist_ok=True)
    found: dict = {
        "engine": {"sglang": version("sglang"), "torch": version("torch")},
        "load_average": os.getloadavg(),
        "arms": {},
    }
    answers = {}
    for name in arms:
        started = time.monotonic()
        result = out / "arms" / f"{name}.json"
        result.unlink(missing_ok=True)  # an earlier run's record is never read as this one's
        command = [sys.executable, __file__, "--prompts", str(prompts), "--out", str(out), "--arms", name]
        child = subprocess.run([*command, "--in-this-process"], check=False)
        if child.returncode != 0 or not result.exists():
            found["arms"][name] = {"error": f"exit status {child.returncode}"}
        else:
            arm = json.loads(result.read_text())
            answers[name] = arm.pop("answer")
            found["arms"][name] = arm
        found["arms"][name]["process_s"] = round(time.monotonic() - started, 1)
        found["load_average_after"] = os.getloadavg()
        found["same_answers"] = len({tuple(a) for a in answers.values()}) == 1
        # After every arm: a call cut short at its limit keeps the arms it finished.
        (out / "sglang_cycle_profile.json").write_text(json.dumps(found, indent=1))
        print(name, json.dumps(found["arms"][name])[:2000], flush=True)
    return 0 if all("error" not in arm for arm in found["arms"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
