# Load and validate the study before anything runs; path helpers shared by every rule file.
import json
import re
import shlex
import sys
from pathlib import Path

from snakemake.settings.types import DeploymentMethod

from wmtp import layout
from wmtp.config import ConfigError, architecture_file, read_study_file, resolved_study_json, study_from_dict
from wmtp.model.hub import DOWNLOAD_MANIFEST
from wmtp.measure.identity import cell_identity, cell_study, identity_hash
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


def all_targets():
    """The report and everything it is made from that a person reads: Snakemake makes an intermediate file again
    only when something asks for it, so the tables are targets too (removed, a plain run makes them again)."""
    return [layout.report_file(RESULTS), RESOLVED_CONFIG, *tidy_tables(), *derived_tables()]
