"""Raw cell files → tidy tables (requests, rungs, positions) with the Spark study's derived quantities."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from wmtp.analyze import analysis, costmodel
from wmtp.analyze.floor import step_floor_ms
from wmtp.layout import COUNTERS_FILE, MANIFEST_FILE, REQUESTS_FILE, damaged_files

log = logging.getLogger(__name__)

CELL_KEYS = ["study", "cell_id", "model", "engine", "arm", "k", "sink", "window", "concurrency"]
# Which server lifetime measured a row, and on which GPU: a cell id can be served again later, elsewhere.
SERVER_COLUMNS = ("server_started_at", "gpu_uuid")
# A cell's counters are snapshotted per (workload, rung); raw files from before workloads existed are code.
RUNG_KEYS = ["workload", "rung"]
DEFAULT_WORKLOAD = "code"


def _cell_keys(manifest: dict) -> dict:
    cell = manifest["cell"]
    return {
        "study": manifest["study"],
        "cell_id": manifest["cell_id"],
        "model": cell["model"],
        "engine": cell["engine"],
        "arm": cell["arm"],
        "k": int(cell.get("k") or 0),
        "sink": cell.get("sink"),
        "window": cell.get("window"),
        "concurrency": int(cell.get("concurrency") or 1),
        # The hash of everything the cell's numbers depend on (wmtp.measure.identity); None before it was recorded.
        "identity_hash": manifest.get("identity_hash"),
    }


# What a windowed draft really read, as its plugin reported it: the engine rounds S up to whole KV blocks and
# starts the window at a block boundary, so the requested S and W are not what the draft saw.
EFFECTIVE_WINDOW_COLUMNS = {
    "kv_block_size": "block_size",
    "read_sink_tokens": "sink_tokens",
    "read_window_min": "window_tokens_min",
    "read_window_max": "window_tokens_max",
    "cell_windowed_forwards": "windowed_forwards",  # the cell's server in total, on each of its rows
    "cell_hook_host_us_per_build": "hook_host_us_per_build",  # the plugin's own host time per draft build
    "cell_anchored_forwards": "anchored_forwards",  # later draft forwards that kept their cycle's window
}
# Where the plugin set each draft forward's window start (wmtp.plugin.stats.WINDOW_ANCHOR): "cycle" where it
# said so, "forward" for a plugin that reported a window but not this (it set one per forward), "" without one.
WINDOW_ANCHOR_COLUMN = "cell_window_anchor"
# What set the window on the device (wmtp.plugin.stats: "triton", the plugin's kernels, or "torch"); "torch" for a
# plugin that reported a window but not this, "" without one.
WINDOW_KERNELS_COLUMN = "cell_window_kernels"


def predicted_ring_reclaim(manifest: dict) -> float:
    """The cost model's share of a request's KV and state that a ring gives back, at the cell's max_model_len and
    its S and W; NaN for arms without a window, or a checkpoint the cost model cannot read."""
    cell, config = manifest["cell"], manifest.get("model_config")
    length = (manifest.get("kv_cache") or {}).get("max_model_len")
    if cell["arm"] not in analysis.WINDOWED_ARMS or not config or not length:
        return math.nan
    try:
        spec = costmodel.model_from_hf_config(config, weights=False)
    except (KeyError, TypeError, ValueError):
        return math.nan
    plain = costmodel.kv_memory(spec, int(length), sink=cell["sink"], window=cell["window"], ring=False).total
    ring = costmodel.kv_memory(spec, int(length), sink=cell["sink"], window=cell["window"], ring=True).total
    return 1.0 - ring / plain


def effective_window(manifest: dict) -> dict[str, float | str]:
    """The effective-window columns of a cell (NaN for arms without a window, or before the plugin reported)."""
    reported = manifest.get("wmtp_plugin") or {}
    values = {column: reported.get(key) for column, key in EFFECTIVE_WINDOW_COLUMNS.items()}
    out: dict[str, float | str] = {column: math.nan if value is None else value for column, value in values.items()}
    out[WINDOW_ANCHOR_COLUMN] = str(reported.get("window_anchor") or ("forward" if reported else ""))
    out[WINDOW_KERNELS_COLUMN] = str(reported.get("window_kernels") or ("torch" if reported else ""))
    return out


# A request whose decode window on the client differs from the engine's by more than this share is listed with
# both: its stream was held back (a late first chunk) or the client stalled.
CLOCK_TOLERANCE = 0.05
_CLOCK_COLUMNS = ("d_clock_requests", "d_clock_decode_s", "d_clock_generation_tokens")


def apply_engine_clock(frame: pd.DataFrame) -> None:
    """Time each request by the engine's own clock where the cell recorded it, the client's otherwise.

    The raw ``ttft_s`` and ``decode_s`` are the client's (first streamed chunk, last chunk) and are kept as
    ``client_ttft_s`` and ``client_decode_s``. Where the snapshots around a request counted exactly that request
    finishing with its tokens, ``decode_s`` becomes the engine's first-to-last-token time and ``ttft_s`` its queue
    plus prefill time; ``clock`` says which clock timed the row, ``clock_disagreement`` the client's decode window
    over the engine's, less 1 (negative: the first chunk came late and the client saw a shorter decode).
    """
    frame["client_ttft_s"] = frame["ttft_s"].astype(float)
    frame["client_decode_s"] = frame["decode_s"].astype(float)
    if all(column in frame.columns for column in _CLOCK_COLUMNS):
        wanted = (*_CLOCK_COLUMNS, "d_clock_queue_s", "d_clock_prefill_s")
        numbers = {c: pd.to_numeric(frame[c], errors="coerce") for c in wanted if c in frame.columns}
        own = (
            (numbers["d_clock_requests"] == 1)
            & (numbers["d_clock_generation_tokens"] == frame["completion_tokens"])
            & (numbers["d_clock_decode_s"] > 0)
        )
        engine_decode = numbers["d_clock_decode_s"].where(own)
        prefill = numbers.get("d_clock_prefill_s", pd.Series(math.nan, index=frame.index))
        queue = numbers.get("d_clock_queue_s", pd.Series(0.0, index=frame.index)).fillna(0.0)
        engine_ttft = (queue + prefill).where(own)
    else:
        own = pd.Series(False, index=frame.index)
        engine_decode = engine_ttft = pd.Series(math.nan, index=frame.index)
    frame["engine_decode_s"] = engine_decode
    frame["engine_ttft_s"] = engine_ttft
    frame["clock"] = ["engine" if is_own else "client" for is_own in own]
    frame["decode_s"] = engine_decode.where(own, frame["client_decode_s"])
    frame["ttft_s"] = engine_ttft.where(own & engine_ttft.notna(), frame["client_ttft_s"])
    frame["clock_disagreement"] = frame["client_decode_s"] / engine_decode - 1.0


# vLLM's attention options: the whole object (long or short flag, or one key at a time after a dot), and the one
# option with a flag of its own.
ATTENTION_FLAGS = ("--attention-config", "-ac")
ATTENTION_BACKEND_FLAG = "--attention-backend"


def attention_config(argv: list[str]) -> str:
    """The attention options the server's argv gave the engine, as 'key=value' pairs in key order ('' where it ran
    with its defaults): vLLM's ``--attention-config`` (or ``-ac``) as one JSON object (``'{...}'`` as the next word
    or after ``=``) or one key at a time (``--attention-config.key value``), and ``--attention-backend``, which sets
    the ``backend`` key. Two servers that differ here ran two engines, whatever else they share."""
    options: dict[str, object] = {}
    words = iter(argv)
    for word in words:
        flag, equals, value = word.partition("=")
        base, dot, key = flag.partition(".")
        if base not in ATTENTION_FLAGS and flag != ATTENTION_BACKEND_FLAG:
            continue
        if not equals:
            value = next(words, "")
        if flag == ATTENTION_BACKEND_FLAG:
            options["backend"] = value
        elif dot:
            options[key] = value
        else:
            parsed = json.loads(value)
            if not isinstance(parsed, dict):
                raise ValueError(f"{flag} {value!r} is not a JSON object")
            options.update(parsed)
    return ", ".join(f"{key}={_option_text(options[key])}" for key in sorted(options))


def _option_text(value: object) -> str:
    return json.dumps(value) if isinstance(value, (dict, list, bool)) or value is None else str(value)


@dataclass(frozen=True)
class CellCost:
    """What the cost model needs of a cell to give its floors: the GPU's measured bandwidth (bytes/s), the
    checkpoint's facts (None where the cost model does not read it), and the cycle's arm (a ring reads as wmtp
    does), k, S and W."""

    bandwidth: float
    spec: costmodel.ModelSpec | None
    arm: str
    k: int
    sink: int
    window: int


def cell_cost(manifest: dict) -> CellCost | None:
    """The cell's cost-model inputs; None where the device's bandwidth is unknown (a CPU) or the manifest holds no
    checkpoint config."""
    cell, config = manifest["cell"], manifest.get("model_config")
    bandwidth = costmodel.device_bandwidth((manifest.get("gpu_at_start") or {}).get("gpu_name"))
    if bandwidth is None or not config:
        return None
    try:
        spec = costmodel.model_from_hf_config(config)
    except (KeyError, TypeError, ValueError):
        spec = None
    arm = cell["arm"] if cell["arm"] in ("none", "mtp") else "wmtp"
    sink, window = int(cell.get("sink") or 0), int(cell.get("window") or 0)
    return CellCost(bandwidth, spec, arm, int(cell.get("k") or 0), sink, window)


def byte_floor_ms(manifest: dict, prompt_tokens: int) -> tuple[float, float]:
    """A cycle's byte floor (ms) for one request of the cell, and the bandwidth (bytes/s) it assumes.

    The bytes are the cost model's for the cell's checkpoint (touched weights, KV, recurrent state, the draft's
    forwards) at the request's prompt length, read at the GPU's measured bandwidth. NaN where the device's
    bandwidth is unknown (a CPU) or the checkpoint is not one the cost model reads.
    """
    cost = cell_cost(manifest)
    if cost is None:
        return math.nan, math.nan
    if cost.spec is None:
        return math.nan, cost.bandwidth
    floor = step_floor_ms(
        cost.spec, int(prompt_tokens), cost.k, cost.arm, cost.bandwidth, sink=cost.sink, window=cost.window
    )
    return floor["step"], cost.bandwidth


def request_table(cell_dir: Path, deltas: pd.DataFrame) -> pd.DataFrame:
    """The cell's requests, timed and screened; ``deltas`` are its counters per rung (:func:`counter_deltas`)."""
    manifest = json.loads((cell_dir / MANIFEST_FILE).read_text())
    frame = pd.read_parquet(cell_dir / REQUESTS_FILE)
    frame = frame[~frame["warmup"]].copy()
    if "workload" not in frame.columns:
        frame["workload"] = DEFAULT_WORKLOAD
    for key, value in _cell_keys(manifest).items():
        frame[key] = value
    apply_engine_clock(frame)
    frame["decode_tok_s"] = [
        analysis.decode_rate(c, d) for c, d in zip(frame["completion_tokens"], frame["decode_s"], strict=True)
    ]
    frame["prefill_tok_s"] = [
        analysis.prefill_tok_s(p, t) for p, t in zip(frame["prompt_tokens"], frame["ttft_s"], strict=True)
    ]
    # NVML measured the energy over the client's decode window; its mean power over the engine's decode time is
    # the decode's energy when the two windows differ (a first chunk held back shortens the client's).
    frame["decode_energy_j"] = frame["energy_decode_j"].astype(float) * frame["decode_s"] / frame["client_decode_s"]
    frame["tok_per_j"] = [
        analysis.tok_per_j(c - 1, None if pd.isna(e) else float(e))
        for c, e in zip(frame["completion_tokens"], frame["decode_energy_j"], strict=True)
    ]
    floors = [byte_floor_ms(manifest, int(p)) for p in frame["prompt_tokens"]]
    gpu = manifest.get("gpu_at_start") or {}
    frame["gpu_name"] = gpu.get("gpu_name")
    # Which server lifetime and which GPU: one cell id may be served again later, on another machine.
    frame["server_started_at"] = manifest.get("started_at")
    frame["gpu_uuid"] = gpu.get("uuid")
    # Which code measured: the checkout's revision and the plugin's source as the engine's environment held it.
    frame["wmtp_revision"] = manifest.get("wmtp_revision")
    engine_versions = (manifest.get("engine") or {}).get("versions") or {}
    frame["plugin_sha256"] = engine_versions.get("wmtp_plugin_sha256") or manifest.get("wmtp_plugin_sha256")
    frame["attention_config"] = attention_config(list(manifest.get("argv") or []))
    frame["floor_ms"] = [f for f, _ in floors]
    frame["floor_bandwidth"] = [b for _, b in floors]
    frame["power_status"] = manifest.get("power_status", "unavailable")
    capacity = manifest.get("kv_cache") or {}
    frame["kv_cache_tokens"] = capacity.get("kv_cache_tokens")
    frame["max_concurrency"] = capacity.get("max_concurrency")
    for column, value in effective_window(manifest).items():
        frame[column] = value
    frame["predicted_ring_reclaim"] = predicted_ring_reclaim(manifest)
    _per_request_acceptance(frame)
    return screen_requests(frame, rung_tokens_per_verify(frame, deltas))


