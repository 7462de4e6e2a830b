"""The on-disk contract: where a study's files live, what they are called, and how a cell is named.

Every stage reads and writes through these names, and so do the rules (``rules/common.smk``): a file name
or the cell id format changes here or nowhere. The tree of one study::

    <results_dir>/<study>/
        study.json                  the validated study, as the ``wmtp`` command reads it
        raw/<cell id>/              one cell: RAW_SUCCESS_FILES, or FAILURE_FILE (+ SERVER_FAILED_LOG)
        raw/<group>/<cell id>/      one piece of a cell (a study that declares pieces): the same files
        tidy/<table>.parquet        TIDY_TABLES, derived from every complete cell
        tidy/<group>/<table>.parquet  the same tables of one group of pieces
        steps/<model>~<engine>.csv  the step file of the pieces of one model on one engine
        derived/<table>.parquet     DERIVED_TABLES: the paired comparisons, the excluded requests, the outputs judged
        report/index.html           the rendered report
        logs/                       one log per job
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, SerializerFunctionWrapHandler, model_serializer

REPO_ROOT = Path(__file__).resolve().parents[2]
# The committed trained tiny hybrid MTP checkpoint: the embedded study's model and the CPU engine's self-check. It
# ships inside the package (package data), so an installed wmtp finds it as a clone does.
TRAINED_CHECKPOINT = Path(__file__).resolve().parent / "model" / "tiny-trained"

STUDY_FILE = "study.json"
RAW_DIR = "raw"
TIDY_DIR = "tidy"
DERIVED_DIR = "derived"
REPORT_DIR = "report"
LOGS_DIR = "logs"
REPORT_FILE = "index.html"

REQUESTS_FILE = "requests.parquet"
COUNTERS_FILE = "counters.parquet"
ENERGY_FILE = "energy.parquet"
POWER_FILE = "power.parquet"
SERVER_LOG = "server.log"
MANIFEST_FILE = "manifest.json"
# A cell is complete when all of these exist; the manifest is moved into place last.
RAW_SUCCESS_FILES = (REQUESTS_FILE, COUNTERS_FILE, ENERGY_FILE, POWER_FILE, SERVER_LOG, MANIFEST_FILE)
# A profiling study's cell also leaves the engine's traces here, one file per traced request (gzip'd JSON).
PROFILE_DIR = "profile"
TRACES_FILE = "traces.csv"
LOSSLESS_FILE = "lossless.csv"
SCHEDULER_STEPS_FILE = "scheduler_steps.csv"
FAILURE_FILE = "failure.json"
SERVER_FAILED_LOG = "server.failed.log"

TIDY_TABLES = ("requests", "rungs", "positions", "admission")
# The ring's admission proof, one per (model, engine): raw/admission/<model>~<engine>.json.
ADMISSION_DIR = "admission"
DERIVED_TABLES = ("answer", "excluded", "lossless")

# Cell ids: "model~M/engine~E/arm~A[/k~K][/s~S/w~W]/c~C[/server~N]". k appears for drafting arms, s and w for
# windowed ones, so an id names exactly the settings that matter to its arm; server N of a study that starts
# each configuration's server more than once (protocol.servers), so that their spread can be measured.
CELL_ID_PATTERN = r"model~[^/]+/engine~[^/]+/arm~[^/]+(/k~\d+)?(/s~\d+/w~\d+)?/c~\d+(/server~\d+)?"
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_CELL_ID = re.compile(CELL_ID_PATTERN)
_ID_KEYS = {
    "model": "model",
    "engine": "engine",
    "arm": "arm",
    "k": "k",
    "s": "sink",
    "w": "window",
    "c": "concurrency",
    "server": "server",
}


class CellIdError(ValueError):
    pass


class Draft(BaseModel):
    """What drafts in a cell, as its id names it: the arm, its draft depth ``k``, and the windowed draft's sink
    ``sink`` (S) and window ``window`` (W). ``k`` is 0 and ``sink``/``window`` are None where the arm has none.

    A server start is asked for exactly this (``wmtp.engines.ServeRequest.draft``), so a cell and its server
    cannot disagree on what it drafts."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    arm: str
    k: int = 0
    sink: int | None = None
    window: int | None = None


