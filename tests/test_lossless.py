"""The lossless table: each drafting answer against the same prompt's answer without a draft."""

from __future__ import annotations

import math

import pandas as pd

from wmtp.analyze.lossless import COLUMNS, lossless_summary, lossless_table


def _row(cell: str, arm: str, ids, gaps, *, k=None, sink=None, window=None, rung=1024, repeat=0, warmup=False):
    return {
        "cell_id": cell,
        "model": "m",
        "engine": "e",
        "concurrency": 1,
        "workload": "code",
        "rung": rung,
        "repeat": repeat,
        "slot": 0,
        "warmup": warmup,
        "arm": arm,
        "k": k,
        "sink": sink,
        "window": window,
        "token_ids": ids,
        "top2_gap": gaps,
    }


REFERENCE = [5, 6, 7, 8]
GAPS = [2.0, 0.01, 3.0, 3.0]


def test_each_drafting_answer_is_judged_against_the_no_draft_answer_to_its_prompt():
    requests = pd.DataFrame(
        [
            _row("none/server~1", "none", REFERENCE, GAPS),
            _row("none/server~2", "none", REFERENCE, GAPS),
            _row("mtp", "mtp", REFERENCE, GAPS, k=3),
            # Differs at token 1, where the reference's two best were 0.01 apart: a near tie, equal.
            _row("wmtp-w256", "wmtp", [5, 9, 7, 8], GAPS, k=3, sink=16, window=256),
            # Differs at token 2, where the reference was sure: not equal.
            _row("wmtp-w64", "wmtp", [5, 6, 1, 8], GAPS, k=3, sink=16, window=64),
            # Another prompt, which no reference answered: nothing to judge.
            _row("mtp", "mtp", REFERENCE, GAPS, k=3, repeat=1),
            _row("wmtp-w256", "wmtp", REFERENCE, GAPS, k=3, sink=16, window=256, warmup=True),
        ]
    )
    table = lossless_table(requests).set_index("cell_id")
    assert list(lossless_table(requests).columns) == COLUMNS
    assert sorted(table.index) == ["mtp", "none/server~2", "wmtp-w256", "wmtp-w64"]
    assert (table["reference_cell_id"] == "none/server~1").all()
    assert table.loc["mtp", "identical"] and table.loc["none/server~2", "identical"]
    near = table.loc["wmtp-w256"]
    assert near["equal"] and not near["identical"] and near["first_divergence"] == 1
    assert math.isclose(near["reference_gap"], 0.01)
    sure = table.loc["wmtp-w64"]
    assert not sure["equal"] and sure["first_divergence"] == 2 and "confident" in sure["reason"]

    # Against native MTP's answer at the same k: what the window alone changed.
    assert table.loc["wmtp-w256", "equal_to_mtp"] and not table.loc["wmtp-w64", "equal_to_mtp"]
    assert table.loc["mtp", "equal_to_mtp"] is None

    summary = lossless_summary(lossless_table(requests)).set_index("arm")
    assert summary.loc["mtp", ["requests", "identical", "equal", "diverged"]].tolist() == [1, 1, 1, 0]
    windowed = summary.loc["wmtp"].set_index("window")
    assert windowed.loc[256, ["identical", "equal", "diverged"]].tolist() == [0, 1, 0]
    assert windowed.loc[64, ["identical", "equal", "diverged"]].tolist() == [0, 0, 1]
    assert windowed.loc[256, "equal_to_mtp"] == "1 of 1" and summary.loc["mtp", "equal_to_mtp"] == ""


def test_a_divergence_native_mtp_shares_is_not_the_windows():
    # Both drafting arms leave the no-draft answer at the same confident token, and agree with each other.
    drafted = [5, 6, 1, 8]
    requests = pd.DataFrame(
        [
            _row("none", "none", REFERENCE, GAPS),
            _row("mtp", "mtp", drafted, GAPS, k=3),
            _row("wmtp", "wmtp", drafted, GAPS, k=3, sink=16, window=256),
        ]
    )
    table = lossless_table(requests).set_index("cell_id")
    assert not table["equal"].any()
    assert table.loc["wmtp", "equal_to_mtp"]


def test_without_a_no_draft_arm_native_mtp_at_the_same_k_is_the_reference():
    requests = pd.DataFrame(
        [
            _row("mtp-k3", "mtp", REFERENCE, GAPS, k=3),
            _row("mtp-k5", "mtp", [5, 6, 7, 1], GAPS, k=5),
            _row("wmtp-k3", "wmtp", [5, 6, 7, 8], GAPS, k=3, sink=16, window=256),
            _row("wmtp-k5", "wmtp", [5, 6, 7, 1], GAPS, k=5, sink=16, window=256),
        ]
    )
    table = lossless_table(requests).set_index("cell_id")
    assert sorted(table.index) == ["wmtp-k3", "wmtp-k5"]
    assert table.loc["wmtp-k3", "reference_cell_id"] == "mtp-k3" and table.loc["wmtp-k3", "identical"]
    assert table.loc["wmtp-k5", "reference_cell_id"] == "mtp-k5" and table.loc["wmtp-k5", "identical"]


def test_a_shorter_answer_and_missing_gaps_are_not_called_equal():
    requests = pd.DataFrame(
        [
            _row("none", "none", REFERENCE, None),
            _row("short", "mtp", REFERENCE[:3], None, k=3),
            _row("other", "wmtp", [5, 9, 7, 8], None, k=3, sink=1, window=8),
        ]
    )
    table = lossless_table(requests).set_index("cell_id")
    assert not table.loc["short", "equal"] and "lengths differ" in table.loc["short", "reason"]
    # Without the reference's log-probabilities no divergence can be called a near tie.
    assert not table.loc["other", "equal"]


def test_a_study_that_recorded_no_tokens_has_an_empty_table():
    requests = pd.DataFrame([_row("none", "none", None, None), _row("mtp", "mtp", None, None, k=3)])
    assert lossless_table(requests).empty and list(lossless_table(requests).columns) == COLUMNS
    assert lossless_summary(lossless_table(requests)).empty
    assert lossless_table(pd.DataFrame()).empty


def test_wmtp_lossless_judges_the_tables_of_every_group_together(tmp_path):
    from wmtp import cli

    # The reference and the drafting answers in two groups of pieces, as a study measured in pieces leaves them.
    first, second = tmp_path / "a.parquet", tmp_path / "b.parquet"
    pd.DataFrame([_row("none", "none", REFERENCE, GAPS)]).to_parquet(first)
    pd.DataFrame([_row("wmtp", "wmtp", [5, 9, 7, 8], GAPS, k=3, sink=16, window=256)]).to_parquet(second)
    out = tmp_path / "lossless.csv"
    assert cli.main(["lossless", "--out", str(out), str(first), str(second)]) == 0
    table = pd.read_csv(out)
    assert table[["cell_id", "reference_cell_id", "equal", "identical"]].values.tolist() == [
        ["wmtp", "none", True, False]
    ]
