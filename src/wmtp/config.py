"""Typed study configuration, validation with messages that name the key, and matrix expansion.

A study file is checked twice: first against ``config/schemas/config.schema.yaml`` (shape and
types), then by the pydantic models below (cross-field rules such as "a context length must be
below the model's maximum length"). Both raise :class:`ConfigError` whose message starts with the
offending key, e.g. ``config: arms[2].k must be ≥ 1 for arm 'mtp' (got 0)``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from wmtp.layout import REPO_ROOT, CellIdError, CellKey, format_cell_id, parse_cell_id

SCHEMA_PATH = REPO_ROOT / "config" / "schemas" / "config.schema.yaml"

ARMS = ("none", "mtp", "wmtp", "wmtp-ring")
DRAFTING_ARMS = ("mtp", "wmtp", "wmtp-ring")
WINDOWED_ARMS = ("wmtp", "wmtp-ring")
ENGINE_KINDS = ("vllm", "sglang")
# What the protocol's ``workloads`` may name: plain code (the Spark study's) and the hard / low-acceptance copy task,
# whose prompt is a lead-in, a passage, filler, then the passage's first tokens as a cue.
WORKLOADS = ("code", "copy")
COPY_LEAD_TOKENS = 512
COPY_PASSAGE_TOKENS = 256
COPY_CUE_TOKENS = 32
# The shortest prompt a copy task fits in with its defaults: lead-in, passage, cue, separators and filler.
COPY_MIN_TOKENS = COPY_LEAD_TOKENS + COPY_PASSAGE_TOKENS + COPY_CUE_TOKENS + 64


class ConfigError(ValueError):
    """A study file that cannot be run; the message names the key and the value."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineSpec(_Strict):
    name: str
    kind: Literal["vllm", "sglang"]
    device: Literal["cpu", "cuda"] = "cuda"
    # Where the engine comes from: a venv the pipeline builds, an existing interpreter, or an image.
    source: Literal["venv", "python", "container"] = "venv"
    python_version: str = "3.11"
    packages: list[str] = Field(default_factory=list)
    pre_packages: list[str] = Field(default_factory=list)
    remove_packages: list[str] = Field(default_factory=list)
    # pip constraints file (transitive pins), relative to the repository root.
    constraints: str | None = None
    python: str | None = None
    image: str | None = None
    container_runtime: Literal["docker", "apptainer"] | None = None
    env: dict[str, str] = Field(default_factory=dict)
    serve_args: list[str] = Field(default_factory=list)


class ModelSpec(_Strict):
    name: str
    # Exactly one of: a local checkpoint directory, or a model that a rule generates: "tiny" (random
    # weights) or "trained" (the committed trained checkpoint, tests/fixtures/tiny-trained).
    path: str | None = None
    generate: Literal["tiny", "trained"] | None = None
    seed: int = 0
    hf_id: str | None = None
    max_model_len: int
    serve_args: list[str] = Field(default_factory=list)


class ArmSpec(_Strict):
    name: Literal["none", "mtp", "wmtp", "wmtp-ring"]
    k: list[int] = Field(default_factory=list)
    sink: list[int] = Field(default_factory=list)
    window: list[int] = Field(default_factory=list)


class ProtocolSpec(_Strict):
    rungs: list[int]
    repeats: list[int]
    output_tokens: int = 256
    concurrency: list[int] = Field(default_factory=lambda: [1])
    warmup_requests: int = 3
    warmup_prompt_tokens: int = 64
    warmup_output_tokens: int = 16
    temperature: float = 0.0
    health_timeout_s: float = 900.0
    request_timeout_s: float = 3600.0
    idle_baseline_s: float = 0.0
    # Every rung is measured once per workload: plain code, and the copy task (far-back passage).
    workloads: list[Literal["code", "copy"]] = Field(default_factory=lambda: ["code"])
    # Ask for token ids and top-2 logprobs of every generated token (for equality tests; adds overhead).
    record_tokens: bool = False


class ReplicaSettings(_Strict):
    """The GPU cost-side replica's sweep (rules/replica.smk); every default lives here."""

    models: list[str] = Field(
        default_factory=lambda: [
            "config/models/qwen3.6-35b-a3b.json",
            "config/models/qwen3.5-122b-a10b.json",
            "config/models/nemotron-3-super-120b-a12b.json",
            "config/models/qwen3-next-80b-a3b.json",
        ]
    )
    contexts: str = "2k,32k,128k,256k,512k,1m"
    ks: str = "1,3,5"
    # S and W of the windowed draft: the paper-1m study's (SGLang's default window).
    sink: int = 64
    window: int = 4032
    reps: int = 30
    label: str = "h200"
    # Tidy this folder of replica_*.csv (e.g. measurements/h200) instead of running the sweep.
    raw: str | None = None
    # bytes/s for the prediction; None: the copy bandwidth measured in the same run.
    bandwidth: float | None = None