class CellKey(Draft):
    """What a cell id encodes: the draft, and the model, engine and concurrency it runs at."""

    model: str
    engine: str
    concurrency: int = 1
    # Which of the configuration's servers (1, 2, …); None where the study starts each one once.
    server: int | None = None

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Left out where the study starts each configuration once, so those cells keep their identities.
        data = handler(self)
        if data.get("server") is None:
            data.pop("server", None)
        return data


def format_cell_id(key: CellKey, drafting: bool, windowed: bool) -> str:
    parts = [f"model~{key.model}", f"engine~{key.engine}", f"arm~{key.arm}"]
    if drafting:
        parts.append(f"k~{key.k}")
    if windowed:
        parts += [f"s~{key.sink}", f"w~{key.window}"]
    parts.append(f"c~{key.concurrency}")
    if key.server is not None:
        parts.append(f"server~{key.server}")
    return "/".join(parts)


def parse_cell_id(cell_id: str) -> CellKey:
    """The inverse of :func:`format_cell_id`; refuses anything the pattern does not match."""
    text = cell_id.strip("/")
    if not _CELL_ID.fullmatch(text):
        raise CellIdError(f"cell id {cell_id!r} is not of the form {CELL_ID_PATTERN}")
    fields: dict[str, str] = {}
    for part in text.split("/"):
        key, _, value = part.partition("~")
        fields[_ID_KEYS[key]] = value
    # The pattern admits only digits where a number goes: read them as numbers.
    return CellKey.model_validate(fields, strict=False)


def study_dir(results_dir: Path | str, study: str) -> Path:
    return Path(results_dir) / study


def study_file(results: Path) -> Path:
    return results / STUDY_FILE


def cell_dir(results: Path, cell_id: str) -> Path:
    return results / RAW_DIR / cell_id


# A cell job's log, under the study's logs: the cell rule writes it, `wmtp progress` reads it.
CELL_LOGS_DIR = "cells"


def cell_log(results: Path, cell_id: str) -> Path:
    return results / LOGS_DIR / CELL_LOGS_DIR / f"{cell_id}.log"


def raw_files(results: Path, cell_id: str) -> dict[str, Path]:
    """Every file a complete cell leaves, by name."""
    return {name: cell_dir(results, cell_id) / name for name in RAW_SUCCESS_FILES}


PARQUET_MAGIC = b"PAR1"
# What collect reads of a cell.
COLLECTED_FILES = (MANIFEST_FILE, REQUESTS_FILE, COUNTERS_FILE)
# Where a damaged cell's files are set aside (inside its folder), and the record of each time that happened.
DAMAGED_PREFIX = "damaged-"
DAMAGED_DIR = "damaged"


def damaged_files(cell: Path) -> dict[str, str]:
    """The raw files of a complete cell that cannot be what the cell wrote, with why (empty: intact, or a cell
    that never completed). Cheap enough to run over every cell whenever the workflow is read: it checks that each
    file is there, that a parquet file starts and ends with its magic bytes, and that the manifest is JSON."""
    if not (cell / MANIFEST_FILE).exists():
        return {}
    found: dict[str, str] = {}
    # The server's log is kept for people, not read by any stage: only the tables and the manifest are checked, and
    # the tables collect reads must be there.
    for name in (n for n in RAW_SUCCESS_FILES if n != SERVER_LOG):
        path = cell / name
        if not path.is_file():
            if name in COLLECTED_FILES:
                found[name] = "missing"
        elif name.endswith(".parquet"):
            with path.open("rb") as f:
                head = f.read(4)
                size = f.seek(0, 2)
                f.seek(max(size - 4, 0))
                tail = f.read(4)
            if size < 12 or head != PARQUET_MAGIC or tail != PARQUET_MAGIC:
                found[name] = f"not a whole parquet file ({size} bytes)"
    try:
        json.loads((cell / MANIFEST_FILE).read_text())
    except (OSError, ValueError) as err:
        found[MANIFEST_FILE] = f"not JSON ({err})"
    return found


def damage_digest(cell: Path, damaged: dict[str, str]) -> str:
    """Names one damage of a cell's files (their names, sizes and times): the same damage, the same name."""
    digest = hashlib.sha256()
    for name in sorted(damaged):
        path = cell / name
        stat = path.stat() if path.exists() else None
        digest.update(f"{name}:{stat.st_size if stat else -1}:{stat.st_mtime_ns if stat else -1};".encode())
    return digest.hexdigest()[:16]


