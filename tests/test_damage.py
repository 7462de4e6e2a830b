"""Damaged raw files are noticed, named and set aside so the cell is measured again (no engine needed)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from wmtp import layout
from wmtp.analyze.tidy import DamagedCell, collect
from wmtp.measure.cell import set_aside_damaged

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "embedded-cpu-run" / "raw"
CELL = "model~tiny/engine~vllm-cpu/arm~none/c~1"


@pytest.fixture
def cell(tmp_path) -> Path:
    out = tmp_path / "raw" / CELL
    shutil.copytree(FIXTURE / CELL, out)
    return out


def test_an_intact_cell_and_one_that_never_completed_are_not_damaged(cell, tmp_path):
    assert layout.damaged_files(cell) == {}
    assert layout.damaged_files(tmp_path / "nothing here") == {}


def test_a_truncated_parquet_a_missing_file_and_a_broken_manifest_are_each_named(cell):
    with (cell / layout.REQUESTS_FILE).open("r+b") as f:
        f.truncate(100)
    (cell / layout.COUNTERS_FILE).unlink()
    (cell / layout.POWER_FILE).unlink()  # collect does not read it: a missing one is Snakemake's to notice
    assert layout.damaged_files(cell) == {
        layout.REQUESTS_FILE: "not a whole parquet file (100 bytes)",
        layout.COUNTERS_FILE: "missing",
    }
    (cell / layout.MANIFEST_FILE).write_text('{"cell": ')
    assert layout.damaged_files(cell)[layout.MANIFEST_FILE].startswith("not JSON")


def test_the_same_damage_has_the_same_name_and_another_damage_another(cell):
    with (cell / layout.REQUESTS_FILE).open("r+b") as f:
        f.truncate(100)
    first = layout.damage_digest(cell, layout.damaged_files(cell))
    assert layout.damage_digest(cell, layout.damaged_files(cell)) == first
    with (cell / layout.REQUESTS_FILE).open("r+b") as f:
        f.truncate(50)
    assert layout.damage_digest(cell, layout.damaged_files(cell)) != first


def test_collect_names_the_damaged_file(cell, tmp_path):
    with (cell / layout.COUNTERS_FILE).open("r+b") as f:
        f.truncate(100)
    with pytest.raises(DamagedCell, match=rf"{layout.COUNTERS_FILE}: not a whole parquet file"):
        collect([cell], tmp_path / "tidy")


def test_collect_exits_2_with_one_line(cell, tmp_path):
    with (cell / layout.REQUESTS_FILE).open("r+b") as f:
        f.truncate(100)
    proc = subprocess.run(
        [sys.executable, "-m", "wmtp", "collect", "--out", str(tmp_path / "tidy"), str(cell / layout.MANIFEST_FILE)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and "requests.parquet: not a whole parquet file" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_setting_aside_moves_every_file_and_rewrites_none(cell, tmp_path):
    with (cell / layout.REQUESTS_FILE).open("r+b") as f:
        f.truncate(100)
    (cell / layout.SERVER_LOG).write_text("the server's log\n")
    before = {name: (cell / name).read_bytes() for name in layout.RAW_SUCCESS_FILES}
    record = tmp_path / "logs" / "damaged" / CELL / "0123456789abcdef.json"
    found = set_aside_damaged(cell, record)
    aside = cell / "damaged-0123456789abcdef"
    assert found["moved_to"] == str(aside)
    assert not any((cell / name).exists() for name in layout.RAW_SUCCESS_FILES)
    assert {name: (aside / name).read_bytes() for name in layout.RAW_SUCCESS_FILES} == before
    assert json.loads(record.read_text())["damaged"] == {layout.REQUESTS_FILE: "not a whole parquet file (100 bytes)"}