# A decode step cannot run this many times faster than the engine's own median step at the cell's shortest
# rung: a faster "window" means the tokens arrived in one burst (a buffered stream), not that they decoded.
STEP_FLOOR_FACTOR = 5.0


def _per_request_acceptance(frame: pd.DataFrame) -> None:
    """tokPerVerify and acceptance per request, where the cell snapshotted counters around each request."""
    if "d_drafts" not in frame.columns:
        return
    drafting = frame["arm"] != "none"
    frame["req_tok_per_verify"] = [
        analysis.tok_per_verify(a, d) if is_drafting else 1.0
        for a, d, is_drafting in zip(frame["d_accepted"], frame["d_drafts"], drafting, strict=True)
    ]
    frame["req_acceptance"] = [
        analysis.acceptance_rate(a, t) if is_drafting else math.nan
        for a, t, is_drafting in zip(frame["d_accepted"], frame["d_draft_tokens"], drafting, strict=True)
    ]


def counter_impossibility(counters: dict[str, float], k: float | None = None) -> str:
    """Why a request's spec-decode counter deltas cannot all be true, or '' when they can.

    ``counters`` maps the tidy column (``d_drafts``, ``d_draft_tokens``, ``d_accepted``, ``d_accepted_pos_<i>``)
    to its delta over the request; NaN means not recorded. A draft proposes at most ``k`` tokens and the target
    accepts at most what was drafted, at every position at most once per draft.
    """
    known = {name: value for name, value in counters.items() if not math.isnan(value)}
    if any(value < 0 for value in known.values()):
        return "a spec-decode counter went backwards"
    drafts, tokens, accepted = (known.get(name) for name in ("d_drafts", "d_draft_tokens", "d_accepted"))
    if accepted is not None and tokens is not None and accepted > tokens:
        return f"accepted {accepted:g} draft tokens of {tokens:g} drafted"
    if tokens is not None and drafts is not None and k is not None and not math.isnan(k) and tokens > k * drafts:
        return f"{tokens:g} draft tokens in {drafts:g} drafts of at most k = {k:g}"
    if drafts is not None:
        for name, value in sorted(known.items()):
            if name.startswith("d_accepted_pos_") and value > drafts:
                position = name.removeprefix("d_accepted_pos_")
                return f"accepted at draft position {position} {value:g} times in {drafts:g} drafts"
    return ""


