"""wmtp.report.questions: one sentence per figure, each stating the figure's number at the longest context with its
interval as labels.fmt_interval prints it, 'not resolved' where the interval holds no effect, and 'no interval'
where there is none."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pandas as pd
import pytest

from wmtp.report import engine_steps, labels, questions, sections
from wmtp.report.load import Section

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "config" / "published"


def _one_sentence(text: str) -> str:
    assert text, "no sentence"
    parts = [t for t in re.split(r"(?<=[.])\s+", text.strip()) if t]
    assert len(parts) == 1 and text.endswith("."), parts
    return text


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = ROOT / "tests" / "fixtures" / "tidy_synthetic" / "make_tidy.py"
    spec = importlib.util.spec_from_file_location("make_tidy", path)
    make = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(make)
    root = tmp_path_factory.mktemp("questions")
    make.write_replica(root / "results" / "replica" / "tidy" / "replica.parquet")
    tidy = make.write_tidy(root / "results" / "spark-128k" / "tidy", "spark-128k")
    return sections.load_report_data("spark-128k", tidy, PUBLISHED, n_boot=200)


def _longest(frame: pd.DataFrame, column: str = "rung") -> pd.DataFrame:
    return frame[frame[column] == frame[column].max()]


def test_the_speedup_sentence_states_each_drafts_speedup_with_its_interval(data):
    text = _one_sentence(questions.speedup_sentence(data.speedup))
    at = _longest(data.speedup.frame)
    assert labels.context_label(at["rung"].iloc[0]) in text
    for _, r in at.iterrows():
        assert f"{r['label']} {labels.fmt_interval(r['speedup'], r['lo'], r['hi'], null=1.0)}×" in text


def test_an_interval_that_holds_no_effect_reads_not_resolved(data):
    frame = data.speedup.frame.copy()
    longest = frame["rung"] == frame["rung"].max()
    frame.loc[longest, ["lo", "hi"]] = [0.9, 1.2]
    text = questions.speedup_sentence(Section(frame))
    unresolved = labels.fmt_interval(1.05, 0.9, 1.2, null=1.0)
    assert unresolved.startswith("not resolved [")
    assert text.count(f"{unresolved}×") == longest.sum()
    assert str(round(float(frame.loc[longest, "speedup"].iloc[0]), 2)) not in text


def test_decode_energy_and_prefill_sentences_carry_their_intervals(data):
    cases = [
        (questions.decode_sentence(data.decode), data.decode.frame, ("value", "lo", "hi"), ""),
        (questions.energy_sentence(data.energy), data.energy.frame, ("tok_per_j", "tok_per_j_lo", "tok_per_j_hi"), ""),
        (questions.prefill_sentence(data.prefill), data.prefill.frame, ("ttft_s", "ttft_s_lo", "ttft_s_hi"), " s"),
    ]
    for text, frame, (point, lo, hi), unit in cases:
        _one_sentence(text)
        for _, r in _longest(frame).iterrows():
            assert f"{r['label']} {labels.fmt_interval(r[point], r[lo], r[hi])}{unit}" in text, (point, text)


def test_the_cycle_sentence_gives_the_draft_tax_over_the_widest_span(data):
    text = _one_sentence(questions.cycle_sentence(data.cycle, data.draft_tax))
    f = data.draft_tax.frame
    widest = f[(f["rung_to"] == f["rung_to"].max()) & (f["rung_from"] == f["rung_from"].min())]
    assert f"From {labels.context_label(f['rung_from'].min())} to {labels.context_label(f['rung_to'].max())}" in text
    for _, r in widest.iterrows():
        share = labels.fmt_interval(100 * r["share"], 100 * r["share_lo"], 100 * r["share_hi"], null=0.0)
        assert f"{r['label']} {share} %" in text
    # without a no-draft arm there is no tax: each cycle, said to have no interval
    alone = _one_sentence(questions.cycle_sentence(data.cycle, Section()))
    assert "no interval" in alone and "ms" in alone


def test_acceptance_without_per_prompt_rows_is_a_pooled_count_without_an_interval(data):
    rows = sections.answer_rows(data.tidy)
    text = _one_sentence(questions.acceptance_sentence(rows[rows["quantity"] != "acceptance"], data.acceptance))
    assert "no interval" in text
    with_intervals = pd.DataFrame(
        [
            {**r, "quantity": "acceptance", "value": 0.7, "lo": 0.65, "hi": 0.75}
            for r in rows[rows["quantity"] == "speedup"].to_dict("records")
        ]
    )
    text = _one_sentence(questions.acceptance_sentence(with_intervals, data.acceptance))
    assert "mtp k=3 70 [65, 75] %" in text and "interval over the prompts" in text


def test_every_figure_sentence_is_one_sentence_with_a_number(data):
    steps = engine_steps.load_engine_steps([ROOT / "measurements" / "h200" / "vllm_qwen3.6-35b-a3b.csv"])
    texts = [
        questions.positions_sentence(data.positions),
        questions.wedge_sentence(data.wedge),
        questions.costmodel_sentence(data.costmodel),
        questions.engine_cycle_sentence(engine_steps.engine_cycles(steps)),
    ]
    for text in texts:
        assert re.search(r"\d", _one_sentence(text)), text
    assert "no interval" in texts[0] and "no interval" in texts[2]
    assert "engine's own clock" in texts[3]
    # nothing to show, nothing to say
    assert questions.wedge_sentence(Section()) == questions.engine_cycle_sentence(pd.DataFrame()) == ""
