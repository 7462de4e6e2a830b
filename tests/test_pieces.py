"""A study measured in pieces: the paths layout owns, the pieces a study lists, their selection and order, and the
rules that run, collect and tabulate them, down to the committed H200 pieces, read as they are."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pandas as pd
import pytest
import yaml
from test_workflow import job_counts

from wmtp import cli, layout
from wmtp.analyze.steps import MixedReleases, engine_release
from wmtp.config import ConfigError, cell_selected, expand_pieces, load_study, select_pieces, study_from_dict
from wmtp.measure.identity import cell_study, piece_identity, piece_study

REPO = Path(__file__).resolve().parents[1]
H200 = REPO / "config" / "studies" / "h200-vllm.yaml"
RAW_TAR = REPO / "measurements" / "h200" / "vllm_qwen3.6-35b-a3b_raw.tar.gz"
COMMITTED_STEPS = REPO / "measurements" / "h200" / "vllm_qwen3.6-35b-a3b.csv"
MODEL = "model~qwen3.6-35b-a3b/engine~vllm"
STEP_FILE = "h200-vllm/steps/qwen3.6-35b-a3b~vllm.csv"


def committed_manifests() -> dict[str, dict]:
    """The committed raw tarball's manifests, by their path in it."""
    with tarfile.open(RAW_TAR) as tar:
        return {
            member.name: json.load(tar.extractfile(member))
            for member in tar.getmembers()
            if member.name.endswith("/" + layout.MANIFEST_FILE)
        }


@pytest.fixture(scope="module")
def h200():
    return load_study(H200)


@pytest.fixture
def committed_raw(tmp_path) -> Path:
    """The committed H200 pieces unpacked, as they came back from the machine: <dir>/results/h200-vllm/raw/…"""
    root = tmp_path / "carried"
    with tarfile.open(RAW_TAR) as tar:
        tar.extractall(root, filter="data")
    return root


def test_a_group_names_its_rungs_longest_first():
    assert layout.piece_group([131072]) == "rung~131072"
    assert layout.piece_group([524288, 1048576]) == "rungs~1048576-524288"
    assert layout.piece_group((131072, 1048576, 524288)) == "rungs~1048576-524288-131072"
    assert layout.piece_rungs("rungs~1048576-524288-131072") == (1048576, 524288, 131072)
    assert layout.piece_rungs("rung~1048576") == (1048576,)


@pytest.mark.parametrize("group", ["rungs~524288-1048576", "rungs~1024-1024", "rung~1024-512", "rungs~1024", "1024"])
def test_a_group_the_layout_would_not_write_is_refused(group):
    with pytest.raises(ValueError):
        layout.piece_rungs(group)


@pytest.mark.parametrize("rungs", [[], [1024, 1024], [0]])
def test_a_piece_sweeps_distinct_positive_rungs(rungs):
    with pytest.raises(ValueError):
        layout.piece_group(rungs)


def test_the_layout_owns_exactly_the_committed_piece_paths(h200):
    """Every piece the H200 study lists is a folder of the committed tarball, and every folder there is one."""
    results = layout.study_dir(h200.results_dir, h200.study)
    listed = {
        str(layout.piece_dir(results, piece.group, piece.cell.cell_id) / layout.MANIFEST_FILE)
        for piece in expand_pieces(h200)
    }
    assert listed == set(committed_manifests())
    assert len(listed) == 27


def test_a_listed_piece_measures_what_the_committed_one_recorded(h200):
    """The narrowed study a piece's job gets sweeps its rungs alone, with the protocol its manifest recorded."""
    manifests = committed_manifests()
    results = layout.study_dir(h200.results_dir, h200.study)
    for piece in expand_pieces(h200):
        recorded = manifests[str(layout.piece_dir(results, piece.group, piece.cell.cell_id) / layout.MANIFEST_FILE)]
        identity = piece_identity(h200, piece)
        assert identity["protocol"] == recorded["identity"]["protocol"]
        assert identity["cell"] == recorded["identity"]["cell"]
    two = next(p for p in expand_pieces(h200) if p.group == "rungs~1048576-524288")
    narrowed = piece_study(h200, two)
    assert narrowed["protocol"]["rungs"] == [524288, 1048576] and narrowed["protocol"]["repeats"] == [1, 1]
    assert "pieces" not in narrowed and "pieces" not in cell_study(h200, two.cell)


