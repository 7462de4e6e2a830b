"""The SGLang plugin's proofs in SGLang itself (0.5.17, CUDA), on one GPU (an H200).

With the carried SGLang installed (``ENGINE_DIR=/tmp/wmtp-sglang bash scripts/device/engine_install.sh … --install``,
which puts this checkout's wmtp beside it, so that SGLang's plugin loader finds the plugin) and the prompts of
``scripts/device/vllm_gpu_proofs.py prompts`` carried in:

    PYTHONPATH=src:/tmp/wmtp-sglang/site python3 scripts/device/sglang_gpu_proofs.py \
        --prompts .gpu-inputs/proofs/prompts.json --out "$OUT"

It serves the committed tiny trained model (src/wmtp/model/tiny-trained) in SGLang's offline engine, CUDA graphs on,
FlashAttention (fa3) for the target and the draft: first native MTP (NEXTN, k = 3), then the windowed draft
(S = 16, W = 256) with the plugin's counters (wmtp.plugin.stats) and its proofs' instrument
(wmtp.plugin.sglang_testing). It proves, and writes to ``$OUT/sglang_gpu_proofs.json`` (exit 1 when one fails):

- the hook is on the path that runs: the installed SGLang has every hook point (``check_hook_points``) and the
  plugin counted windowed draft forwards (> 0) that dropped pages (> 0);
- lossless: the windowed draft's greedy tokens are native MTP's on code and copy-task prompts of 4,096 and 12,288
  tokens, up to near ties (the first difference where MTP's top-2 log-probability gap is below 0.25). With the
  Windowed-MTP artifact's repetition penalty of 1.15 the same comparison is recorded, not proven: SGLang's
  speculative path applies a "relaxed" penalty (each verify cycle's positions all get the penalty as it stood when
  the cycle began, ``speculative/eagle_utils.py``), so a penalised answer depends on where the cycles fall, which a
  window moves by changing what is accepted;
- the read set, both ways, with the draft layer's KV overwritten for one cycle at a time and restored after it:
  poisoned outside sink ∪ window (with two seeds), the windowed steps draft exactly what they draft clean, while a
  draft that reads everything (a window wider than the context) does not; poisoned inside the sink or inside the
  window, the windowed steps' drafts change. Only a cycle's later draft tokens come from windowed steps (the first
  comes from the draft-extend after the verify, which reads the whole context), so those are what is compared.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

from wmtp.layout import TRAINED_CHECKPOINT

FIXTURE = TRAINED_CHECKPOINT
K = 3
SINK, WINDOW = 16, 256
WIDE_OPEN = (0, 1_000_000)  # W beyond every context: the plugin drops nothing (= mtp)
READ_SET_PROMPT = "code 12288"
OUTPUT_TOKENS = 48
MAX_MODEL_LEN = 16640
NEAR_TIE = 0.25  # as in the vLLM proofs: a few bf16 ulps of the trained tiny model's logits
PENALTY = 1.15
# A cycle's tokens as the draft worker hands them to the verify: the bonus token, the draft-extend's, then one per
# windowed step.
FIRST_WINDOWED = 2


def _control(directory: Path, tag: str, window: tuple[int, int], poison: str | None = None, seed: int = 0) -> None:
    body: dict = {"tag": tag, "sink": window[0], "window": window[1]}
    if poison:
        body["poison"] = {"sink": SINK, "window": WINDOW, "region": poison, "seed": seed}
    (directory / "control.json.tmp").write_text(json.dumps(body))
    os.replace(directory / "control.json.tmp", directory / "control.json")


def _engine():
    import sglang

    from wmtp.engines.sglang import config_overrides

    overrides = config_overrides(json.loads((FIXTURE / "config.json").read_text()))
    return sglang.Engine(
        model_path=str(FIXTURE),
        dtype="bfloat16",
        context_length=MAX_MODEL_LEN,
        attention_backend="fa3",
        speculative_algorithm="NEXTN",
        speculative_num_steps=K,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=K + 1,
        speculative_draft_attention_backend="fa3",
        sampling_backend="pytorch",
        mem_fraction_static=0.3,
        cuda_graph_max_bs_decode=4,
        disable_radix_cache=True,
        json_model_override_args=json.dumps(overrides),
        random_seed=0,
        log_level="warning",
    )


def _generate(engine, ids: list[int], penalty: float = 1.0) -> dict:
    params = {"temperature": 0.0, "max_new_tokens": OUTPUT_TOKENS, "ignore_eos": True, "repetition_penalty": penalty}
    out = engine.generate(input_ids=ids, sampling_params=params, return_logprob=True, top_logprobs_num=2)
    meta = out["meta_info"]
    gaps = []
    for top in meta.get("output_top_logprobs") or []:
        best = sorted((entry[0] for entry in top or []), reverse=True)
        gaps.append(best[0] - best[1] if len(best) > 1 else float("inf"))
    verify = meta.get("spec_verify_ct")
    return {
        "ids": list(out["output_ids"]),
        "gaps": gaps,
        "tokens_per_verify": meta["completion_tokens"] / verify if verify else None,
    }


def _drafts(records: Path, tag: str) -> list:
    """The windowed steps' tokens of every cycle recorded under ``tag``."""
    lines = [json.loads(line) for line in records.read_text().splitlines()] if records.exists() else []
    return [
        [row[FIRST_WINDOWED:] for row in r["draft"]] for r in lines if r.get("kind") == "propose" and r["tag"] == tag
    ]