def exclusion_reason(
    completion_tokens: int,
    decode_s: float,
    step_floor_s: float,
    counters: dict[str, float] | None = None,
    k: float | None = None,
    cycle_ms: float = math.nan,
    byte_floor: float = math.nan,
) -> str:
    """Why a request's numbers are physically impossible, or '' when they are not.

    ``cycle_ms`` is the request's verify cycle and ``byte_floor`` the least time its bytes take at the device's
    bandwidth (NaN where unknown): a cycle below it did not happen as timed.
    """
    if completion_tokens < 2:
        return "no decode window (fewer than 2 tokens)"
    if not decode_s > 0:
        return "zero-length decode window"
    if decode_s / (completion_tokens - 1) < step_floor_s:
        return f"decode step {1e3 * decode_s / (completion_tokens - 1):.3g} ms < floor {1e3 * step_floor_s:.3g} ms"
    if cycle_ms < byte_floor:
        return f"cycle {cycle_ms:.3g} ms below its byte floor {byte_floor:.3g} ms"
    return counter_impossibility(counters or {}, k)


def request_cycle_ms(frame: pd.DataFrame, rung_tok_per_verify: pd.Series) -> pd.Series:
    """Each request's verify cycle (ms): its decode window over its cycles, at its own tokens per verify where the
    cell counted per request, else at its rung's (:func:`wmtp.analyze.analysis.request_cycle_ms_of`)."""
    own = (
        pd.to_numeric(frame["req_tok_per_verify"], errors="coerce")
        if "req_tok_per_verify" in frame.columns
        else math.nan
    )
    rates = [
        analysis.decode_rate(int(c), float(d))
        for c, d in zip(frame["completion_tokens"], frame["decode_s"], strict=True)
    ]
    return pd.Series(analysis.request_cycle_ms_of(own, rung_tok_per_verify, rates), index=frame.index, dtype=float)