def test_selection_runs_the_longest_rung_first_then_server_by_server_in_the_arms_order(h200):
    picked = select_pieces(expand_pieces(h200), arms=["wmtp", "mtp"])
    order = [(p.group, p.cell.arm, p.cell.server) for p in picked]
    assert order[:15] == [
        ("rungs~1048576-524288", "wmtp", 1),
        ("rungs~1048576-524288-131072", "wmtp", 1),
        ("rungs~1048576-131072", "wmtp", 1),  # the window-off control
        ("rungs~1048576-131072", "wmtp", 1),
        ("rungs~1048576-524288", "mtp", 1),
        ("rungs~1048576-131072", "mtp", 1),
        ("rungs~1048576-524288", "wmtp", 2),
        ("rungs~1048576-524288-131072", "wmtp", 2),
        ("rungs~1048576-131072", "wmtp", 2),
        ("rungs~1048576-524288", "mtp", 2),
        ("rungs~1048576-131072", "mtp", 2),
        ("rungs~1048576-524288-131072", "wmtp", 3),
        ("rung~1048576", "mtp", 3),
        ("rungs~1048576-131072", "mtp", 3),
        ("rungs~524288-131072", "mtp", 1),
    ]
    assert order[15:] == [("rung~131072", arm, server) for server in (1, 2, 3) for arm in ("wmtp", "mtp")]
    # Longest rung first across groups: none's piece over all three rungs comes before every 128K piece.
    everything = [p.group for p in select_pieces(expand_pieces(h200))]
    assert everything.index("rungs~1048576-524288-131072") < everything.index("rung~131072")


def test_selection_by_servers_and_by_exact_rungs(h200):
    third = select_pieces(expand_pieces(h200), servers=[3], rungs=[131072])
    assert [(p.group, p.cell.arm) for p in third] == [("rung~131072", a) for a in ("none", "mtp", "wmtp")]
    assert select_pieces(expand_pieces(h200), rungs=[524288]) == []
    assert len(select_pieces(expand_pieces(h200), rungs=[524288, 1048576])) == 5


def test_k_and_window_selectors_pass_a_cell_without_a_draft_or_a_window(h200):
    cells = {(c.arm, c.window, c.server): c for c in h200.cells()}
    none, mtp, control = cells[("none", None, 1)], cells[("mtp", None, 1)], cells[("wmtp", 1049600, 1)]
    assert cell_selected(none, ks=[3], windows=[4096])
    assert cell_selected(mtp, windows=[4096]) and not cell_selected(mtp, ks=[5])
    assert not cell_selected(control, windows=[4096]) and cell_selected(control, windows=[1049600])
    assert not cell_selected(mtp, servers=[2])


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"rungs": [2048]}, "config: pieces[0].rungs[0] = 2048 is not one of protocol.rungs (1024, 4096, 16384)"),
        ({"rungs": [1024], "servers": [2]}, "config: pieces[0].servers[0] = 2 picks no cell of the study"),
        ({"rungs": [1024], "k": [5]}, "config: pieces[0].k[0] = 5 picks no cell of the study"),
        (
            {"rungs": [1024], "arms": ["wmtp-ring"], "windows": [4096]},
            "config: pieces[0] picks no cell of the study (its selectors exclude each other)",
        ),
    ],
)
def test_a_piece_entry_that_picks_nothing_is_refused(embedded_raw, entry, message):
    with pytest.raises(ConfigError) as err:
        study_from_dict({**embedded_raw, "pieces": [entry]})
    assert str(err.value) == message


def test_a_piece_listed_twice_is_refused(embedded_raw):
    pieces = [{"rungs": [1024, 4096], "arms": ["mtp"]}, {"rungs": [4096, 1024]}]
    with pytest.raises(ConfigError, match=r"pieces\[1\] repeats pieces\[0\]'s piece of .*arm~mtp.* over 4096, 1024"):
        study_from_dict({**embedded_raw, "pieces": pieces})


def test_a_study_without_pieces_reads_as_it_did(embedded_raw):
    study = study_from_dict(embedded_raw)
    assert "pieces" not in study.model_dump(mode="json") and expand_pieces(study) == []


