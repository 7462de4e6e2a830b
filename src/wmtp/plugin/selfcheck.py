"""The engine build's behavioural check: one real windowed draft, counted by the plugin itself.

Run in the engine's interpreter (the build does, for vLLM engines on the CPU):

    python -m wmtp.plugin.selfcheck --model src/wmtp/model/tiny-trained

It starts vLLM in this process (no server) with ``{"wmtp": {"sink": S, "window": W}}`` on a small
checkpoint, generates a few tokens after a prompt several KV blocks longer than S + W, and reads the
plugin's own counters (:mod:`wmtp.plugin.stats`). It passes only when draft forwards were windowed and KV
blocks between sink and window were skipped; otherwise it exits 1 with the plugin's message. The source
check (:mod:`wmtp.engines.vllm_hooks`) says the hook points exist; this says the hook is on the path
that runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

from wmtp.plugin import stats as plugin_stats

RESULT = "WMTP-SELFCHECK "


def run(model: Path, sink: int, window: int, k: int, max_model_len: int, tokens: int) -> dict[str, Any]:
    """Generate once with the window configured; the plugin's summed counters, checked."""
    with tempfile.TemporaryDirectory(prefix="wmtp-selfcheck-") as stats_dir:
        return _generate_and_check(model, sink, window, k, max_model_len, tokens, stats_dir)


def _generate_and_check(
    model: Path, sink: int, window: int, k: int, max_model_len: int, tokens: int, stats_dir: str
) -> dict[str, Any]:
    os.environ[plugin_stats.ENV] = stats_dir
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker, and so the plugin's counters, in this process
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from vllm import LLM, SamplingParams

    config = json.loads((model / "config.json").read_text())
    length = max_model_len - tokens - 8  # as long as fits: decode steps must drop blocks at any common block size
    rng = random.Random(0)
    prompt = [rng.randrange(1, int(config["vocab_size"])) for _ in range(length)]
    llm = LLM(
        model=str(model),
        dtype="bfloat16",
        enforce_eager=True,
        enable_prefix_caching=False,
        max_model_len=max_model_len,
        distributed_executor_backend="uni",
        speculative_config={"method": "mtp", "num_speculative_tokens": k},
        additional_config={"wmtp": {"sink": sink, "window": window}},
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    plugin_stats._write_all()
    found = plugin_stats.read(stats_dir)
    summary = plugin_stats.check(found, length, sink, window, k, stats_dir)
    if summary["blocks_skipped"] == 0:
        raise plugin_stats.WindowNotApplied(
            f"{plugin_stats.NEVER_RAN}: a {length}-token prompt under S = {sink}, W = {window} skipped no KV block; "
            + "; ".join(summary["messages"])
        )
    return {"prompt_tokens": length, **{key: v for key, v in summary.items() if key != "messages"}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--sink", type=int, default=16)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args(argv)
    try:
        result = run(args.model, args.sink, args.window, args.k, args.max_model_len, args.tokens)
    except plugin_stats.WindowNotApplied as err:
        print(f"wmtp self-check failed: {err}", file=sys.stderr, flush=True)
        return 1
    print(RESULT + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
