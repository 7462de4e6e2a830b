"""wmtp.report.headline: the report opens with a short answer, from the committed real-engine step file."""

from __future__ import annotations

from pathlib import Path

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
    assert "d 7 (6 draft forwards), W 4032, S 64" in text
    # 10 full-attention layers, 6 draft forwards of one: 1 + 6/10
    assert "ceiling is 1.60" in text and "within it" in text


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