def test_wmtp_pieces_prints_the_target_paths_of_a_selection(capsys):
    assert cli.main(["pieces", "--config", str(H200), "--arms", "mtp", "wmtp", "--servers", "3"]) == 0
    raw = "results/h200-vllm/raw"
    assert capsys.readouterr().out.splitlines() == [
        f"{raw}/rung~1048576/{MODEL}/arm~mtp/k~3/c~1/server~3/manifest.json",
        f"{raw}/rungs~1048576-131072/{MODEL}/arm~mtp/k~3/c~1/server~3/manifest.json",
        f"{raw}/rungs~1048576-524288-131072/{MODEL}/arm~wmtp/k~3/s~16/w~4096/c~1/server~3/manifest.json",
        f"{raw}/rung~131072/{MODEL}/arm~mtp/k~3/c~1/server~3/manifest.json",
        f"{raw}/rung~131072/{MODEL}/arm~wmtp/k~3/s~16/w~4096/c~1/server~3/manifest.json",
    ]
    assert cli.main(["pieces", "--config", str(H200), "--step-files"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"results/{STEP_FILE}"]


def test_wmtp_pieces_refuses_a_study_without_pieces_and_an_empty_selection(capsys):
    assert cli.main(["pieces", "--config", str(REPO / "config" / "config.yaml")]) == 2
    assert "study 'embedded' declares no pieces" in capsys.readouterr().err
    assert cli.main(["pieces", "--config", str(H200), "--rungs", "524288"]) == 2
    assert "no piece of study 'h200-vllm' is picked by this selection" in capsys.readouterr().err


def test_a_step_file_is_one_engine_release():
    vllm = {"engine": {"kind": "vllm", "versions": {"vllm": "0.24.0", "torch": "2.11.0"}}}
    assert engine_release([vllm, vllm]) == "0.24.0"
    newer = {"engine": {"kind": "vllm", "versions": {"vllm": "0.25.0"}}}
    with pytest.raises(MixedReleases, match=r"2 releases of their engine: 0\.24\.0, 0\.25\.0"):
        engine_release([vllm, newer])
    with pytest.raises(MixedReleases, match=r"2 releases of their engine: 0\.24\.0, \?"):
        engine_release([vllm, {"engine": {"kind": "vllm"}}])


def snakemake(*args: str, cwd: Path = REPO, block_pulp: bool = False) -> subprocess.CompletedProcess:
    """Snakemake as a user runs it; ``block_pulp``: as on the H200, where PuLP is not carried."""
    prelude = "import sys; sys.modules['pulp'] = None; " if block_pulp else "import sys; "
    code = prelude + "from snakemake.cli import main; sys.argv[0] = 'snakemake'; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True, timeout=600, check=False
    )


def scratch(root: Path) -> list[str]:
    return ["--config", f"results_dir={root}/results", f"models_dir={root}/models", f"engines_dir={root}/engines"]


def test_a_piece_target_on_a_fresh_machine_plans_its_model_its_engine_and_itself(tmp_path):
    target = f"{tmp_path}/results/h200-vllm/raw/rungs~1048576-524288/{MODEL}/arm~mtp/k~3/c~1/server~2/manifest.json"
    out = snakemake("-n", "-p", "--configfile", str(H200), *scratch(tmp_path), "--", target)
    assert out.returncode == 0, out.stdout + out.stderr
    assert job_counts(out.stdout) == {"dummy_model": 1, "engine": 1, "piece": 1, "total": 3}
    command = next(line for line in out.stdout.splitlines() if " cell --study-json " in line)
    assert '"rungs": [524288, 1048576]' in command and '"repeats": [1, 1]' in command
    assert f"--out '{Path(target).parent}'" in command
    assert (
        f"{tmp_path}/results/h200-vllm/logs/cells/rungs~1048576-524288/{MODEL}/arm~mtp/k~3/c~1/server~2.log" in command
    )


def test_a_piece_outside_the_study_is_named(tmp_path):
    target = f"{tmp_path}/results/h200-vllm/raw/rung~2048/{MODEL}/arm~none/c~1/server~1/manifest.json"
    out = snakemake("-n", "--configfile", str(H200), *scratch(tmp_path), "--", target)
    assert out.returncode != 0
    assert "rung~2048: rungs [2048] are not among the protocol.rungs of study 'h200-vllm'" in out.stdout + out.stderr


def test_pieces_carried_in_build_nothing_and_are_measured_again_never(committed_raw):
    """On a machine that has the raw files and nothing else (no engine, no model), the study's whole run collects
    and tabulates them: no engine is built, no piece is run."""
    out = snakemake("-n", "--configfile", str(H200), *scratch(committed_raw))
    assert out.returncode == 0, out.stdout + out.stderr
    assert job_counts(out.stdout) == {"collect_pieces": 6, "step_table": 1, "study": 1, "all": 1, "total": 9}