def damage_record(results: Path, cell_id: str, digest: str) -> Path:
    """The record that a damaged cell's files were set aside (a log: raw files are never rewritten)."""
    return results / LOGS_DIR / DAMAGED_DIR / cell_id / f"{digest}.json"


# A piece: one server lifetime of a cell over some of its study's rungs, for a machine held minutes at a time, on
# which a cell over every rung (a 1M-token prefill takes minutes) does not fit. Its group names its rungs, longest
# first: ``rung~R`` for one, ``rungs~R1-R2-…`` for several. A piece's protocol holds its rungs, so pieces of
# different groups are never collected together.
PIECE_GROUP_PATTERN = r"rung~\d+|rungs~\d+(?:-\d+)+"
_PIECE_GROUP = re.compile(PIECE_GROUP_PATTERN)
STEPS_DIR = "steps"


def piece_group(rungs: Sequence[int]) -> str:
    """The group of the pieces over these rungs: the same rungs in any order, the same group."""
    ordered = sorted(set(rungs), reverse=True)
    if not ordered or len(ordered) != len(rungs) or any(r <= 0 for r in ordered):
        raise ValueError(f"a piece sweeps distinct positive rungs (got {list(rungs)})")
    if len(ordered) == 1:
        return f"rung~{ordered[0]}"
    return "rungs~" + "-".join(map(str, ordered))


def piece_rungs(group: str) -> tuple[int, ...]:
    """The inverse of :func:`piece_group`, longest rung first; refuses a group it would not have written."""
    if not _PIECE_GROUP.fullmatch(group):
        raise ValueError(f"piece group {group!r} is not of the form {PIECE_GROUP_PATTERN}")
    rungs = tuple(int(r) for r in group.partition("~")[2].split("-"))
    if piece_group(rungs) != group:
        raise ValueError(f"piece group {group!r} should name its rungs once each, longest first: {piece_group(rungs)}")
    return rungs


def piece_dir(results: Path, group: str, cell_id: str) -> Path:
    return results / RAW_DIR / group / cell_id


def piece_log(results: Path, group: str, cell_id: str) -> Path:
    return results / LOGS_DIR / CELL_LOGS_DIR / group / f"{cell_id}.log"


def piece_tidy_dir(results: Path, group: str) -> Path:
    return tidy_dir(results) / group


def piece_tidy_files(results: Path, group: str) -> list[Path]:
    return [piece_tidy_dir(results, group) / f"{name}.parquet" for name in TIDY_TABLES]


def step_file(results: Path, model: str, engine: str) -> Path:
    """The decode cycle per shape of one model's pieces on one engine (``wmtp step-table``)."""
    return results / STEPS_DIR / f"{model}~{engine}.csv"


def lossless_file(results: Path) -> Path:
    """A study's recorded answers, each judged against the same prompt's without a draft (``wmtp lossless``), where
    its cells are pieces; a study of whole cells has the table among its derived ones."""
    return results / LOSSLESS_FILE


def scheduler_steps_file(results: Path) -> Path:
    """A study's SGLang cells' iteration per rung from their servers' decode logs (``wmtp scheduler-steps``)."""
    return results / SCHEDULER_STEPS_FILE


def trace_file(results: Path) -> Path:
    """A profiling study's traced decode cycles, per request and component (``wmtp trace-table``)."""
    return results / TRACES_FILE


def admission_file(results: Path, model: str, engine: str) -> Path:
    return results / RAW_DIR / ADMISSION_DIR / f"{model}~{engine}.json"


def tidy_dir(results: Path) -> Path:
    return results / TIDY_DIR


def tidy_files(results: Path) -> list[Path]:
    return [tidy_dir(results) / f"{name}.parquet" for name in TIDY_TABLES]


def derived_dir(results: Path) -> Path:
    return results / DERIVED_DIR


def derived_files(results: Path) -> list[Path]:
    return [derived_dir(results) / f"{name}.parquet" for name in DERIVED_TABLES]


def report_file(results: Path) -> Path:
    return results / REPORT_DIR / REPORT_FILE