def screen_requests(frame: pd.DataFrame, rung_tok_per_verify: pd.Series | None = None) -> pd.DataFrame:
    """Flags impossible requests (``excluded``, ``exclusion``) and blanks their derived rates.

    The floor is the engine's own median decode step at the cell's shortest rung (every workload) divided by
    STEP_FLOOR_FACTOR; where the table has a byte floor per request (``floor_ms``), a cycle below it is screened
    too. ``rung_tok_per_verify`` is each request's rung's pooled count (:func:`rung_tokens_per_verify`); without
    it only the arm without a draft, at one token a cycle, has a cycle for a request its cell did not count.
    Excluded requests stay in the table, so the report can count and list them.
    """
    frame = frame.copy()
    if rung_tok_per_verify is None:
        rung_tok_per_verify = pd.Series(math.nan, index=frame.index).mask(frame["arm"] == "none", 1.0)
    step = frame["decode_s"] / (frame["completion_tokens"] - 1).where(frame["completion_tokens"] > 1)
    shortest = frame["rung"] == frame["rung"].min()
    medians = step[shortest & (step > 0)].median()
    floor = medians / STEP_FLOOR_FACTOR if pd.notna(medians) else 0.0
    delta_columns = [c for c in frame.columns if str(c).startswith("d_") and not str(c).startswith("d_clock_")]
    ks = frame["k"] if "k" in frame.columns else pd.Series(math.nan, index=frame.index)
    frame["request_cycle_ms"] = request_cycle_ms(frame, rung_tok_per_verify)
    if "floor_ms" in frame.columns:
        frame["over_floor"] = frame["request_cycle_ms"] / frame["floor_ms"]
    byte_floors = frame["floor_ms"] if "floor_ms" in frame.columns else pd.Series(math.nan, index=frame.index)
    frame["exclusion"] = [
        exclusion_reason(
            int(c),
            float(d),
            floor,
            {name: float(row[name]) for name in delta_columns},
            None if pd.isna(k) else float(k),
            cycle_ms=float(cycle),
            byte_floor=float(byte_floor),
        )
        for c, d, k, cycle, byte_floor, (_, row) in zip(
            frame["completion_tokens"],
            frame["decode_s"],
            ks,
            frame["request_cycle_ms"],
            byte_floors,
            frame.iterrows(),
            strict=True,
        )
    ]
    frame["excluded"] = frame["exclusion"] != ""
    # A burst (the whole stream read at once) also makes its first token late: its TTFT goes with its rates.
    derived = ("decode_tok_s", "tok_per_j", "req_tok_per_verify", "req_acceptance", "ttft_s", "prefill_tok_s")
    rates = [c for c in derived if c in frame.columns]
    frame.loc[frame["excluded"], rates] = math.nan
    if frame["excluded"].any():
        log.warning("excluded %d impossible request(s): %s", frame["excluded"].sum(),
                    "; ".join(sorted(set(frame.loc[frame["excluded"], "exclusion"]))))  # fmt: skip
    return frame