def test_a_piece_that_is_there_outlives_its_engine_and_model_made_anew(committed_raw):
    """Where the engine and the model are there and newer than the pieces, or the engine is rebuilt, the pieces
    stand: their inputs are ancient."""
    root = committed_raw
    engine = root / "engines" / "vllm" / layout.MANIFEST_FILE
    engine.parent.mkdir(parents=True)
    engine.write_text("{}")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "wmtp-model.json"):
        (root / "models" / "qwen3.6-35b-a3b").mkdir(parents=True, exist_ok=True)
        (root / "models" / "qwen3.6-35b-a3b" / name).write_text("{}")
    pieces = [f"{root}/results/{line.removeprefix('results/')}" for line in targets(H200)]
    out = snakemake("-n", "--configfile", str(H200), *scratch(root), "--", *pieces)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Nothing to be done" in out.stdout + out.stderr
    out = snakemake("-n", "--forcerun", "engine", "--configfile", str(H200), *scratch(root), "--", *pieces)
    assert out.returncode == 0, out.stdout + out.stderr
    assert job_counts(out.stdout) == {"engine": 1, "total": 1}


def targets(study: Path, *selection: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "wmtp", "pieces", "--config", str(study), *selection],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.split()


def test_the_step_table_rule_remakes_the_committed_step_file_under_the_gpu_profile(committed_raw):
    """The GPU profile, without PuLP (as on the H200), collects each group of the committed pieces on its own and
    writes the step file under results/<study>/steps/: the committed step file, row for row."""
    step_file = committed_raw / "results" / STEP_FILE
    out = snakemake(
        "--workflow-profile", "profiles/h200", "--configfile", str(H200), *scratch(committed_raw), "--",
        str(step_file), block_pulp=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    for group in ("rung~131072", "rungs~1048576-524288", "rung~1048576", "rungs~1048576-524288-131072"):
        assert (committed_raw / "results" / "h200-vllm" / "tidy" / group / "requests.parquet").exists()
    made, committed = pd.read_csv(step_file), pd.read_csv(COMMITTED_STEPS)
    pd.testing.assert_frame_equal(made, committed, check_exact=False, rtol=1e-9)
    assert set(made["engine_version"]) == {"0.24.0"}


@pytest.mark.engine
@pytest.mark.slow
def test_a_piece_runs_on_the_cpu_engine_and_lands_where_the_layout_says(engine_python, tmp_path):
    """The embedded study listing one piece (mtp at 1,024 tokens): its run serves the cell over that rung alone into
    raw/rung~1024/<cell id>/, collect and step-table make the step file of it, and a second run has nothing to do."""
    from conftest import engines_dir

    raw = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    study = tmp_path / "pieces.yaml"
    study.write_text(yaml.safe_dump({**raw, "pieces": [{"rungs": [1024], "arms": ["mtp"]}]}))
    config = ["--config", f"results_dir={tmp_path}/results", f"models_dir={tmp_path}/models",
              f"engines_dir={engines_dir()}"]  # fmt: skip
    results = tmp_path / "results" / "embedded"
    step_file = layout.step_file(results, "tiny", "vllm-cpu")
    out = snakemake("-c2", "--configfile", str(study), *config, "--", str(step_file))
    assert out.returncode == 0, out.stdout + out.stderr
    jobs = job_counts(out.stdout + out.stderr)
    assert jobs["piece"] == 1 and jobs["collect_pieces"] == 1 and jobs["step_table"] == 1 and "engine" not in jobs
    manifest = layout.piece_dir(results, "rung~1024", "model~tiny/engine~vllm-cpu/arm~mtp/k~3/c~1") / "manifest.json"
    recorded = json.loads(manifest.read_text())
    assert recorded["identity"]["protocol"]["rungs"] == [1024] and recorded["identity"]["protocol"]["repeats"] == [5]
    steps = pd.read_csv(step_file)
    assert list(zip(steps["arm"], steps["context"], steps["n"], strict=True)) == [("mtp", 1024, 5)]
    assert steps["step_ms"].iloc[0] > 0 and steps["clock"].iloc[0] == "engine"
    again = snakemake("-n", "--configfile", str(study), *config, "--", str(step_file))
    assert "Nothing to be done" in again.stdout + again.stderr, again.stdout + again.stderr
