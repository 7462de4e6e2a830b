"""wmtp.report.paper_steps: the artifact's published steps beside their byte floors and this project's H200 steps."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from wmtp.report import load
from wmtp.report.paper_steps import B200_BANDWIDTH, paper_steps_section, paper_steps_sentence

PUBLISHED = load.load_published(load.PUBLISHED_DIR)
CONTEXT = 1_040_000


def test_each_artifact_model_gets_its_steps_ratio_and_what_the_windows_bytes_allow():
    frame = paper_steps_section(PUBLISHED).frame.set_index("model")
    assert list(frame.index) == [
        "qwen3.6-35b-a3b-nvfp4", "qwen3.5-122b-a10b-nvfp4", "nemotron-3-super-120b-a12b-nvfp4"
    ]  # fmt: skip
    q35 = frame.loc["qwen3.6-35b-a3b-nvfp4"]
    assert (q35["paper native (ms, B200)"], q35["paper windowed (ms, B200)"]) == (26.7, 18.4)
    assert q35["paper native / windowed"] == pytest.approx(26.7 / 18.4, abs=1e-3)
    # Six draft forwards of one full-attention layer each stop reading every KV token beyond S + W = 4,096:
    # 2 KV heads × 256 dims × K and V × 2 bytes on the Qwen shapes, 2 × 128 × 2 × 2 on Nemotron's.
    for model, kv_bytes in (("qwen3.6-35b-a3b-nvfp4", 2048), ("nemotron-3-super-120b-a12b-nvfp4", 1024)):
        removed = 6 * (CONTEXT + 1 - 4096) * kv_bytes
        assert frame.loc[model, "saved by bytes (ms, B200)"] == pytest.approx(removed / B200_BANDWIDTH * 1e3, abs=1e-3)
    # every published step sits above its floor, and saves more than its bytes explain
    assert (frame["native × floor"] > 1).all() and (frame["windowed × floor"] > 1).all()
    assert (frame["saved (ms)"] > frame["saved by bytes (ms, B200)"]).all()
    assert frame["H200 native (ms)"].isna().all()
    sentence = paper_steps_sentence(paper_steps_section(PUBLISHED))
    assert "qwen3.6-35b-a3b-nvfp4 8.3 ms, of which the bytes it stops reading explain at most 1.6" in sentence
    assert sentence.endswith("The rest is the native draft's kernels, not bytes.")


def test_an_h200_step_at_the_papers_shape_sits_beside_the_papers():
    steps = pd.DataFrame(
        [
            # the same shape in an engine with attention options of its own is another engine
            {"model": "qwen3.6-35b-a3b-nvfp4", "arm": "mtp", "k": 6, "context": CONTEXT, "S": None, "W": None,
             "step_ms": 3.0, "attention_config": "flash_attn_max_num_splits_for_cuda_graph=128"},
            {"model": "qwen3.6-35b-a3b-nvfp4", "arm": "mtp", "k": 6, "context": CONTEXT, "S": None, "W": None,
             "step_ms": 30.0, "window_anchor": None, "servers": 3, "over_floor": 1.7, "clock": "engine"},
            # an earlier plugin at the paper's shape (the window set by PyTorch operations) stands behind the newest
            {"model": "qwen3.6-35b-a3b-nvfp4", "arm": "wmtp", "k": 6, "context": CONTEXT, "S": 64, "W": 4032,
             "step_ms": 25.0, "window_anchor": "cycle", "window_kernels": "torch", "servers": 1, "over_floor": 1.7,
             "clock": "engine"},
            {"model": "qwen3.6-35b-a3b-nvfp4", "arm": "wmtp", "k": 6, "context": CONTEXT, "S": 64, "W": 4032,
             "step_ms": 24.0, "window_anchor": "cycle", "window_kernels": "triton", "servers": 2, "over_floor": 1.65,
             "clock": "engine"},
            # another window at the same shape is not the paper's
            {"model": "qwen3.6-35b-a3b-nvfp4", "arm": "wmtp", "k": 6, "context": CONTEXT, "S": 16, "W": 4096,
             "step_ms": 1.0},
            # another k is not the paper's
            {"model": "qwen3.6-35b-a3b-nvfp4", "arm": "mtp", "k": 3, "context": CONTEXT, "S": None, "W": None,
             "step_ms": 2.0},
        ]
    )  # fmt: skip
    frame = paper_steps_section(PUBLISHED, steps).frame.set_index("model")
    q35 = frame.loc["qwen3.6-35b-a3b-nvfp4"]
    assert (q35["H200 native (ms)"], q35["H200 windowed (ms)"], q35["H200 native / windowed"]) == (30.0, 24.0, 1.25)
    assert (q35["H200 × floor native / windowed"], q35["H200 servers native / windowed"]) == ("1.70/1.65", "3/2")
    assert q35["H200 clock"] == "engine"
    q122 = frame.loc["qwen3.5-122b-a10b-nvfp4"]
    assert (q122["H200 servers native / windowed"], q122["H200 clock"]) == ("–/–", "")
    assert math.isnan(frame.loc["qwen3.5-122b-a10b-nvfp4", "H200 native (ms)"])


def test_without_the_artifacts_steps_there_is_no_section():
    assert not paper_steps_section(PUBLISHED[PUBLISHED["study"] != "paper-1m"]).available
    assert paper_steps_sentence(paper_steps_section(pd.DataFrame())) == ""