class Study(_Strict):
    study: str
    results_dir: str = "results"
    engines_dir: str = "results/engines"
    models_dir: str = "results/models"
    replica: ReplicaSettings = Field(default_factory=ReplicaSettings)
    engines: list[EngineSpec]
    models: list[ModelSpec]
    arms: list[ArmSpec]
    protocol: ProtocolSpec

    def engine(self, name: str) -> EngineSpec:
        return next(e for e in self.engines if e.name == name)

    def model(self, name: str) -> ModelSpec:
        return next(m for m in self.models if m.name == name)

    def model_dir(self, name: str) -> Path:
        """Where the checkpoint of a model lives (generated models live under models_dir)."""
        spec = self.model(name)
        if spec.generate:
            return Path(self.models_dir) / spec.name
        return Path(spec.path or "")

    def cells(self) -> list[Cell]:
        return list(expand_cells(self))

    def config_hash(self) -> str:
        payload = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


class Cell(_Strict):
    """One server lifetime: (study, model, engine, arm, k, S, W, concurrency)."""

    study: str
    model: str
    engine: str
    arm: str
    k: int = 0
    sink: int | None = None
    window: int | None = None
    concurrency: int = 1

    @property
    def cell_id(self) -> str:
        key = CellKey(
            model=self.model,
            engine=self.engine,
            arm=self.arm,
            k=self.k,
            sink=self.sink,
            window=self.window,
            concurrency=self.concurrency,
        )
        return format_cell_id(key, drafting=self.arm in DRAFTING_ARMS, windowed=self.arm in WINDOWED_ARMS)

    @property
    def ring(self) -> bool:
        return self.arm == "wmtp-ring"

    @classmethod
    def from_id(cls, study: str, cell_id: str) -> Cell:
        try:
            key = parse_cell_id(cell_id)
        except CellIdError as err:
            raise ConfigError(str(err)) from None
        return cls(
            study=study,
            model=key.model,
            engine=key.engine,
            arm=key.arm,
            k=key.k,
            sink=key.sink,
            window=key.window,
            concurrency=key.concurrency,
        )


def expand_cells(study: Study) -> Iterator[Cell]:
    """The matrix: models × engines × arms × k × S × W × concurrency, in a stable order."""
    for model in study.models:
        for engine in study.engines:
            for arm in study.arms:
                ks = arm.k if arm.name in DRAFTING_ARMS else [0]
                sinks: list[int | None] = list(arm.sink) if arm.name in WINDOWED_ARMS else [None]
                windows: list[int | None] = list(arm.window) if arm.name in WINDOWED_ARMS else [None]
                for k in ks:
                    for sink in sinks:
                        for window in windows:
                            for concurrency in study.protocol.concurrency:
                                yield Cell(
                                    study=study.study,
                                    model=model.name,
                                    engine=engine.name,
                                    arm=arm.name,
                                    k=k,
                                    sink=sink,
                                    window=window,
                                    concurrency=concurrency,
                                )


def _path_of(error_path: Any) -> str:
    out = "config"
    for item in error_path:
        out += f"[{item}]" if isinstance(item, int) else f".{item}"
    return out


def _check_schema(raw: Mapping[str, Any]) -> None:
    import jsonschema

    schema = yaml.safe_load(SCHEMA_PATH.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(raw), key=lambda e: list(e.absolute_path))
    if errors:
        first = errors[0]
        raise ConfigError(f"{_path_of(first.absolute_path)}: {first.message}")


def _check_models(models: list[Mapping[str, Any]], base_dir: Path) -> None:
    seen: set[str] = set()
    for i, model in enumerate(models):
        if model["name"] in seen:
            raise ConfigError(
                f"config: models[{i}].name {model['name']!r} is used by two models; model names must be unique"
            )
        seen.add(model["name"])
        has_path, has_gen = model.get("path") is not None, model.get("generate") is not None
        if has_path == has_gen:
            raise ConfigError(
                f"config: models[{i}] needs exactly one of 'path' or 'generate' "
                f"(got path={model.get('path')!r}, generate={model.get('generate')!r})"
            )
        if has_path:
            path = Path(model["path"])
            resolved = path if path.is_absolute() else base_dir / path
            if not resolved.is_dir():
                raise ConfigError(
                    f"config: models[{i}].path {model['path']!r} does not exist "
                    f"(looked in {resolved}); download the checkpoint there or fix the path"
                )


