"""The CI gate: a skipped engine test fails the run, counted from pytest's own JUnit report."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GATE = REPO / "scripts" / "ci" / "engine_tests.py"

SUITE = """
import pytest

@pytest.mark.engine
def test_needs_the_engine():
    pytest.skip("no engine here")

@pytest.mark.engine
def test_ran():
    assert True

def test_plain():
    assert True
"""


def _run_suite(tmp_path: Path, ci: str) -> tuple[subprocess.CompletedProcess, Path]:
    suite = tmp_path / "suite"
    suite.mkdir(exist_ok=True)
    shutil.copyfile(REPO / "tests" / "conftest.py", suite / "conftest.py")
    (suite / "test_fake.py").write_text(SUITE)
    (suite / "pytest.ini").write_text("[pytest]\nmarkers =\n    engine: needs the engine\n")
    report = tmp_path / f"report-{ci or 'dev'}.xml"
    env = {**os.environ, "CI": ci, "PYTEST_ADDOPTS": ""}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", str(suite)],
        capture_output=True,
        text=True,
        env=env,
        cwd=suite,
        timeout=120,
    )
    return proc, report


def test_a_skipped_engine_test_fails_the_session_under_ci(tmp_path):
    proc, report = _run_suite(tmp_path, "true")
    assert proc.returncode == 1, proc.stdout
    assert "wmtp engine tests: 1 passed, 1 skipped, 0 failed" in proc.stdout
    gate = subprocess.run([sys.executable, str(GATE), str(report)], capture_output=True, text=True)
    assert gate.returncode == 1
    assert "engine tests 1 passed, 1 skipped, 0 failed" in gate.stdout


def test_a_developer_run_only_counts_the_skip(tmp_path):
    proc, _ = _run_suite(tmp_path, "")
    assert proc.returncode == 0, proc.stdout
    assert "wmtp engine tests: 1 passed, 1 skipped, 0 failed" in proc.stdout


def test_the_gate_passes_when_every_engine_test_ran(tmp_path):
    report = tmp_path / "ok.xml"
    report.write_text(
        '<testsuites><testsuite><testcase name="a"><properties><property name="marker" '
        'value="engine"/></properties></testcase><testcase name="b"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    gate = subprocess.run([sys.executable, str(GATE), str(report)], capture_output=True, text=True)
    assert gate.returncode == 0, gate.stderr
    assert "engine tests 1 passed, 0 skipped, 0 failed" in gate.stdout


def test_the_gate_fails_when_no_engine_test_ran(tmp_path):
    report = tmp_path / "none.xml"
    report.write_text('<testsuites><testsuite><testcase name="b"/></testsuite></testsuites>')
    assert subprocess.run([sys.executable, str(GATE), str(report)], capture_output=True).returncode == 1
