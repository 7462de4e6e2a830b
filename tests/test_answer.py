"""Screening of impossible requests and the paired answer table, on requests built by hand."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from wmtp.analyze.answer import answer_table, sentence
from wmtp.analyze.tidy import STEP_FLOOR_FACTOR, counter_impossibility, exclusion_reason, screen_requests


def _requests(step_ms: dict[str, list[float]], rung: int = 4096, accepted: dict[str, list[float]] | None = None):
    """64-token requests per arm with the given per-token decode steps; drafting arms draft 15 × 3 tokens."""
    rows = []
    for arm, steps in step_ms.items():
        for repeat, step in enumerate(steps):
            drafting = arm != "none"
            acc = (accepted or {}).get(arm, [20.0] * len(steps))[repeat] if drafting else 0.0
            rows.append({
                "cell_id": f"c-{arm}", "model": "m", "engine": "e", "concurrency": 1, "workload": "code",
                "rung": rung, "repeat": repeat, "slot": 0, "arm": arm, "k": 3 if drafting else 0,
                "sink": 16.0 if arm == "wmtp" else math.nan, "window": 256.0 if arm == "wmtp" else math.nan,
                "completion_tokens": 64, "decode_s": 63 * step / 1000, "decode_tok_s": 1000 / step, "ttft_s": 0.5,
                "d_drafts": 15.0 if drafting else 0.0, "d_draft_tokens": 45.0 if drafting else 0.0,
                "d_accepted": acc,
                "req_tok_per_verify": 1 + acc / 15 if drafting else 1.0,
                "req_acceptance": acc / 45 if drafting else math.nan,
            })  # fmt: skip
    return pd.DataFrame(rows)


def _rungs(requests: pd.DataFrame) -> pd.DataFrame:
    return (
        requests.groupby(["cell_id", "workload", "rung"])["req_tok_per_verify"]
        .mean()
        .rename("tok_per_verify")
        .reset_index()
    )


def test_exclusion_reasons():
    assert exclusion_reason(1, 0.5, 0.01, []) == "no decode window (fewer than 2 tokens)"
    assert exclusion_reason(64, 0.0, 0.01, []) == "zero-length decode window"
    assert exclusion_reason(64, 63 * 0.0001, 0.01, []).startswith("decode step 0.1 ms < floor 10 ms")
    backwards = {"d_drafts": 3.0, "d_accepted": -1.0}
    assert exclusion_reason(64, 63 * 0.02, 0.01, backwards) == "a spec-decode counter went backwards"
    assert exclusion_reason(64, 63 * 0.02, 0.01, {"d_drafts": 3.0, "d_accepted": float("nan")}) == ""


def test_counters_that_cannot_all_be_true_are_screened():
    possible = {"d_drafts": 20.0, "d_draft_tokens": 60.0, "d_accepted": 43.0, "d_accepted_pos_0": 20.0}
    assert counter_impossibility(possible, k=3) == ""
    assert counter_impossibility({**possible, "d_accepted": 150.0}, k=3) == "accepted 150 draft tokens of 60 drafted"
    assert counter_impossibility({**possible, "d_draft_tokens": 61.0}, k=3).startswith("61 draft tokens in 20 drafts")
    assert counter_impossibility({**possible, "d_draft_tokens": 61.0}, k=None) == ""  # k unknown: not checked
    assert counter_impossibility({**possible, "d_accepted_pos_0": 21.0}, k=3).startswith("accepted at draft position 0")


def test_acceptance_above_one_is_excluded_and_counted():
    """Counters that say a request accepted more than it drafted give it no acceptance at all, not 2.5."""
    requests = _requests({"none": [12.0, 12.5, 11.8], "mtp": [10.0, 10.2, 9.5]}, accepted={"mtp": [24, 150, 30]})
    screened = screen_requests(requests)
    bad = screened[screened["excluded"]]
    assert list(bad["arm"]) == ["mtp"] and list(bad["repeat"]) == [1]
    assert bad["exclusion"].iloc[0].startswith("accepted 150 draft tokens")
    assert math.isnan(bad["req_acceptance"].iloc[0])
    kept = screened[(screened["arm"] == "mtp") & ~screened["excluded"]]
    assert kept["req_acceptance"].between(0, 1).all()


def test_a_burst_of_tokens_is_screened_and_drops_out_of_its_pair():
    """A decode 'window' of 0.7 ms for 63 tokens (90,000 tok/s on a CPU) is a buffered stream, not a decode."""
    requests = _requests({"none": [12.0, 12.5, 11.8], "mtp": [10.0, 0.011, 9.5]})
    screened = screen_requests(requests)
    bad = screened[screened["excluded"]]
    assert list(bad["repeat"]) == [1] and bad["exclusion"].iloc[0].startswith("decode step")
    assert math.isnan(bad["decode_tok_s"].iloc[0])
    assert math.isnan(bad["ttft_s"].iloc[0])  # its first token came late too
    assert screened.loc[~screened["excluded"], "ttft_s"].eq(0.5).all()
    floor_ms = np.median([12.0, 12.5, 11.8, 10.0, 9.5]) / STEP_FLOOR_FACTOR
    assert floor_ms > 0.011
    table = answer_table(screened, _rungs(screened))
    speedup = table[(table["quantity"] == "speedup") & (table["arm"] == "mtp")].iloc[0]
    assert speedup["n"] == 2  # the excluded request's pair is gone
    assert speedup["value"] == pytest.approx(math.sqrt((12.0 / 10.0) * (11.8 / 9.5)))
    assert speedup["hi"] < 1000  # one impossible point cannot stretch the interval to absurd values


def test_answer_pairs_by_prompt_and_gives_verdicts():
    # wmtp decodes 20 % faster than mtp on every prompt, and both beat none clearly.
    none = [20.0, 30.0, 25.0]
    mtp = [15.0, 22.0, 19.0]
    wmtp = [m / 1.2 for m in mtp]
    requests = screen_requests(
        _requests({"none": none, "mtp": mtp, "wmtp": wmtp}, accepted={"mtp": [24, 21, 30], "wmtp": [20, 18, 27]})
    )
    table = answer_table(requests, _rungs(requests)).set_index(["arm", "quantity"])
    assert table.loc[("wmtp", "speedup"), "value"] == pytest.approx(np.exp(np.mean(np.log(np.array(none) / wmtp))))
    assert table.loc[("wmtp", "speedup"), "verdict"] == "resolved"
    # cycle = tokPerVerify × step: native over windowed, per prompt
    cycle_mtp = [(1 + a / 15) * s for a, s in zip([24, 21, 30], mtp, strict=True)]
    cycle_wmtp = [(1 + a / 15) * s for a, s in zip([20, 18, 27], wmtp, strict=True)]
    expected = np.exp(np.mean(np.log(np.array(cycle_mtp) / cycle_wmtp)))
    assert table.loc[("wmtp", "cost_side_ratio"), "value"] == pytest.approx(expected)
    change = table.loc[("wmtp", "acceptance_change")]
    assert change["value"] == pytest.approx(np.mean([(20 - 24) / 45, (18 - 21) / 45, (27 - 30) / 45]))
    assert change["n"] == 3
    assert ("mtp", "cost_side_ratio") not in table.index


def test_an_unresolved_effect_is_said_to_be_unresolved():
    requests = screen_requests(_requests({"none": [10.0, 12.0, 11.0], "mtp": [9.0, 13.5, 10.5]}))
    row = answer_table(requests, _rungs(requests)).query("quantity == 'speedup'").iloc[0]
    assert row["verdict"] == "not resolved"
    assert sentence(row).endswith("not resolved: the interval includes no effect.")


def test_the_derive_stage_writes_what_the_report_reads(tmp_path):
    """Tidy tables of a real embedded run → derived/answer.parquet and excluded.parquet; the report reads them."""
    from pathlib import Path

    from wmtp.analyze.derive import derive
    from wmtp.analyze.tidy import collect
    from wmtp.report import load, sections

    raw = Path(__file__).parent / "fixtures" / "embedded-trained-run"
    tidy_dir = tmp_path / "embedded" / "tidy"
    collect([m.parent for m in raw.rglob("manifest.json")], tidy_dir)
    tables = derive(tidy_dir, tmp_path / "embedded" / "derived")
    assert set(tables["answer"]["quantity"]) == {"speedup", "cost_side_ratio"}  # no per-request counters then
    assert tables["excluded"].empty
    # The report's answer is the derived table, not a recomputation: a marker written there shows up.
    marked = tables["answer"].assign(verdict="marker")
    marked.to_parquet(tmp_path / "embedded" / "derived" / "answer.parquet", index=False)
    rows = sections.answer_rows(load.load_tidy(tidy_dir))
    assert set(rows["verdict"]) == {"marker"}


def test_the_answer_names_the_model_where_a_study_has_two():
    """Two models, one arm each way faster: the opening table and the sentences must tell them apart."""
    from wmtp.report.load import Tidy
    from wmtp.report.sections import answer_section, answer_sentences

    fast = _requests({"none": [15.0, 15.5, 14.8], "mtp": [10.0, 10.2, 9.9]}).assign(model="qwen")
    slow = _requests({"none": [10.0, 10.2, 9.9], "mtp": [12.5, 12.8, 12.4]}).assign(model="nemo")
    for frame in (fast, slow):
        frame["cell_id"] = frame["model"] + "-" + frame["arm"]
    requests = screen_requests(pd.concat([fast, slow], ignore_index=True))
    rungs = _rungs(requests).merge(requests[["cell_id", "arm"]].drop_duplicates(), on="cell_id")
    tidy = Tidy(requests=requests, rungs=rungs, positions=pd.DataFrame())
    series = list(answer_section(tidy).frame["series"])
    assert sorted(series) == ["mtp k=3 (nemo)", "mtp k=3 (qwen)"]
    said = [s for s in answer_sentences(tidy) if "the rate of no draft" in s]
    assert any(s.startswith("mtp k=3 (qwen) decodes at 1.5") for s in said), said
    assert any(s.startswith("mtp k=3 (nemo) decodes at 0.79") for s in said), said
    one = requests[requests["model"] == "qwen"]
    assert list(answer_section(Tidy(requests=one, rungs=rungs, positions=pd.DataFrame())).frame["series"]) == [
        "mtp k=3"
    ]


def test_acceptance_bounds_stay_within_what_a_rate_can_be_and_one_prompt_says_so():
    """Acceptances 0.45, 0.19, 0.01, 0.01 (a window that misses the passage): the t interval reaches -17 %; the
    table says 0 %. A single prompt has no interval, and the sentence says why rather than citing one."""
    from wmtp.analyze.answer import _row
    from wmtp.analyze.intervals import mean_interval

    row = _row(
        {},
        {"arm": "wmtp", "k": 3, "sink": 16, "window": 256},
        "acceptance",
        mean_interval([0.45, 0.19, 0.01, 0.01]),
        None,
    )
    assert row["lo"] == 0.0 and row["hi"] < 1.0 and row["lo"] <= row["value"] <= row["hi"]
    change = _row(
        {}, {"arm": "wmtp", "k": 3, "sink": 16, "window": 256}, "acceptance_change", mean_interval([-0.9, -0.1]), 0.0
    )
    assert change["lo"] == -1.0 and change["hi"] <= 1.0
    requests = screen_requests(_requests({"none": [10.0], "mtp": [8.0]}))
    one = answer_table(requests, _rungs(requests)).query("quantity == 'speedup'").iloc[0]
    assert one["n"] == 1 and "no interval" in sentence(one) and "the interval includes" not in sentence(one)
