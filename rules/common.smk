# Load and validate the study before anything runs; path helpers shared by every rule file.
import json
import re
import shlex
import sys
from pathlib import Path

from snakemake.settings.types import DeploymentMethod

from wmtp import layout
from wmtp.config import (
    ConfigError,
    Piece,
    architecture_file,
    expand_pieces,
    read_study_file,
    resolved_study_json,
    study_from_dict,
)
from wmtp.model.hub import DOWNLOAD_MANIFEST
from wmtp.measure.identity import cell_identity, cell_study, identity_hash, piece_identity, piece_study
from wmtp.engines.build import CHECKS_VERSION as ENGINE_CHECKS_VERSION
from wmtp.engines.build import build_hash, build_spec, engine_python, spec_hash
from wmtp.engines.capacity import check_weightless_fit


# The study files Snakemake merged into `config`: those named with --configfile (Snakemake's command line read them
# before this file runs, and stops there, without our message, on one it cannot parse: docs/design.md, "Reading a
# study file"), or the embedded default.
STUDY_FILES = [str(path) for path in workflow.configfiles]
try:
    # Read again by wmtp's own reader, which is stricter than Snakemake's (no Python tags, a mapping at the top) and
    # whose errors name the file, line and column.
    for study_file in STUDY_FILES:
        read_study_file(study_file)
    try:
        # The one validation of the study: the rules read STUDY (defaults filled in), never `config` as merged.
        STUDY = study_from_dict(config, base_dir=Path.cwd())
        check_weightless_fit(STUDY)
    except ConfigError as err:
        raise ConfigError(f"{', '.join(STUDY_FILES) or 'config'}: {err}") from None
except ConfigError as err:
    raise WorkflowError(str(err)) from None

# Under --sdm conda a rule must call the python of its conda environment (envs/*.yaml), which finds wmtp
# on PYTHONPATH; otherwise the interpreter that runs Snakemake (the project's venv) has everything.
if DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method:
    PY = f"env PYTHONPATH={shlex.quote(str(Path(workflow.basedir) / 'src'))} python"
else:
    PY = shlex.quote(sys.executable)
RESULTS = layout.study_dir(STUDY.results_dir, STUDY.study)
ENGINES = Path(STUDY.engines_dir)
MODELS = Path(STUDY.models_dir)
CELLS = {cell.cell_id: cell for cell in STUDY.cells()}

# The validated study, as the `wmtp` command reads it (Snakemake's --config overrides included).
LOGS = RESULTS / layout.LOGS_DIR
# Where a cell's raw files go; the {cell} wildcard stands for the cell id.
RAW_CELL = layout.cell_dir(RESULTS, "{cell}")
RESOLVED_CONFIG = layout.study_file(RESULTS)
# Rule `study` writes it, never the parse; a dry run or a second invocation must not change what a
# running workflow reads.
STUDY_JSON = resolved_study_json(STUDY)


wildcard_constraints:
    cell=layout.CELL_ID_PATTERN,
    group=layout.PIECE_GROUP_PATTERN,
    digest="[0-9a-f]{16}",
    engine=layout.NAME_PATTERN,
    model=layout.NAME_PATTERN,


def engine_manifest(engine_name):
    return ENGINES / engine_name / layout.MANIFEST_FILE


def engine_input(engine_name):
    """An engine as a job input. Not ancient(): Snakemake 9.27 drops the jobs downstream of an ancient() input whose
    producer reruns, and exits 0 having run only that producer. The engine's manifest changes only when its build
    spec or its self-check does, and then what it serves must be measured again."""
    return engine_manifest(engine_name)


def cell_identity_hash(cell_id):
    """Everything the cell's measurements depend on, as a hash: a change reruns exactly this cell."""
    return identity_hash(cell_identity(STUDY, CELLS[cell_id], base_dir=Path.cwd()))


def source_files(*packages):
    """The Python files of these wmtp packages: inputs of the rules that run them, so that a change to the code
    that computes a table or the report reruns it (Snakemake's code trigger sees only the shell command)."""
    src = Path(workflow.basedir) / "src" / "wmtp"
    return sorted(path for package in packages for path in (src / package).rglob("*.py"))


def cell_identities_json():
    """Every cell's identity hash, as collect checks the recorded ones against."""
    return json.dumps({cell_id: cell_identity_hash(cell_id) for cell_id in CELLS}, sort_keys=True)