def counter_deltas(cell_dir: Path) -> pd.DataFrame:
    """One row per (workload, rung) with one column per counter delta."""
    frame = pd.read_parquet(cell_dir / COUNTERS_FILE)
    if frame.empty:
        return pd.DataFrame(columns=RUNG_KEYS)
    if "workload" not in frame.columns:
        frame["workload"] = DEFAULT_WORKLOAD
    return frame.pivot_table(index=RUNG_KEYS, columns="counter", values="delta", aggfunc="sum").reset_index()


def _rung_deltas(deltas: pd.DataFrame, workload: str, rung: int) -> pd.DataFrame:
    return deltas[(deltas["workload"] == workload) & (deltas["rung"] == rung)]


def _rung_counts(deltas: pd.DataFrame, workload: str, rung: int) -> tuple[float, float, float]:
    """The rung's Δdrafts, Δdraft_tokens and Δaccepted (0 where a counter was not read)."""
    d = _rung_deltas(deltas, workload, rung)
    drafts, draft_tokens, accepted = (
        float(d[name].iloc[0]) if name in d and len(d) else 0.0 for name in ("drafts", "draft_tokens", "accepted")
    )
    return drafts, draft_tokens, accepted


def _rung_tok_per_verify(arm: str, d_accepted: float, d_drafts: float) -> float:
    return 1.0 if arm == "none" else analysis.tok_per_verify(d_accepted, d_drafts)


