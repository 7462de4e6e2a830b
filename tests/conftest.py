"""Shared fixtures: the repo root, the embedded study as a dict, a tiny tokenizer, and the engine.

Every engine test runs the engine that ``make engine`` builds for the embedded study
(``results/engines/vllm-cpu/``, or ``$WMTP_ENGINES_DIR/vllm-cpu/``), found only through the
``engine_python`` fixture. A missing engine skips those tests on a developer's machine and fails them
under ``CI=true``; the summary line ``wmtp engine tests: …`` counts them, and under ``CI=true`` a skipped
engine test fails the session, so a green CI means the proofs ran.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
ENGINE_NAME = "vllm-cpu"
ENGINE_MARK = "engine"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def engines_dir() -> Path:
    """Where ``make engine`` puts engines: ``$WMTP_ENGINES_DIR`` or the repository's results/engines."""
    return Path(os.environ.get("WMTP_ENGINES_DIR") or REPO / "results" / "engines").resolve()


def _missing_engine(message: str) -> None:
    if in_ci():
        pytest.fail(f"{message} (CI=true: an engine test never skips)", pytrace=False)
    pytest.skip(message)


def find_engine_python() -> str:
    """The embedded study's engine interpreter, checked to run vLLM with this checkout's plugin."""
    from wmtp.config import load_study
    from wmtp.engines.build import MANIFEST, engine_python

    spec = load_study(REPO / "config" / "config.yaml").engine(ENGINE_NAME)
    directory = engines_dir() / spec.name
    python = engine_python(spec, directory)
    if not (directory / MANIFEST).exists() or not Path(python).exists():
        _missing_engine(f"no engine at {directory} (build it: make engine)")
    probe = (
        "import json, wmtp; from wmtp.engines.vllm_hooks import check_hook_points; "
        "print('WMTP-SRC ' + json.dumps([wmtp.__file__, check_hook_points()]))"
    )
    proc = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=180, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("WMTP-SRC ")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"engine {python} cannot check the wmtp hook points:\n{proc.stderr[-3000:]}", pytrace=False)
    plugin_file, _ = json.loads(lines[-1][len("WMTP-SRC ") :])
    ours = (REPO / "src" / "wmtp").resolve()
    if Path(plugin_file).resolve().parent != ours:
        # An engine built from another checkout runs that checkout's plugin: its results would not test this code.
        pytest.fail(
            f"engine {python} imports wmtp from {Path(plugin_file).parent}, not {ours}; rebuild it here: make engine",
            pytrace=False,
        )
    return python


def wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None, poll_s: float = 0.25):
    """The first truthy value of ``predicate()``; fails on timeout or when ``proc`` exits meanwhile."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process exited ({proc.returncode}) while waiting for {what}")
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


@pytest.fixture(scope="session")
def engine_python() -> str:
    return find_engine_python()


def gpu_vllm_version() -> str:
    """The CUDA vLLM the H200 studies carry: scripts/device/engine_wheels.sh's default."""
    import re

    text = (REPO / "scripts" / "device" / "engine_wheels.sh").read_text()
    return re.search(r"vllm_version=\$\{VLLM_VERSION:-([\w.]+)\}", text).group(1)


@pytest.fixture(scope="session")
def gpu_vllm_sources() -> Path:
    """The Python sources of the H200 studies' vLLM that ``make engine`` reads out of its wheel, for the engine
    interpreter's PYTHONPATH: its scheduler runs here without a GPU."""
    root = engines_dir() / "sources" / f"vllm-{gpu_vllm_version()}"
    if not (root / "manifest.json").exists() or not (root / "vllm" / "__init__.py").exists():
        _missing_engine(f"no vLLM {gpu_vllm_version()} sources at {root} (build them: make engine)")
    return root


@pytest.fixture(scope="session")
def sglang_sources() -> Path:
    """The ``sglang`` package folder of the SGLang release the SGLang plugin is written against, as ``make engine``
    reads it out of the wheel: only the files its hook check reads."""
    from wmtp.plugin.sglang_hookpoints import TARGET_VERSION

    root = engines_dir() / "sources" / f"sglang-{TARGET_VERSION}"
    if not (root / "manifest.json").exists() or not (root / "sglang" / "srt").is_dir():
        _missing_engine(f"no SGLang {TARGET_VERSION} sources at {root} (build them: make engine)")
    return root / "sglang"


