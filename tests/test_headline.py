"""wmtp.report.headline: the report opens with a short answer, from the committed real-engine step file."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from wmtp.report import compare, engine_steps, headline, load

ROOT = Path(__file__).resolve().parents[1]


def test_the_answer_is_short_states_intervals_and_sets_the_paper_at_its_own_d():
    steps = engine_steps.load_engine_steps([ROOT / "measurements" / "h200" / "vllm_qwen3.6-35b-a3b.csv"])
    frame = engine_steps.engine_step_section(steps, None).frame
    claim = compare.paper_claim(load.load_published(load.PUBLISHED_DIR))
    sentences = headline.headline_sentences(frame, claim)
    assert 1 <= len(sentences) <= headline.MAX_SENTENCES
    text = " ".join(sentences)
    # the engine's range over servers holds 1 at 131K: not a number to read
    assert "131K: not resolved [" in text
    # each plugin its own clause, the newest first (its Triton kernels, then the window set once a cycle by PyTorch
    # operations, then for each forward), each context it measured once in each
    measured = text.split("with the draft's window set once a decode cycle, by the plugin's Triton kernels, ")[1]
    measured = measured.split(" (ranges over pairings")[0]
    triton, rest = measured.split("; and with the draft's window set once a decode cycle, ")
    current, earlier = rest.split("; and with the draft's window set for each draft forward, ")
    assert [part.split(":")[0] for part in triton.split("; ")] == ["131K", "1M"]
    for clause in (current, earlier):
        assert [part.split(":")[0] for part in clause.split("; ")] == ["131K", "524K", "1M"]
    # servers on several GPUs: the ratio over pairings on one GPU leads, the pooled range follows, flagged where
    # it passes the ceiling
    assert triton.startswith("131K: 1.027 [1.010, 1.044] between servers on one GPU, 1.10 [1.00, 1.32] over 4 GPUs")
    assert current.startswith(
        "131K: 1.03 [1.02, 1.11] between servers on one GPU, 1.11 [1.02, 1.33] over 4 GPUs (its range passes the "
        "ceiling 1.30: servers, not the window)"
    )
    assert "1M: 1.138 between servers on one GPU (one pairing), 1.138 [1.134, 1.143] over 5 GPUs" in current
    assert "1M: 1.1363 [1.1337, 1.1390] between servers on one GPU, 1.138 [1.134, 1.141] over 4 GPUs" in triton
    # the window-off control beside the windowed cycle: the window's own saving at each context it was measured
    assert "the window alone saves (the control's cycle over the windowed one) is 131K: 1.033 [" in text
    assert "d 7 (6 draft forwards), W 4032, S 64" in text
    # 10 full-attention layers, 6 draft forwards of one: 1 + 6/10
    assert "ceiling is 1.60" in text and "within it" in text


def test_the_replica_is_named_once_a_context_beside_two_plugins(tmp_path):
    rows = [
        {"engine_version": "0.24.0", "arm": arm, "k": 0 if arm == "none" else 3, "context": 131072, "batch": 1,
         "step_ms": ms, "n": 3, "S": 16 if arm == "wmtp" else None, "W": 4096 if arm == "wmtp" else None,
         "window_anchor": anchor if arm == "wmtp" else None, "windowed_forwards": 10}
        for arm, ms, anchor in (("none", 5, None), ("mtp", 9, None), ("wmtp", 8.5, "forward"), ("wmtp", 8, "cycle"))
    ]  # fmt: skip
    path = tmp_path / "vllm_qwen3.6-35b-a3b.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    replica = pd.DataFrame(
        [{"model": "Qwen3.6-35B-A3B", "context": 131072, "k": 3, "batch": 1, "arm": arm, "measured_ratio": 1.04,
          "predicted_ratio": 1.05} for arm in ("mtp", "wmtp")]
    )  # fmt: skip
    frame = engine_steps.engine_step_section(engine_steps.load_engine_steps([path]), replica).frame
    text = " ".join(headline.headline_sentences(frame, None))
    assert "the GPU replica gives 1.04 at 131K and the cost model 1.05." in text
    # one server each: the ratio alone, no verdict; the current plugin first
    assert text.index("once a decode cycle, 131K: 1.125;") < text.index("for each draft forward, 131K: 1.059 (")


def test_the_window_off_control_is_set_against_both_drafting_arms(tmp_path):
    rows = [
        {"engine_version": "0.24.0", "arm": arm, "k": 0 if arm == "none" else 3, "context": 131072, "batch": 1,
         "step_ms": ms, "n": 3, "S": 16 if arm == "wmtp" else None, "W": window, "window_anchor": "cycle",
         "server_step_ms": servers, "server_gpus": gpus, "servers": len(servers.split(";"))}
        for arm, ms, window, servers, gpus in (
            ("none", 5.0, None, "5.0", "a"),
            ("mtp", 10.0, None, "10.0;12.0", "a;b"),
            ("wmtp", 9.0, 4096, "9.0", "a"),
            ("wmtp", 9.5, 1049600, "9.5", "a"),
        )
    ]  # fmt: skip
    path = tmp_path / "vllm_qwen3.6-35b-a3b.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    frame = engine_steps.engine_step_section(engine_steps.load_engine_steps([path]), None).frame
    (row,) = frame.to_dict("records")
    assert row["window off / wmtp"] == pytest.approx(9.5 / 9.0)
    assert row["mtp / window off"] == pytest.approx(10.0 / 9.5)
    assert (row["mtp_off_lo"], row["mtp_off_hi"]) == pytest.approx((10.0 / 9.5, 12.0 / 9.5))
    # on one GPU only mtp's server on "a" pairs with the control
    assert row["mtp / window off, servers on one GPU"].startswith("1.05 (one pairing), 1 pairing of 1/1")
    text = " ".join(headline.headline_sentences(frame, None))
    assert "the window alone saves (the control's cycle over the windowed one) is 131K: 1.056;" in text
    assert "(loaded, its window covering the context; 1 server of it)" in text
    # mtp's servers ran on two GPUs: the answer and its figure lead with the one pairing on GPU "a"
    assert (row["lead"], row["lead_pairs"], row["lead_on_one_gpu"]) == (pytest.approx(10.0 / 9.0), 1, 1)
    assert (row["lead_hi"], row["ratio_hi"]) == (pytest.approx(10.0 / 9.0), pytest.approx(12.0 / 9.0))
    assert "native MTP over that control reads 131K: 1.05 [1.05, 1.26]." in text
    # without a control the sentence is not there
    pd.DataFrame(rows[:3]).to_csv(path, index=False)
    frame = engine_steps.engine_step_section(engine_steps.load_engine_steps([path]), None).frame
    assert "window-off control" not in " ".join(headline.headline_sentences(frame, None))


def test_without_an_engine_the_answer_says_so():
    (first, *_) = headline.headline_sentences(None, None)
    assert "No real engine" in first


def test_the_papers_mark_is_the_middle_of_its_range_with_the_ceiling_at_its_own_d():
    steps = engine_steps.load_engine_steps([ROOT / "measurements" / "h200" / "vllm_qwen3.6-35b-a3b.csv"])
    frame = engine_steps.engine_step_section(steps, None).frame
    claim = compare.paper_claim(load.load_published(load.PUBLISHED_DIR))
    (mark,) = headline.paper_marks(frame, claim).to_dict("records")
    assert mark["model"] == "qwen3.6-35b-a3b" and mark["rung"] == 1 << 20
    # 1.28–1.44 at 1M: the point 1.36 with that range; 10 full-attention layers, 6 draft forwards: 1 + 6/10
    assert (mark["lo"], mark["ratio"], mark["hi"]) == pytest.approx((1.28, 1.36, 1.44))
    assert mark["ceiling"] == pytest.approx(1.6)
    assert headline.paper_marks(frame, None).empty and headline.paper_marks(None, claim).empty


def test_an_engine_with_its_own_attention_options_is_its_own_clause_row_and_series(tmp_path):
    tuned = "flash_attn_max_num_splits_for_cuda_graph=128"
    rows = [
        {"engine_version": "0.24.0", "attention_config": cfg, "arm": arm, "k": 0 if arm == "none" else 3,
         "context": context, "batch": 1, "step_ms": ms * (0.8 if cfg else 1.0) * context / 131072, "n": 3,
         "S": 16 if arm == "wmtp" else None, "W": 4096 if arm == "wmtp" else None, "window_anchor": "cycle",
         "growth_ms": 1.0 if context > 131072 else None, "growth_floor_ms": 0.5, "growth_servers": 1}
        for cfg in ("", tuned)
        for context in (131072, 262144)
        for arm, ms in (("none", 5.0), ("mtp", 10.0), ("wmtp", 8.0))
    ]  # fmt: skip
    path = tmp_path / "vllm_qwen3.6-35b-a3b.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    steps = engine_steps.load_engine_steps([path])
    frame = engine_steps.engine_step_section(steps, None).frame
    assert sorted(set(frame["engine"])) == ["vLLM 0.24.0", f"vLLM 0.24.0, attention {tuned}"]
    # each engine's ratio from its own rows: the tuned engine's cycles are 0.8 of the default's in every arm
    assert list(frame["engine mtp / wmtp"]) == pytest.approx([1.25] * 4)
    assert set(frame.loc[frame["engine"].str.contains("attention"), "mtp (ms)"]) == {8.0, 16.0}
    text = " ".join(headline.headline_sentences(frame, None))
    assert "timed by the engine's own clock, in vLLM 0.24.0 at k 3 and batch 1, with" in text
    assert f"; in vLLM 0.24.0, attention {tuned} at k 3 and batch 1, with" in text
    growth = engine_steps.growth_check_section(steps).frame
    # one growth per engine and arm: the two engines' rows never pair up as one series
    assert len(growth) == 6 and growth.groupby(["engine", "series"]).size().eq(1).all()


def test_two_models_at_two_depths_are_two_clauses_each_with_its_own_k_and_ceiling(tmp_path):
    paths = []
    for model, k, factor in (("qwen3.6-35b-a3b", 3, 1.0), ("nemotron-3-super-120b-a12b-nvfp4", 6, 2.0)):
        rows = [
            {"engine_version": "0.24.0", "arm": arm, "k": 0 if arm == "none" else k, "context": 1048576, "batch": 1,
             "step_ms": ms * factor, "n": 1, "S": 16 if arm == "wmtp" else None, "W": 4096 if arm == "wmtp" else None,
             "window_anchor": "cycle"}
            for arm, ms in (("none", 5.0), ("mtp", 12.0), ("wmtp", 10.0))
        ]  # fmt: skip
        paths.append(tmp_path / f"vllm_{model}.csv")
        pd.DataFrame(rows).to_csv(paths[-1], index=False)
    frame = engine_steps.engine_step_section(engine_steps.load_engine_steps(paths), None).frame
    text = " ".join(headline.headline_sentences(frame, None))
    # the ceilings 1 + 3/10 and 1 + 6/8: each model's facts file found from its checkpoint's name
    assert (
        "cannot exceed 1 + k/L_full: 1.75 for nemotron-3-super-120b-a12b-nvfp4 at k 6; 1.30 for qwen3.6-35b-a3b" in text
    )
    assert "in vLLM 0.24.0 for nemotron-3-super-120b-a12b-nvfp4 at k 6 and batch 1, with" in text
    assert "; in vLLM 0.24.0 for qwen3.6-35b-a3b at k 3 and batch 1, with" in text