def _check_engines(engines: list[Mapping[str, Any]]) -> None:
    engine_names = [e["name"] for e in engines]
    if len(set(engine_names)) != len(engine_names):
        raise ConfigError(f"config: engines: two engines share a name ({engine_names})")
    for i, engine in enumerate(engines):
        source = engine.get("source", "venv")
        if source == "venv" and not engine.get("packages"):
            raise ConfigError(
                f"config: engines[{i}].packages must list the pinned engine package "
                f"for source 'venv' (engine {engine['name']!r})"
            )
        constraints = engine.get("constraints")
        if constraints and not (REPO_ROOT / constraints).is_file():
            raise ConfigError(f"config: engines[{i}].constraints {constraints!r} does not exist under {REPO_ROOT}")
        if source == "python" and not engine.get("python"):
            raise ConfigError(f"config: engines[{i}].python must name an interpreter for source 'python'")
        if source == "container" and not engine.get("image"):
            raise ConfigError(f"config: engines[{i}].image must name an image for source 'container'")


def _check_arm(i: int, arm: Mapping[str, Any]) -> None:
    name = arm["name"]
    if name in DRAFTING_ARMS:
        ks = arm.get("k") or []
        if not ks:
            raise ConfigError(f"config: arms[{i}].k must list at least one draft depth for arm {name!r}")
        for j, k in enumerate(ks):
            if k < 1:
                raise ConfigError(f"config: arms[{i}].k[{j}] must be ≥ 1 for arm {name!r} (got {k})")
    if name not in WINDOWED_ARMS:
        if arm.get("sink") or arm.get("window"):
            raise ConfigError(f"config: arms[{i}]: sink/window only apply to windowed arms, not {name!r}")
        return
    for key in ("sink", "window"):
        if not arm.get(key):
            raise ConfigError(f"config: arms[{i}].{key} must be given for windowed arm {name!r}")
    for key, least in (("sink", 0), ("window", 1)):
        for j, value in enumerate(arm[key]):
            if value < least:
                raise ConfigError(f"config: arms[{i}].{key}[{j}] must be ≥ {least} (got {value})")


def _check_protocol(protocol: Mapping[str, Any], models: list[Mapping[str, Any]]) -> None:
    rungs = protocol["rungs"]
    repeats = protocol["repeats"]
    if isinstance(repeats, list) and len(repeats) != len(rungs):
        raise ConfigError(
            f"config: protocol.repeats has {len(repeats)} entries but protocol.rungs has "
            f"{len(rungs)}; give one per rung or a single number"
        )
    for j, rep in enumerate(repeats if isinstance(repeats, list) else [repeats]):
        if rep < 1:
            key = f"protocol.repeats[{j}]" if isinstance(repeats, list) else "protocol.repeats"
            raise ConfigError(f"config: {key} must be ≥ 1 (got {rep})")
    out_tokens = protocol.get("output_tokens", 256)
    workloads = protocol.get("workloads", ["code"])
    for j, rung in enumerate(rungs):
        if rung <= 0:
            raise ConfigError(f"config: protocol.rungs[{j}] must be > 0 (got {rung})")
        for i, model in enumerate(models):
            if rung + out_tokens > model["max_model_len"]:
                raise ConfigError(
                    f"config: protocol.rungs[{j}] = {rung} plus {out_tokens} output tokens does not fit "
                    f"below models[{i}].max_model_len = {model['max_model_len']} (model {model['name']!r})"
                )
    for j, rung in enumerate(rungs):
        if "copy" in workloads and rung < COPY_MIN_TOKENS:
            raise ConfigError(
                f"config: protocol.rungs[{j}] = {rung} is too short for the copy workload (a {COPY_LEAD_TOKENS}-"
                f"token lead-in, a {COPY_PASSAGE_TOKENS}-token passage and its cue need ≥ {COPY_MIN_TOKENS} "
                f"tokens); raise the rung or drop 'copy' from protocol.workloads"
            )


def _semantic_checks(raw: Mapping[str, Any], base_dir: Path) -> None:
    _check_models(raw["models"], base_dir)
    _check_engines(raw["engines"])
    for i, arm in enumerate(raw["arms"]):
        _check_arm(i, arm)
    _check_protocol(raw["protocol"], raw["models"])


def study_from_dict(raw: Mapping[str, Any], base_dir: Path | str = ".") -> Study:
    """Validate a study mapping (as Snakemake's ``config``) and return it typed."""
    raw = dict(raw)
    _check_schema(raw)
    _semantic_checks(raw, Path(base_dir))
    protocol = dict(raw["protocol"])
    if not isinstance(protocol["repeats"], list):
        protocol["repeats"] = [protocol["repeats"]] * len(protocol["rungs"])
    raw["protocol"] = protocol
    return Study.model_validate(raw)


def load_study(path: Path | str, overrides: Mapping[str, Any] | None = None, base_dir: Path | str = ".") -> Study:
    raw = yaml.safe_load(Path(path).read_text())
    if not isinstance(raw, dict):
        raise ConfigError(f"config: {path} does not hold a mapping")
    raw.update(overrides or {})
    return study_from_dict(raw, base_dir)
