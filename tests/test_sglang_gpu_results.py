"""The SGLang proofs study as it ran on a GPU (an H100): its committed raw files remake its committed tables through
the workflow, and those tables say what the study claims (every answer unchanged, the window counted, and the read
set visible in what the draft accepts)."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pandas as pd
import pytest
from test_pieces import scratch, snakemake
from test_workflow import job_counts

REPO = Path(__file__).resolve().parents[1]
STUDY = REPO / "config" / "studies" / "h200-sglang-proofs.yaml"
MEASURED = REPO / "measurements" / "h100"
RAW_TAR = MEASURED / "sglang_tiny_raw.tar.gz"
COMMITTED = {
    "steps/tiny~sglang.csv": MEASURED / "sglang_tiny.csv",
    "lossless.csv": MEASURED / "sglang_tiny_lossless.csv",
    "scheduler_steps.csv": MEASURED / "sglang_tiny_scheduler_steps.csv",
}


@pytest.fixture(scope="module")
def remade(tmp_path_factory) -> Path:
    """The committed raw files unpacked where the machine wrote them, and the study's whole run over them."""
    root = tmp_path_factory.mktemp("sglang-gpu")
    with tarfile.open(RAW_TAR) as tar:
        tar.extractall(root, filter="data")
    planned = snakemake("-n", "--configfile", str(STUDY), *scratch(root))
    assert planned.returncode == 0, planned.stdout + planned.stderr
    # Nothing is served again: the pieces are there, so no engine, model or piece is planned.
    assert job_counts(planned.stdout) == {
        "study": 1, "collect_pieces": 1, "step_table": 1, "lossless_pieces": 1, "scheduler_steps": 1, "all": 1,
        "total": 6,
    }  # fmt: skip
    out = snakemake("--configfile", str(STUDY), *scratch(root), "-j1")
    assert out.returncode == 0, out.stdout + out.stderr
    return root / "results" / "h200-sglang-proofs"


@pytest.mark.parametrize("made", sorted(COMMITTED))
def test_the_committed_tables_are_the_raw_files_tables(remade, made):
    pd.testing.assert_frame_equal(
        pd.read_csv(remade / made), pd.read_csv(COMMITTED[made]), check_exact=False, rtol=1e-9
    )


def test_every_drafting_answer_is_the_no_draft_answer_and_every_windowed_one_native_mtps():
    table = pd.read_csv(COMMITTED["lossless.csv"])
    assert len(table) == 36 and table["equal"].all()
    windowed = table[table["arm"] == "wmtp"]
    assert len(windowed) == 24 and windowed["equal_to_mtp"].astype(bool).all()
    # The one difference from no draft is a near tie, and native MTP makes it too.
    diverged = table[~table["identical"]]
    assert len(diverged) == 3 and diverged[["workload", "rung", "repeat"]].drop_duplicates().shape[0] == 1
    assert set(diverged["reason"].str.contains("near-tie")) == {True}
    assert set(diverged["arm"]) == {"mtp", "wmtp"}


def test_the_window_is_counted_and_what_the_draft_accepts_shows_its_read_set(remade):
    rungs = pd.read_parquet(remade / "tidy" / "rungs~16384-4096" / "rungs.parquet")
    windowed = rungs[rungs["arm"] == "wmtp"]
    assert (windowed["cell_windowed_forwards"] > 0).all()
    copy = rungs[rungs["workload"] == "copy"].set_index(["arm", "window", "rung"])["tok_per_verify"]
    for rung in (4096, 16384):
        native = copy.xs(("mtp", rung), level=("arm", "rung")).iloc[0]
        # The passage sits beyond a window of 256: only each cycle's first draft token (the draft-extend's, which
        # reads everything) is still accepted. A window wider than every prompt accepts what native MTP accepts.
        assert copy[("wmtp", 256.0, rung)] == 2.0 < native
        assert copy[("wmtp", 16640.0, rung)] == native
