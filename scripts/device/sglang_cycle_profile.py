"""Where the SGLang plugin's time goes: native MTP beside the windowed draft, timed and traced, on one GPU.

On the tiny trained model the windowed arm's cycle measured twice native MTP's, and so did the window-off control (a
window wider than every prompt, nothing dropped): the plugin's mechanics, not the window, cost it. This serves the
three in turn, as ``sglang_gpu_proofs.py`` serves them (SGLang 0.5.17's offline engine, CUDA graphs, fa3 for target
and draft; the proofs' instrument off, as in a cell):

- ``mtp``: native MTP (NEXTN, k = 3);
- ``wmtp``: the plugin at S = 16, W = 256;
- ``wmtp, window off``: the plugin at S = 16, W = 1,000,000.

For each, after two warm-up requests: ``REPEATS`` requests of the read-set prompt (12,288 tokens) timed on the host
clock (every arm answers the same tokens, so whole requests compare), then one more traced by SGLang's own
profiler (torch.profiler, CPU and GPU activity, in the scheduler's process). Each trace is summed up without knowing
the engine (``wmtp.analyze.traces.host_device_summary``): device span and busy time, kernels, launches, graph
replays, host waits, and the host's PyTorch operations by name; what the plugin adds shows as the difference.

    PYTHONPATH=src:/tmp/wmtp-sglang/site python3 scripts/device/sglang_cycle_profile.py \\
        --prompts .gpu-inputs/proofs/prompts.json --out "$OUT/sglang-profile"

Writes ``sglang_cycle_profile.json`` (the summaries, the timings, the plugin's counters) and each arm's trace.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sglang_gpu_proofs as proofs  # the proofs' engine, prompt and request

REPEATS = 5
ARMS = {"mtp": None, "wmtp": (proofs.SINK, proofs.WINDOW), "wmtp, window off": (proofs.SINK, 1_000_000)}


def _traces(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and ".trace.json" in p.name)


def profile_arm(name: str, window: tuple[int, int] | None, ids: list[int], out_dir: Path) -> dict:
    from wmtp.analyze.traces import TraceError, host_device_summary, read_trace
    from wmtp.plugin import sglang_hookpoints as hp
    from wmtp.plugin import stats as wstats

    stats_dir = out_dir / "stats" / name.replace(", ", "-").replace(" ", "-")
    stats_dir.mkdir(parents=True, exist_ok=True)
    os.environ.pop(hp.SETTINGS_ENV, None)
    os.environ[wstats.ENV] = str(stats_dir)
    if window is not None:
        # Read by the plugin in each of SGLang's processes as it loads: set before the engine starts them.
        os.environ[hp.SETTINGS_ENV] = json.dumps({"sink": window[0], "window": window[1]})
    started = time.monotonic()
    engine = proofs._engine()
    found: dict = {"start_s": round(time.monotonic() - started, 1)}
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
    trace_dir = out_dir / "traces" / name.replace(", ", "-").replace(" ", "-")
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
    args = parser.parse_args(argv)
    import sglang
    import torch

    ids = list(json.loads(args.prompts.read_text())[proofs.READ_SET_PROMPT])
    args.out.mkdir(parents=True, exist_ok=True)
    found: dict = {
        "engine": {"sglang": sglang.__version__, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)},
        "load_average": os.getloadavg(),
        "arms": {},
    }
    answers = {}
    for name, window in ARMS.items():
        arm = profile_arm(name, window, ids, args.out)
        answers[name] = arm.pop("answer")
        found["arms"][name] = arm
        found["load_average_after"] = os.getloadavg()
        found["same_answers"] = len({tuple(a) for a in answers.values()}) == 1
        # After every arm: a call cut short at its limit keeps the arms it finished.
        (args.out / "sglang_cycle_profile.json").write_text(json.dumps(found, indent=1))
        print(name, json.dumps(arm)[:2000], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
