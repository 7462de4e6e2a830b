"""What a cell's measurements depend on, as one hash: change any of it and exactly that cell reruns.

A cell's identity is the cell itself, the protocol it sweeps (rungs, repeats, output length, workloads,
warm-up, sampling), its engine (the build's spec hash: packages, environment, serve args), its model
(the study's entry and a fingerprint of a local checkpoint's files) and its arm's own serve args, if any.
The rules hand the hash to the cell rule as a parameter, so Snakemake reruns a cell whose identity changed;
the cell checks it again against the study file it reads and records it in its manifest, and collect refuses
to mix protocols.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from wmtp.config import (
    COPY_CUE_TOKENS,
    COPY_LEAD_TOKENS,
    COPY_PASSAGE_TOKENS,
    COPY_TASK_PROMPTS,
    CWE_COMMON,
    CWE_COMMON_REPEATS,
    CWE_UNCOMMON_REPEATS,
    DRAFTING_ARMS,
    FWE_ALPHA,
    FWE_TOP,
    NIAH_KEYS,
    NIAH_QUERIES,
    RULER_TASK_PROMPTS,
    RULER_WORKLOADS,
    WINDOWED_ARMS,
    Cell,
    ConfigError,
    Piece,
    Study,
    architecture_file,
)
from wmtp.engines.build import spec_hash

# Settings that bound how long the pipeline waits, not what it measures.
NOT_MEASURED = ("health_timeout_s", "request_timeout_s")
# The protocol's list of concurrencies makes cells, one per value; each cell carries its own, so the list is not
# part of what any one cell measured (a cell job sees the study narrowed to its own concurrency).
PER_CELL = ("concurrency",)
# Files up to this size are hashed by content (configs, tokenizers); larger ones (weights) by name, size and time.
CONTENT_HASH_MAX_BYTES = 4 * 1024 * 1024


class IdentityMismatch(RuntimeError):
    pass


def protocol_identity(study: Study) -> dict[str, Any]:
    """The protocol's measured settings, and the copy task's and the question-answering tasks' shapes where the
    study runs them: their prompts are built by code, not read from the study file, so a change there must change
    the identity too."""
    protocol = study.protocol.model_dump(mode="json")
    identity = {key: value for key, value in sorted(protocol.items()) if key not in (*NOT_MEASURED, *PER_CELL)}
    if "copy" in protocol["workloads"]:
        identity["copy_task"] = {
            "lead_tokens": COPY_LEAD_TOKENS,
            "passage_tokens": COPY_PASSAGE_TOKENS,
            "cue_tokens": COPY_CUE_TOKENS,
            "prompts": COPY_TASK_PROMPTS,
        }
    if any(workload in RULER_WORKLOADS for workload in protocol["workloads"]):
        identity["ruler_tasks"] = {
            "niah_keys": NIAH_KEYS,
            "niah_queries": NIAH_QUERIES,
            "fwe_top": FWE_TOP,
            "fwe_alpha": FWE_ALPHA,
            "cwe_common": CWE_COMMON,
            "cwe_repeats": [CWE_COMMON_REPEATS, CWE_UNCOMMON_REPEATS],
            "prompts": RULER_TASK_PROMPTS,
        }
    return identity


def model_fingerprint(model_dir: Path) -> str:
    """Content hash of a checkpoint's small files plus the names, sizes and modification times of its large ones.

    Retrained weights of one architecture have the same size, so size alone would leave the cells that measured
    the old weights standing; the time costs a rerun when weights are copied without it, which is the safe side.
    """
    digest = hashlib.sha256()
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        stat = path.stat()
        digest.update(f"{path.relative_to(model_dir)}\0{stat.st_size}\0".encode())
        if stat.st_size <= CONTENT_HASH_MAX_BYTES:
            digest.update(path.read_bytes())
        else:
            digest.update(f"{stat.st_mtime_ns}\0".encode())
    return digest.hexdigest()[:16]


def cell_identity(study: Study, cell: Cell, base_dir: Path | str = ".") -> dict[str, Any]:
    model = study.model(cell.model)
    entry = model.model_dump(mode="json")
    if model.path:
        # A local checkpoint: its files are part of what is measured. Generated models are rule outputs
        # that Snakemake tracks itself, and their spec (generator, seed) is in the entry.
        path = Path(model.path)
        entry["files"] = model_fingerprint(path if path.is_absolute() else Path(base_dir) / path)
    elif model.generate == "dummy" and model.architecture:
        # The checkpoint is written from the architecture's facts file: an edit there changes what is measured.
        facts = architecture_file(model.architecture).read_bytes()
        entry["architecture_sha256"] = hashlib.sha256(facts).hexdigest()[:16]
    identity = {
        "cell": cell.model_dump(mode="json", exclude={"study"}),
        "protocol": protocol_identity(study),
        "engine": spec_hash(study.engine(cell.engine)),
        "model": entry,
    }
    arm_args = study.arm_args(cell)
    if arm_args:  # only where an arm has its own, so that the cells of every other study keep their identity
        identity["arm_args"] = arm_args
    return identity


def identity_hash(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def check_identity(expected_hash: str | None, identity: dict[str, Any]) -> None:
    """Refuse a cell whose study file no longer says what the workflow planned it with."""
    if expected_hash is not None and identity_hash(identity) != expected_hash:
        raise IdentityMismatch(
            f"the study file describes this cell as {identity_hash(identity)}, but the workflow planned it as "
            f"{expected_hash}: the study changed since the run started; run snakemake again"
        )


def cell_study(study: Study, cell: Cell) -> dict[str, Any]:
    """The study narrowed to one cell: its engine, model, arm setting and concurrency, and the protocol.

    This is what the cell rule hands its job, so that a change elsewhere in the study (another arm, another
    model) leaves the job's parameters, and so the cell, untouched.
    """
    raw = study.model_dump(mode="json", exclude_none=True)
    arm: dict[str, Any] = {"name": cell.arm}
    if cell.arm in DRAFTING_ARMS:
        arm["k"] = [cell.k]
    if cell.arm in WINDOWED_ARMS:
        arm.update(sink=[cell.sink], window=[cell.window])
    arm_args = study.arm_args(cell)
    if arm_args:
        arm["serve_args"] = arm_args
    raw.update(
        engines=[e for e in raw["engines"] if e["name"] == cell.engine],
        models=[m for m in raw["models"] if m["name"] == cell.model],
        arms=[arm],
        protocol={**raw["protocol"], "concurrency": [cell.concurrency]},
    )
    # Neither is part of what a cell measures: naming another piece, or another step file, reruns no cell.
    raw.pop("replica", None)
    raw.pop("pieces", None)
    return raw


def narrow_rungs(raw: dict[str, Any], rungs: Sequence[int]) -> dict[str, Any]:
    """A study (as :func:`cell_study` gives it) sweeping only these of its rungs, each with its own repeats.

    One server lifetime over every rung of a 1M-token study outlasts a run of limited length (a GPU machine held
    for minutes at a time); the same cell over one rung fits. Its protocol, so its identity, is its own: its raw files
    and its tidy tables stay apart from the whole cell's and from the other rungs'.
    """
    protocol = raw["protocol"]
    repeats = protocol["repeats"] if isinstance(protocol["repeats"], list) else [protocol["repeats"]] * len(rungs)
    by_rung = dict(zip(protocol["rungs"], repeats, strict=False))
    unknown = [r for r in rungs if r not in by_rung]
    if unknown or not rungs:
        known = ", ".join(map(str, protocol["rungs"]))
        raise ConfigError(f"config: protocol.rungs has no rung {unknown or rungs} to narrow to (its rungs: {known})")
    chosen = [r for r in protocol["rungs"] if r in rungs]
    return {**raw, "protocol": {**protocol, "rungs": chosen, "repeats": [by_rung[r] for r in chosen]}}


def piece_study(study: Study, piece: Piece) -> dict[str, Any]:
    """The study a piece's job is handed: its cell's (:func:`cell_study`), sweeping the piece's rungs alone."""
    return narrow_rungs(cell_study(study, piece.cell), piece.rungs)


def piece_identity(study: Study, piece: Piece, base_dir: Path | str = ".") -> dict[str, Any]:
    """What a piece measures, as its manifest records it: its cell's identity under its narrowed study."""
    # Validated without study_from_dict's warnings: the study they would repeat was validated (and warned of) whole.
    narrowed = Study.model_validate(piece_study(study, piece), context={"base_dir": Path(base_dir)})
    return cell_identity(narrowed, piece.cell, base_dir=base_dir)