def cell_study_json(cell_id):
    return json.dumps(cell_study(STUDY, CELLS[cell_id]), sort_keys=True)


def engine_hash(engine_name):
    """The engine's whole spec (serve arguments included), as a cell's identity holds it."""
    return spec_hash(STUDY.engine(engine_name))


def engine_build_hash(engine_name):
    """What the engine's environment was built from: the build a job checks it is given."""
    return build_hash(STUDY.engine(engine_name))


def engine_python_of(engine_name):
    return engine_python(STUDY.engine(engine_name), ENGINES / engine_name)


TRAINED_CHECKPOINT = layout.TRAINED_CHECKPOINT


def generated_names(kind):
    """A wildcard pattern matching only the models generated as ``kind`` (never matches if none)."""
    names = [m.name for m in STUDY.models if m.generate == kind]
    return "|".join(re.escape(n) for n in names) if names else "(?!)"


def tiny_builder_engine():
    # The builder needs torch and transformers: the first engine environment of the study has them.
    return STUDY.engines[0].name


# Checkpoints that rule `model` fetches from the Hub, by their path.
FETCHED = {m.path: m for m in STUDY.models if m.hf_id and m.path}

# Checkpoints served through a copy whose config carries the study's RoPE scaling (rule stretched_model).
STRETCHED = {m.name: m for m in STUDY.models if m.rope_scaling}


def checkpoint_files(model):
    """What a checkpoint on disk needs before it is read: a fetched one its download record, a local one nothing."""
    return [f"{model.path}/{DOWNLOAD_MANIFEST}"] if model.path in FETCHED else []


def model_files(model_name):
    """What a cell needs of its model: generated models and fetched checkpoints are rule outputs (a fetched
    one by its download record); other local ones must exist."""
    model = STUDY.model(model_name)
    if model.generate:
        return [MODELS / model_name / "config.json", MODELS / model_name / "tokenizer.json"]
    if model.rope_scaling:
        return [MODELS / model_name / "config.json"]
    return checkpoint_files(model)


def cell_dir(cell_id):
    return layout.cell_dir(RESULTS, cell_id)


# Complete cells whose raw files are damaged, read (never written) as the workflow is parsed: each gets a
# set_aside job that moves its files aside, and so is measured again by a plain run.
DAMAGED = {c: found for c in CELLS if (found := layout.damaged_files(cell_dir(c)))}


def set_aside_records(cell_id):
    """The records of this cell's damaged files set aside: every earlier one (so its input set stays the same), and
    the one its present damage needs."""
    records = sorted(layout.damage_record(RESULTS, cell_id, "x").parent.glob("*.json"))
    if cell_id in DAMAGED:
        records.append(layout.damage_record(RESULTS, cell_id, layout.damage_digest(cell_dir(cell_id), DAMAGED[cell_id])))
    return sorted(set(records))


def cell_manifests():
    return [cell_dir(cell_id) / layout.MANIFEST_FILE for cell_id in CELLS]


def admission_settings(model_name, engine_name):
    return json.dumps(STUDY.admission_settings(model_name, engine_name), sort_keys=True)


def admission_files():
    return [layout.admission_file(RESULTS, c.model, c.engine) for c in STUDY.admission_proofs()]


def tidy_tables():
    return layout.tidy_files(RESULTS)


def derived_tables():
    return layout.derived_files(RESULTS)


# The pieces the study lists (its key `pieces`), by group and cell id: what its step files are made of.
PIECES = {(piece.group, piece.cell.cell_id): piece for piece in expand_pieces(STUDY)}
# Where a piece's raw files go: the {group} wildcard names its rungs (layout.piece_group).
RAW_PIECE = layout.piece_dir(RESULTS, "{group}", "{cell}")


def piece_of(group, cell_id):
    """The piece a path names: any cell of the study over any of its rungs, listed in `pieces` or not (only the
    listed ones are collected into the step files)."""
    if cell_id not in CELLS:
        raise WorkflowError(f"{cell_id} is not a cell of study {STUDY.study!r} (wmtp check-config lists them)")
    try:
        rungs = layout.piece_rungs(group)
    except ValueError as err:
        raise WorkflowError(str(err)) from None
    unknown = sorted(set(rungs) - set(STUDY.protocol.rungs))
    if unknown:
        raise WorkflowError(f"{group}: rungs {unknown} are not among the protocol.rungs of study {STUDY.study!r}")
    return Piece(CELLS[cell_id], rungs)