def run(prompts_file: Path, out_dir: Path) -> int:
    import sglang
    import torch

    from wmtp.analyze.equality import equal_up_to_numerics
    from wmtp.engines.sglang_hooks import check_hook_points
    from wmtp.measure.proofs import finish
    from wmtp.plugin import sglang_hookpoints as hp
    from wmtp.plugin import stats as wstats
    from wmtp.plugin import testing

    prompts = {name: list(ids) for name, ids in json.loads(prompts_file.read_text()).items()}
    test_dir, stats_dir = out_dir / "instrument", out_dir / "stats"
    test_dir.mkdir(parents=True, exist_ok=True)
    stats_dir.mkdir(exist_ok=True)
    root = Path(next(iter(sglang.__path__)))
    found: dict = {"hook_points": check_hook_points(root), "arms": {}, "proofs": {}}
    outputs: dict[str, dict] = {}
    for arm in ("mtp", "wmtp"):
        if arm == "wmtp":
            # Read by the plugin in each of SGLang's processes as it loads: set before the engine starts them.
            os.environ[hp.SETTINGS_ENV] = json.dumps({"sink": SINK, "window": WINDOW})
            os.environ[testing.ENV] = str(test_dir)
            os.environ[wstats.ENV] = str(stats_dir)
            _control(test_dir, "lossless", (SINK, WINDOW))
        started = time.monotonic()
        engine = _engine()
        found["arms"][arm] = {"start_s": round(time.monotonic() - started, 1)}
        started = time.monotonic()
        for name, ids in prompts.items():
            outputs[f"{arm} {name}"] = _generate(engine, ids)
            outputs[f"{arm} {name}, penalty {PENALTY}"] = _generate(engine, ids, PENALTY)
        if arm == "wmtp":
            ids = prompts[READ_SET_PROMPT]
            for tag, window, poison, seed in (
                ("clean", (SINK, WINDOW), None, 0),
                ("poison outside", (SINK, WINDOW), "outside", 1),
                ("poison outside, another seed", (SINK, WINDOW), "outside", 2),
                ("clean, read all", WIDE_OPEN, None, 0),
                ("poison outside, read all", WIDE_OPEN, "outside", 1),
                ("poison sink", (SINK, WINDOW), "sink", 1),
                ("poison window", (SINK, WINDOW), "window", 1),
            ):
                _control(test_dir, tag, window, poison, seed)
                outputs[f"read set {tag}"] = _generate(engine, ids)
            _control(test_dir, "idle", (SINK, WINDOW))
        found["arms"][arm]["requests_s"] = round(time.monotonic() - started, 1)
        engine.shutdown()
        del engine
        gc.collect()

    proofs = found["proofs"]
    proofs["hook points"] = bool(found["hook_points"].get("ok"))
    counted = wstats.summarize(wstats.read(stats_dir))
    # The scheduler writes its counters as it goes; the engine's shutdown ends it before a last write.
    found["plugin_counters"] = {**counted, "complete": False}
    proofs["windowed"] = counted["windowed_forwards"] > 0 and counted["blocks_skipped"] > 0
    for name in [*prompts, *(f"{name}, penalty {PENALTY}" for name in prompts)]:
        mtp, wmtp = outputs[f"mtp {name}"], outputs[f"wmtp {name}"]
        verdict = equal_up_to_numerics(mtp["ids"], mtp["gaps"], wmtp["ids"], NEAR_TIE)
        if "penalty" not in name:  # under a penalty SGLang's own drafting is not lossless (the docstring says why)
            proofs[f"lossless {name}"] = verdict.equal
        found.setdefault("lossless", {})[name] = {
            "reason": verdict.reason,
            "tokens_per_verify_mtp": mtp["tokens_per_verify"],
            "tokens_per_verify_wmtp": wmtp["tokens_per_verify"],
        }
    records = test_dir / "records.jsonl"
    tags = (
        "clean",
        "poison outside",
        "poison outside, another seed",
        "clean, read all",
        "poison outside, read all",
        "poison sink",
        "poison window",
    )
    drafts = {tag: _drafts(records, tag) for tag in tags}
    found["read_set"] = {tag: len(d) for tag, d in drafts.items()}
    poisons = [json.loads(line) for line in records.read_text().splitlines() if '"kind": "poison"' in line]
    found["poison_writes"] = {
        region: sum(p["slots"] for p in poisons if p["region"] == region) for region in ("outside", "sink", "window")
    }
    every = all(drafts.values())
    clean = drafts["clean"]
    proofs["read set: outside unread by the window"] = (
        every and drafts["poison outside"] == clean and drafts["poison outside, another seed"] == clean
    )
    proofs["read set: outside read without it"] = (
        every and drafts["poison outside, read all"] != drafts["clean, read all"]
    )
    proofs["read set: sink read"] = every and drafts["poison sink"] != clean
    proofs["read set: window read"] = every and drafts["poison window"] != clean
    found["engine"] = {"sglang": sglang.__version__, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
    return finish(found, outputs, out_dir / "sglang_gpu_proofs.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    return run(args.prompts, args.out)


if __name__ == "__main__":
    sys.exit(main())
