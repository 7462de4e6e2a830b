"""A checkpoint stretched past its native length by RoPE scaling written into its config, weights linked.

Qwen3.5/3.6 are native 262,144-token models that reach 1M with YaRN (factor 4). Passing that as a runtime override
of these multimodal configs (vLLM's --hf-overrides, SGLang's --json-model-override-args) replaces the text config's
RoPE block and, in SGLang, drops fields start-up needs. So a study names the scaling on the model
(``rope_scaling``), and rule ``stretched_model`` writes a folder whose config.json carries it where the checkpoint
keeps its RoPE parameters, every other file a link to the original: nothing is copied, nothing of the original
changes, and the engines read one config.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("wmtp")

#: Files of a checkpoint folder that are not the checkpoint's (rule ``model``'s download record).
NOT_LINKED = ("config.json", "wmtp-download.json")


def stretched_config(config: Mapping[str, Any], rope_scaling: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with ``rope_scaling`` merged into its RoPE parameters.

    A multimodal config keeps them in its ``text_config``; within it, transformers 5's ``rope_parameters`` holds them
    where present (its other keys, such as the rotary fraction or the mrope sections, kept), else ``rope_scaling``.
    Where the scaling gives both its factor and the original length, the same layer's ``max_position_embeddings``
    becomes their product: the config then says the length it is stretched to (1,048,576 for 262,144 × 4), and a
    reader that derives YaRN's factor from that ratio (transformers does) finds the one written.
    """
    out = copy.deepcopy(dict(config))
    layer = out["text_config"] if isinstance(out.get("text_config"), dict) else out
    key = "rope_parameters" if isinstance(layer.get("rope_parameters"), dict) else "rope_scaling"
    current = layer.get(key) if isinstance(layer.get(key), dict) else {}
    layer[key] = {**current, **rope_scaling}
    factor, original = rope_scaling.get("factor"), rope_scaling.get("original_max_position_embeddings")
    if all(isinstance(v, int | float) and not isinstance(v, bool) for v in (factor, original)):
        layer["max_position_embeddings"] = int(original * factor)
    return out


def write_stretched(source: Path, out: Path, rope_scaling: Mapping[str, Any]) -> Path:
    """Write ``out``: the stretched config.json and a link to each other file of ``source``. Returns the config."""
    config_file = source / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{source} holds no config.json: is the checkpoint there?")
    out.mkdir(parents=True, exist_ok=True)
    for entry in sorted(source.iterdir()):
        if entry.name in NOT_LINKED or entry.name.startswith("."):
            continue
        link = out / entry.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.abspath(entry))
    stretched = stretched_config(json.loads(config_file.read_text()), rope_scaling)
    written = out / "config.json"
    partial = written.with_name(".config.json.partial")
    partial.write_text(json.dumps(stretched, indent=2) + "\n")
    partial.replace(written)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m wmtp.model.stretch", description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, required=True, help="the checkpoint folder")
    parser.add_argument("--out", type=Path, required=True, help="the stretched folder (its config.json is written)")
    parser.add_argument("--rope-scaling", required=True, help="the RoPE scaling as one JSON object")
    parser.add_argument("--log", type=Path)
    args = parser.parse_args(argv)
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if args.log:
        args.log.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(args.log))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", handlers=handlers)
    written = write_stretched(args.source, args.out, json.loads(args.rope_scaling))
    log.info("wrote %s: %s linked, RoPE scaling %s", written, args.source, args.rope_scaling)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