def piece_inputs(wildcards):
    """The engine and model a piece's job reads. A piece that is there is never measured again (raw files are never
    rewritten), whatever remakes its engine or its model: where both are there its inputs are ancient(), so neither
    a newer file nor a job that remakes one reruns it, and the set of its inputs stays what Snakemake recorded when
    it ran; where they are not (a fresh machine, the raw files carried in), it has none, so nothing is built for it."""
    piece = piece_of(wildcards.group, wildcards.cell)
    engine, model = engine_input(piece.cell.engine), model_files(piece.cell.model)
    if not (layout.piece_dir(RESULTS, wildcards.group, wildcards.cell) / layout.MANIFEST_FILE).exists():
        return {"engine": engine, "model": model}
    if all(Path(f).exists() for f in (engine, *model)):
        return {"engine": ancient(engine), "model": [ancient(f) for f in model]}
    return {}


def piece_study_json(group, cell_id):
    return json.dumps(piece_study(STUDY, piece_of(group, cell_id)), sort_keys=True)


def piece_identity_hash(group, cell_id):
    return identity_hash(piece_identity(STUDY, piece_of(group, cell_id), base_dir=Path.cwd()))


def piece_groups():
    """The groups of the listed pieces, in the order the study lists them."""
    return list(dict.fromkeys(group for group, _ in PIECES))


def piece_manifests(group, model=None, engine=None):
    """The manifests of the listed pieces of a group (of one model on one engine, if named)."""
    manifests = [
        layout.piece_dir(RESULTS, g, cell_id) / layout.MANIFEST_FILE
        for (g, cell_id), piece in PIECES.items()
        if g == group and model in (None, piece.cell.model) and engine in (None, piece.cell.engine)
    ]
    if not manifests:
        raise WorkflowError(f"study {STUDY.study!r} lists no piece over {group} (its key `pieces`)")
    return manifests


def step_groups(model, engine):
    """The groups holding listed pieces of this model on this engine, in the order the study lists them."""
    return list(dict.fromkeys(g for (g, _), p in PIECES.items() if (p.cell.model, p.cell.engine) == (model, engine)))


def step_files():
    """One step file per model and engine of the listed pieces."""
    keys = sorted({(piece.cell.model, piece.cell.engine) for piece in PIECES.values()})
    return [layout.step_file(RESULTS, model, engine) for model, engine in keys]


# A profiling study's cells and pieces also leave their engine's traces (protocol.profile_iterations).
PROFILED = STUDY.protocol.profile_iterations > 0


def profile_output(raw):
    """The traces folder among a cell's or a piece's outputs, where the study profiles."""
    return {"profile": directory(raw / layout.PROFILE_DIR)} if PROFILED else {}


def traced_manifests():
    """The manifests of the cells, or of the listed pieces, whose traces the trace table reads."""
    if PIECES:
        return [m for group in piece_groups() for m in piece_manifests(group)]
    return cell_manifests()


def all_targets():
    """The report and everything it is made from that a person reads: Snakemake makes an intermediate file again
    only when something asks for it, so the tables are targets too (removed, a plain run makes them again). A study
    measured in pieces makes its step files and each group's tables instead: its cells are never whole, so it has
    no tables of whole cells for a report."""
    traces = [layout.trace_file(RESULTS)] if PROFILED else []
    scheduler = [layout.scheduler_steps_file(RESULTS)] if SGLANG_CELLS else []
    if PIECES:
        groups = [file for group in piece_groups() for file in layout.piece_tidy_files(RESULTS, group)]
        lossless = [layout.lossless_file(RESULTS)] if STUDY.protocol.record_tokens else []
        return [RESOLVED_CONFIG, *step_files(), *groups, *traces, *lossless, *scheduler]
    return [layout.report_file(RESULTS), RESOLVED_CONFIG, *tidy_tables(), *derived_tables(), *traces, *scheduler]


# Whether any cell runs on SGLang, whose scheduler logs its decode steps (rule scheduler_steps reads them).
SGLANG_CELLS = any(STUDY.engine(cell.engine).kind == "sglang" for cell in CELLS.values())


def measured_manifests():
    """Every manifest the study's measurements end in: its listed pieces', else its cells'."""
    if PIECES:
        return [layout.piece_dir(RESULTS, group, cell_id) / layout.MANIFEST_FILE for group, cell_id in PIECES]
    return cell_manifests()
