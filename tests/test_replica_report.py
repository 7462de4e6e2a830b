"""The report's replica tables: one request per step for the paper's claim, the batch sweep, the floor."""

from __future__ import annotations

import pytest

pd = pytest.importorskip("pandas")

from wmtp.report import compare  # noqa: E402

MODEL = "Qwen3.6-35B-A3B"


def tidy_rows() -> pd.DataFrame:
    rows = []
    for batch, (nat, win) in ((1, (13.0, 11.6)), (4, (38.0, 32.0))):
        for k in (1, 3):
            for arm, ms, floor in (("mtp", nat, nat * 0.8), ("wmtp", win, win * 0.8)):
                rows.append(
                    {"model": MODEL, "context": 1 << 20, "k": k, "batch": batch, "arm": arm, "sink": 64,
                     "window": 4032, "backend": "triton", "measured_ms": ms, "predicted_ms": floor,
                     "measured_ratio": nat / win, "predicted_ratio": (nat * 0.8) / (win * 0.8) + 0.01 * batch}
                )  # fmt: skip
    return pd.DataFrame(rows)


def test_single_request_rows_only_reach_the_paper_claim():
    frame = tidy_rows()
    one = compare.single_request(frame)
    assert set(one["batch"]) == {1} and len(one) == len(frame) / 2
    assert compare.single_request(frame.drop(columns="batch")).equals(frame.drop(columns="batch"))


def test_batch_section_has_each_k_and_batch_at_the_longest_context_with_its_ceiling():
    frame = compare.replica_batch_section(tidy_rows(), ks=(1, 3)).frame
    assert list(zip(frame["k"], frame["batch"], strict=True)) == [(1, 1), (1, 4), (3, 1), (3, 4)]
    assert sorted(set(frame["ceiling 1 + k/L_full"])) == pytest.approx([1.1, 1.3])
    at4 = frame[(frame["k"] == 3) & (frame["batch"] == 4)].iloc[0]
    assert at4["replica (H200)"] == pytest.approx(38.0 / 32.0, abs=1e-3)
    assert at4["replica / floor"] == pytest.approx(at4["replica (H200)"] / at4["floor"], abs=2e-3)
    assert compare.replica_batch_section(tidy_rows().drop(columns="batch")).frame.empty


def test_floor_section_is_step_over_floor_per_arm():
    frame = compare.replica_floor_section(tidy_rows(), batch=4).frame
    assert len(frame) == 4 and list(frame["step / floor"]) == pytest.approx([1.25] * 4)
    assert compare.replica_floor_section(None).frame.empty