def rung_tokens_per_verify(requests: pd.DataFrame, deltas: pd.DataFrame) -> pd.Series:
    """Each request's rung's tokens per verify, pooled over the rung as :func:`rung_table` counts it."""
    values = []
    for arm, workload, rung in zip(requests["arm"], requests["workload"], requests["rung"], strict=True):
        drafts, _, accepted = _rung_counts(deltas, workload, rung)
        values.append(_rung_tok_per_verify(arm, accepted, drafts))
    return pd.Series(values, index=requests.index, dtype=float)


def _sum_or_nan(values: pd.Series) -> float:
    values = pd.to_numeric(values, errors="coerce")
    return float(values.sum()) if values.notna().all() and len(values) else math.nan


def rung_table(requests: pd.DataFrame, deltas: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for keys, group in requests.groupby([*CELL_KEYS, *RUNG_KEYS], dropna=False, sort=True):
        row = dict(zip([*CELL_KEYS, *RUNG_KEYS], keys, strict=True))
        d_drafts, d_draft_tokens, d_accepted = _rung_counts(deltas, row["workload"], row["rung"])
        decode = float(group["decode_tok_s"].median())
        tpv = _rung_tok_per_verify(row["arm"], d_accepted, d_drafts)
        energy = _sum_or_nan(group["decode_energy_j"] if "decode_energy_j" in group else group["energy_decode_j"])
        window_s = _sum_or_nan(group["decode_s"])
        generated = float((group["completion_tokens"] - 1).sum())
        row.update(
            n_repeats=int(group.loc[~group["excluded"], "repeat"].nunique()),
            n_excluded=int(group["excluded"].sum()),
            prompt_tokens=int(group["prompt_tokens"].median()),
            decode_tok_s=decode,
            decode_tok_s_mean=float(group["decode_tok_s"].mean()),
            decode_tok_s_sem=float(group["decode_tok_s"].sem()) if len(group) > 1 else math.nan,
            ttft_s=float(group["ttft_s"].median()),
            prefill_tok_s=float(group["prefill_tok_s"].median()),
            d_drafts=d_drafts,
            d_draft_tokens=d_draft_tokens,
            d_accepted=d_accepted,
            tok_per_verify=tpv,
            acceptance_rate=(
                math.nan if row["arm"] == "none" else analysis.acceptance_rate(d_accepted, d_draft_tokens)
            ),
            cycle_ms=analysis.cycle_ms(tpv, decode),
            energy_decode_j=energy,
            decode_window_s=window_s,
            tok_per_j=analysis.tok_per_j(generated, energy),
            power_w=analysis.power_w(energy, window_s),
            power_status=str(group["power_status"].iloc[0]),
            **{
                c: group[c].iloc[0]
                for c in (*EFFECTIVE_WINDOW_COLUMNS, WINDOW_ANCHOR_COLUMN, *SERVER_COLUMNS)
                if c in group.columns
            },
        )
        rows.append(row)
    return pd.DataFrame(rows)


def position_table(rungs: pd.DataFrame, deltas_by_cell: dict[str, pd.DataFrame]) -> pd.DataFrame:
    rows = []
    for _, rung in rungs.iterrows():
        if rung["arm"] == "none":
            continue
        d = _rung_deltas(deltas_by_cell[rung["cell_id"]], rung["workload"], rung["rung"])
        for column in sorted(c for c in d.columns if str(c).startswith("accepted_pos_")):
            pos = int(str(column).rsplit("_", 1)[1])
            value = float(d[column].iloc[0])
            rows.append(
                {
                    **{k: rung[k] for k in [*CELL_KEYS, *RUNG_KEYS]},
                    "position": pos,
                    "d_accepted_pos": value,
                    "rate": analysis.position_rate(value, rung["d_drafts"]),
                }
            )
    columns = [*CELL_KEYS, *RUNG_KEYS, "position", "d_accepted_pos", "rate"]
    return pd.DataFrame(rows, columns=columns)


class MixedProtocols(ValueError):
    pass


class DamagedCell(MixedProtocols):
    """A complete cell whose raw files are not what it wrote (truncated, missing, not parseable)."""


class StaleCells(MixedProtocols):
    """Cells whose recorded identity is not the one the study file now gives them."""


def check_identities(manifests: dict[str, dict], expected: dict[str, str]) -> None:
    """Refuse cells measured for another study file than the one being collected.

    ``manifests`` maps a cell's folder to its manifest, ``expected`` a cell id to the identity hash the study
    gives it now. Snakemake reruns a cell whose identity changed only while it keeps its own records
    (.snakemake/); results copied in, or a lost record, would otherwise be reported under today's study.
    """
    stale = [
        (folder, manifest.get("cell_id"))
        for folder, manifest in sorted(manifests.items())
        if manifest.get("cell_id") in expected and manifest.get("identity_hash") != expected[manifest["cell_id"]]
    ]
    if stale:
        folders = " ".join(f"{folder}/{MANIFEST_FILE}" for folder, _ in stale)
        raise StaleCells(
            f"collect: {len(stale)} cell(s) were measured for another study file than this one (their recorded "
            f"identity differs from what the study now describes): {', '.join(str(c) for _, c in stale)}. "
            f"Rerun them: snakemake --forcerun {folders}"
        )


def check_one_protocol(manifests: dict[str, dict]) -> None:
    """Refuse cells measured under different protocols (rungs, repeats, output length, workloads …).

    ``manifests`` maps a cell's folder to its manifest. Cells recorded before protocols were recorded carry
    none and are not compared.
    """
    digests = {m["corpus_digest"] for m in manifests.values() if m.get("corpus_digest")}
    if len(digests) > 1:
        raise MixedProtocols(
            f"collect: the cells built their prompts from different corpora (digests {', '.join(sorted(digests))}: "
            "the standard library of another Python), so the arms did not decode the same prompts and cannot be "
            "paired; rerun the cells with one interpreter"
        )
    protocols = {cell: m["identity"]["protocol"] for cell, m in manifests.items() if "identity" in m}
    if len(protocols) < 2:
        return
    (first, reference), *others = sorted(protocols.items())
    for cell, protocol in others:
        differing = sorted(k for k in set(reference) | set(protocol) if reference.get(k) != protocol.get(k))
        if differing:
            detail = "; ".join(f"{k}: {reference.get(k)!r} vs {protocol.get(k)!r}" for k in differing)
            raise MixedProtocols(
                f"collect: {first} and {cell} were measured under different protocols ({detail}); rerun the "
                "stale cells (snakemake reruns them when the study changed) or collect them separately"
            )


ADMISSION_COLUMNS = [
    "model",
    "engine",
    "arm",
    "sink",
    "window",
    "k",
    "max_model_len",
    "prompt_tokens",
    "kv_cache_memory_bytes",
    "num_blocks",
    "capacity_tokens",
    "max_concurrency",
    "bytes_per_request",
    "pages_by_group",
    "requests",
    "max_running",
    "steps_with_waiting",
    "preemptions",
    "all_at_once",
    "same_output",
    "output_check",
    "verdict",
    "predicted_bytes_per_request",
    "predicted_reclaimed_fraction",
]


def admission_table(files: list[Path]) -> pd.DataFrame:
    """One row per arm of each admission proof (raw/admission/<model>~<engine>.json)."""
    rows = []
    for path in files:
        found = json.loads(path.read_text())
        model, _, engine = path.stem.partition("~")
        shared = {key: found[key] for key in ("sink", "window", "k", "max_model_len", "prompt_tokens")}
        if not found["arms"]:  # not sizeable: one row that carries the verdict
            rows.append(
                {
                    column: {"model": model, "engine": engine, **shared, **found}.get(column)
                    for column in ADMISSION_COLUMNS
                }
            )
        for arm, measured in found["arms"].items():
            row = {**shared, **measured, "model": model, "engine": engine, "arm": arm}
            predicted = found.get("predicted") or {}
            row.update(
                same_output=found["same_output"],
                output_check=(found.get("output_check") or {}).get("summary"),
                verdict=found["verdict"],
                predicted_bytes_per_request=predicted.get(
                    "bytes_per_request_ring" if arm == "wmtp-ring" else "bytes_per_request_wmtp"
                ),
                predicted_reclaimed_fraction=predicted.get("reclaimed_fraction"),
            )
            rows.append({column: row.get(column) for column in ADMISSION_COLUMNS})
    return pd.DataFrame(rows, columns=ADMISSION_COLUMNS)


def collect(
    cell_dirs: list[Path],
    out_dir: Path,
    admission_files: list[Path] | None = None,
    expected_identities: dict[str, str] | None = None,
) -> dict[str, pd.DataFrame]:
    """Read every complete cell and write requests/rungs/positions (and admission) parquet files into ``out_dir``.

    ``expected_identities`` (cell id → identity hash, as the study file gives them now): cells recorded with
    another identity are refused (:func:`check_identities`).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    requests, rungs, deltas_by_cell = [], [], {}
    for cell_dir in cell_dirs:
        if not (cell_dir / MANIFEST_FILE).exists():
            raise FileNotFoundError(f"{cell_dir} has no {MANIFEST_FILE}: the cell did not complete")
        damaged = damaged_files(cell_dir)
        if damaged:
            what = "; ".join(f"{cell_dir / name}: {why}" for name, why in sorted(damaged.items()))
            raise DamagedCell(
                f"collect: a cell's raw files are damaged ({what}); run snakemake again to measure it anew"
            )
    manifests = {str(d): json.loads((d / MANIFEST_FILE).read_text()) for d in cell_dirs}
    if expected_identities is not None:
        check_identities(manifests, expected_identities)
    check_one_protocol(manifests)
    for cell_dir in cell_dirs:
        deltas = counter_deltas(cell_dir)
        req = request_table(cell_dir, deltas)
        deltas_by_cell[req["cell_id"].iloc[0]] = deltas
        requests.append(req)
        rungs.append(rung_table(req, deltas))
        log.info("collected %s (%d requests)", cell_dir, len(req))
    tables = {"requests": pd.concat(requests, ignore_index=True), "rungs": pd.concat(rungs, ignore_index=True)}
    tables["positions"] = position_table(tables["rungs"], deltas_by_cell)
    tables["admission"] = admission_table(list(admission_files or []))
    for name, frame in tables.items():
        frame.to_parquet(out_dir / f"{name}.parquet", index=False)
    return tables