@pytest.fixture(scope="session")
def trained_none(engine_python: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Arm none of the committed trained checkpoint on one real server, read by two files in turn: a server start
    is about a minute on two cores. tests/test_engine_clock.py times requests against the engine's clock first, on
    the freshly started server, as it would on its own; tests/test_train.py then reads the reference outputs. The
    server is stopped before any test reads what they got."""
    from test_engine_clock import read_clock
    from test_train import read_reference
    from trained_server import serve

    from wmtp.model.train import install_fixture

    work = tmp_path_factory.mktemp("trained-none")
    model = work / "model"
    install_fixture(model)
    clock, reference = serve(engine_python, "none", model, work, [read_clock, read_reference])
    return {"clock": clock, "reference": reference}


# The in-process engines of tests/test_plugin_vllm.py and tests/test_plugin_ring.py: one working folder, one
# vLLM cache and short TMPDIR, and one random-weight model for both files (a model build is an interpreter that
# imports torch).


def build_tiny_model(python: str, out: Path, *extra: str) -> Path:
    subprocess.run(
        [python, "-m", "wmtp.model.tiny", "--out", str(out), *extra], check=True, capture_output=True, timeout=300
    )
    return out


BUILD_SCALED = r"""
import sys
from pathlib import Path
from safetensors.torch import load_file, save_file
path = Path(sys.argv[1]) / "model.safetensors"
state = load_file(str(path))
name = "mtp.layers.0.self_attn.o_proj.weight"
state[name] = (state[name].float() * 30).to(state[name].dtype)
save_file(state, str(path), metadata={"format": "pt"})
"""


@pytest.fixture(scope="session")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("plugin")


@pytest.fixture(scope="session")
def engine_env(work: Path):
    # The engine's vLLM cache, as every cell's server gets it (wmtp.cli), and one short TMPDIR (ZMQ socket paths)
    # for every engine: what vLLM learned of a model class carries over instead of costing each interpreter a
    # subprocess that imports vLLM again.
    cache = engines_dir() / ENGINE_NAME / "cache" / "vllm"
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="wmtp-plugin-"))  # short: ZMQ socket paths are limited to 107 characters
    yield {
        "VLLM_CACHE_ROOT": str(cache),
        "TMPDIR": str(tmp),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def random_model(engine_python: str, work: Path) -> Path:
    """The random-weight tiny model with its MTP layer's o_proj scaled ×30: its draft's proposals react to what
    its attention reads (tests/test_plugin_vllm.py's docstring)."""
    out = build_tiny_model(engine_python, work / "tiny-random")
    subprocess.run([engine_python, "-c", BUILD_SCALED, str(out)], check=True, capture_output=True, timeout=120)
    return out


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def embedded_raw() -> dict:
    """A fresh, mutable copy of config/config.yaml."""
    return copy.deepcopy(yaml.safe_load((REPO / "config" / "config.yaml").read_text()))


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory) -> Path:
    """The tiny model's tokenizer, trained as rules/models.smk trains it (no torch needed)."""
    from wmtp.model.tiny import train_tokenizer

    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(4096, out, max_chars=1_000_000)
    return out / "tokenizer.json"


# --------------------------------------------------------------------------------------------------
# Engine tests are counted, and under CI a skipped one fails the run


_engine_outcomes: dict[str, str] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker(ENGINE_MARK):
            # junitxml writes this property, so .ci/run can count engine tests from pytest's own report.
            item.user_properties.append(("marker", ENGINE_MARK))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if ENGINE_MARK not in report.keywords:
        return
    previous = _engine_outcomes.get(report.nodeid)
    if report.failed:
        _engine_outcomes[report.nodeid] = "failed"
    elif report.skipped and previous != "failed":
        _engine_outcomes[report.nodeid] = "skipped"
    elif report.when == "call" and report.passed and previous is None:
        _engine_outcomes[report.nodeid] = "passed"


def _engine_counts() -> dict[str, int]:
    counts = {"passed": 0, "skipped": 0, "failed": 0}
    for outcome in _engine_outcomes.values():
        counts[outcome] += 1
    return counts


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not _engine_outcomes:
        return
    counts = _engine_counts()
    terminalreporter.write_line(
        f"wmtp engine tests: {counts['passed']} passed, {counts['skipped']} skipped, {counts['failed']} failed"
    )
    if in_ci() and counts["skipped"]:
        terminalreporter.write_line("wmtp: CI=true and engine tests were skipped: the proofs did not run", red=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if in_ci() and _engine_counts()["skipped"] and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
