"""Run one cell: start its server, warm up, sweep the rungs, write the raw files, stop the server.

Raw files are written into a staging directory and moved into place only when the whole cell has
succeeded, manifest last; a failed cell leaves ``failure.json`` with the reason and no success
outputs, so a rerun redoes exactly that cell.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from wmtp import layout
from wmtp.config import RULER_WORKLOADS, Cell, Study
from wmtp.engines import EngineAdapter, ServeRequest, adapter
from wmtp.engines.build import check_built_as
from wmtp.layout import REPO_ROOT
from wmtp.measure.client import Completion, complete
from wmtp.measure.counters import delta
from wmtp.measure.identity import cell_identity, check_identity, identity_hash
from wmtp.measure.lock import device_key, device_lock
from wmtp.measure.power import EnergyWindow, PowerMeter, open_meter
from wmtp.measure.ruler import score
from wmtp.measure.server import PortTaken, ServerProcess, free_port
from wmtp.measure.tasks import PromptTask, workload_task
from wmtp.measure.workload import PromptFactory, chat_settings, copied_tokens
from wmtp.plugin import source_sha256

log = logging.getLogger(__name__)


class PromptLengthMismatch(RuntimeError):
    pass


class Interrupted(RuntimeError):
    pass


REVISION_ENV = "WMTP_REVISION"


def git_revision() -> str | None:
    """The checkout's commit (``-dirty`` with changes to tracked files), or what ``$WMTP_REVISION`` says, marked as
    told: a copy of the working tree on another machine may carry no history, or a stale one."""
    told = os.environ.get(REVISION_ENV)
    if told:
        return f"{told} (told)"
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


@dataclass
class CellRun:
    """Everything one cell needs, resolved to paths."""

    study: Study
    cell: Cell
    out_dir: Path
    engine_manifest: dict
    model_dir: Path
    gpu_index: int | None = None
    cache_dir: Path | None = None
    # The identity hash the workflow planned this cell with (None: do not check).
    expected_identity: str | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    counter_rows: list[dict[str, Any]] = field(default_factory=list)
    windows: list[EnergyWindow] = field(default_factory=list)
    # Where the engine's profiler writes (inside the staging folder), when the protocol profiles.
    profile_dir: Path | None = None

    @property
    def protocol(self):
        return self.study.protocol


def _request_row(
    cell: Cell,
    workload: str,
    rung: int,
    repeat: int,
    slot: int,
    warmup: bool,
    result: Completion,
    prefill: EnergyWindow | None,
    decode: EnergyWindow | None,
) -> dict[str, Any]:
    return {
        "cell_id": cell.cell_id,
        "workload": workload,
        "rung": rung,
        "repeat": repeat,
        "slot": slot,
        "warmup": warmup,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "ttft_s": result.ttft_s,
        "decode_s": result.decode_s,
        "e2e_s": result.e2e_s,
        "started_at": result.started_at,
        "finish_reason": result.finish_reason,
        "energy_prefill_j": prefill.energy_j if prefill else None,
        "energy_decode_j": decode.energy_j if decode else None,
        "decode_window_s": decode.duration_s if decode else None,
        "token_ids": result.token_ids or None,
        "top2_gap": [_top2_gap(top) for top in result.top_logprobs] or None,
        "chunk_gaps_ms": result.chunk_gaps_ms or None,
        "chunk_new_tokens": result.chunk_new_tokens or None,
        # The tokens the first chunk carried (where usage came on every chunk): more than one means the stream's
        # first chunk was held back while the engine decoded.
        "first_chunk_tokens": result.chunk_tokens[0] if result.chunk_tokens else None,
    }


# How long a snapshot after a request waits for the engine to count it as finished (it records a request's clock
# just after the stream's last chunk; milliseconds in practice).
SETTLE_TIMEOUT_S = 10.0
SETTLE_POLL_S = 0.02


def settled_counters(
    engine: EngineAdapter, base_url: str, before: Mapping[str, float], finished: int
) -> dict[str, float]:
    """The engine's counters once ``finished`` more requests than in ``before`` have been counted as finished.

    Without a finished-requests counter (or with no snapshot before) it is one read. After SETTLE_TIMEOUT_S it
    returns what it has, and the request's clock columns show the shortfall.
    """
    key = engine.finished_requests_counter
    after = engine.read_counters(base_url)
    if key is None or key not in before:
        return after
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while after.get(key, 0.0) - before[key] < finished and time.monotonic() < deadline:
        time.sleep(SETTLE_POLL_S)
        after = engine.read_counters(base_url)
    counted = after.get(key, 0.0) - before[key]
    if counted < finished:
        log.warning("the engine counted %g of %d finished request(s) after %.0f s", counted, finished, SETTLE_TIMEOUT_S)
    return after


def _top2_gap(top: dict[int | str, float]) -> float:
    """Logprob gap between the two best candidates: small means a near-tie that numerics may flip."""
    best = sorted(top.values(), reverse=True)
    return best[0] - best[1] if len(best) > 1 else float("inf")


TRACE_SUFFIX = ".pt.trace.json"


class _RequestProfile:
    """The engine's profiler around one measured request: started before the request is sent (the engine lets
    the prefill's steps pass before it traces, so the trace holds decode cycles), stopped once the request is done;
    nothing where ``directory`` is None."""

    def __init__(self, directory: Path | None, engine: EngineAdapter, base_url: str) -> None:
        self.directory, self.engine, self.base_url = directory, engine, base_url
        self._before = set(directory.glob(f"*{TRACE_SUFFIX}*")) if directory is not None else set()
        self._traces: list[str] = []

    def start(self) -> None:
        if self.directory is not None:
            self.engine.start_profile(self.base_url)

    def finish(self, failed: bool) -> None:
        """Stop the profiler and find its traces; not after a failed request (its server may be gone)."""
        if self.directory is None or failed:
            return
        self.engine.stop_profile(self.base_url)
        # One trace file a start (vLLM also rewrites a summary table beside them at every stop).
        new = set(self.directory.glob(f"*{TRACE_SUFFIX}*")) - self._before
        self._traces = sorted(str(path.relative_to(self.directory.parent)) for path in new)

    def fields(self) -> dict[str, Any]:
        """The request's trace files, relative to the cell's folder (no column where nothing was traced)."""
        return {"profile_traces": self._traces} if self.directory is not None else {}


def _measure(
    run: CellRun,
    meter: PowerMeter,
    base_url: str,
    served: str,
    tasks: list[PromptTask],
    workload: str,
    rung: int,
    repeat: int,
    max_tokens: int,
    warmup: bool,
    client: httpx.Client,
    engine: EngineAdapter,
    count_tokens: Callable[[str], int] | None = None,
) -> list[dict[str, Any]]:
    """One repeat: ``len(tasks)`` concurrent requests. Energy windows and counters per request at concurrency 1.

    A copy-task request also records where its passage sat (``distance``, tokens back from the prompt's end)
    and how many tokens of it the output reproduced (``copied_tokens``, counted with ``count_tokens``): a copy
    task the target does not copy cannot show what a window costs. A question-answering request records the items
    of its right answer (``expected_answer``) and the fraction of them its output names (``answer_recall``): a
    draft changes how fast the target answers, never what it answers, and this column is where that shows.
    """
    prompts = [task.text for task in tasks]
    per_request_windows = len(prompts) == 1 and not warmup and meter.available
    profile = _RequestProfile(run.profile_dir if len(prompts) == 1 and not warmup else None, engine, base_url)
    # Alone on the server, a request owns every counter increment between two snapshots: acceptance gets one
    # value per request, so its noise enters the intervals (two /metrics reads, milliseconds).
    per_request_counters = len(prompts) == 1 and not warmup
    counters_before = engine.read_counters(base_url) if per_request_counters else {}
    results: list[Completion | BaseException | None] = [None] * len(prompts)
    windows: list[tuple[EnergyWindow | None, EnergyWindow | None]] = [(None, None)] * len(prompts)

    def one(slot: int) -> None:
        name = f"{workload}/rung{rung}/rep{repeat}/slot{slot}"
        prefill_w: list[EnergyWindow] = []

        def first_token() -> None:
            if per_request_windows:
                prefill_w.append(meter.end_window(name + "/prefill"))
                meter.begin_window(name + "/decode")

        try:
            if per_request_windows:
                meter.begin_window(name + "/prefill")
            results[slot] = complete(
                base_url,
                served,
                prompts[slot],
                max_tokens,
                temperature=run.protocol.temperature,
                logprobs=2 if run.protocol.record_tokens else None,
                # A question is answered when the model says so (at most max_tokens); other workloads run to
                # max_tokens, so that every request of a rung decodes the same number of tokens.
                ignore_eos=workload not in RULER_WORKLOADS,
                timeout_s=run.protocol.request_timeout_s,
                on_first_token=first_token,
                client=client,
                extra_body={
                    **(engine.request_extra or {}),
                    **(engine.token_request_fields if run.protocol.record_tokens else {}),
                    **engine.sampling_fields(run.protocol),
                },
                chat=chat_settings(run.study, run.cell.model),
            )
            if per_request_windows:
                windows[slot] = (prefill_w[0], meter.end_window(name + "/decode"))
        except BaseException as err:
            results[slot] = err

    threads = [threading.Thread(target=one, args=(slot,), daemon=True) for slot in range(len(prompts))]
    repeat_window = f"{workload}/rung{rung}/rep{repeat}/all"
    if meter.available and not warmup and len(prompts) > 1:
        meter.begin_window(repeat_window)
    profile.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if meter.available and not warmup and len(prompts) > 1:
        run.windows.append(meter.end_window(repeat_window))
    profile.finish(failed=any(isinstance(result, BaseException) for result in results))
    rows = []
    for slot, result in enumerate(results):
        if isinstance(result, BaseException):
            raise result
        assert result is not None
        if not warmup and result.prompt_tokens != rung:
            raise PromptLengthMismatch(
                f"rung {rung} ({workload}): the server counted {result.prompt_tokens} prompt tokens, not {rung}; the "
                "pipeline's tokenizer disagrees with the server's (wrong tokenizer.json, or a chat template?)"
            )
        prefill_w, decode_w = windows[slot]
        run.windows += [w for w in (prefill_w, decode_w) if w is not None]
        rows.append(_request_row(run.cell, workload, rung, repeat, slot, warmup, result, prefill_w, decode_w))
        rows[-1].update(engine.request_fields(result.extensions))
        task = tasks[slot]
        rows[-1]["distance"] = task.distance
        rows[-1]["copied_tokens"] = (
            copied_tokens(count_tokens, result.text, task.continuation) if count_tokens is not None else None
        )
        rows[-1]["expected_answer"] = list(task.answer) if task.answer is not None else None
        rows[-1]["answer_recall"] = score(workload, result.text, task.answer) if task.answer is not None else None
        rows[-1].update(profile.fields())
    if per_request_counters and counters_before:
        after = settled_counters(engine, base_url, counters_before, len(prompts))
        # Raw differences, negative ones included: a counter that went backwards is screened out downstream.
        rows[0].update({f"d_{k}": after.get(k, 0.0) - counters_before.get(k, 0.0) for k in sorted(set(after))})
    return rows


def _sweep_rung(
    run: CellRun,
    meter: PowerMeter,
    base_url: str,
    served: str,
    factory: PromptFactory,
    engine: EngineAdapter,
    client: httpx.Client,
    workload: str,
    rung: int,
    repeats: int,
) -> None:
    """Every repeat of one (workload, rung), between two snapshots of the engine's counters."""
    protocol, c = run.protocol, run.cell.concurrency
    where = f"rung {rung}" if workload == "code" else f"rung {rung} ({workload})"
    log.info("%s: building %d prompt(s) of %d tokens", where, repeats * c, rung)
    tasks = [
        [workload_task(factory, workload, rung, rep * c + slot, salt=f"measure/{rung}") for slot in range(c)]
        for rep in range(repeats)
    ]
    before = engine.read_counters(base_url)
    t_before = time.time()
    rung_window = f"{workload}/rung{rung}"
    if meter.available:
        meter.begin_window(rung_window)
    for rep in range(repeats):
        rows = _measure(
            run,
            meter,
            base_url,
            served,
            tasks[rep],
            workload,
            rung,
            rep,
            protocol.output_tokens,
            False,
            client,
            engine,
            count_tokens=factory.token_count,
        )
        run.rows += rows
        tok_s = [(r["completion_tokens"] - 1) / r["decode_s"] for r in rows if r["decode_s"] > 0]
        log.info(
            "%s repeat %d/%d: ttft %.2f s, decode %.1f tok/s",
            where,
            rep + 1,
            repeats,
            rows[0]["ttft_s"],
            sum(tok_s) / max(len(tok_s), 1),
        )
    if meter.available:
        run.windows.append(meter.end_window(rung_window))
    after = settled_counters(engine, base_url, before, repeats * run.cell.concurrency)
    t_after = time.time()
    measured = [r for r in run.rows if r["rung"] == rung and r["workload"] == workload and not r["warmup"]]
    from_requests = engine.counters_from_requests(measured, run.cell.arm, run.cell.k, delta(before, after))
    if from_requests is not None:  # the engine's spec counters cannot be differenced (SGLang)
        after = {**after, **from_requests}
    d = delta(before, after)
    for name in sorted(set(before) | set(after)):
        run.counter_rows.append(
            {
                "cell_id": run.cell.cell_id,
                "workload": workload,
                "rung": rung,
                "counter": name,
                "before": before.get(name, 0.0),
                "after": after.get(name, 0.0),
                "delta": d[name],
                "before_at": t_before,
                "after_at": t_after,
            }
        )


def _sweep(
    run: CellRun, meter: PowerMeter, base_url: str, served: str, factory: PromptFactory, engine: EngineAdapter
) -> None:
    protocol = run.protocol
    c = run.cell.concurrency
    client = httpx.Client(
        timeout=httpx.Timeout(protocol.request_timeout_s, connect=10.0),
        limits=httpx.Limits(max_connections=max(4, 2 * c)),
    )
    try:
        for i in range(protocol.warmup_requests):
            prompt = factory.prompt(protocol.warmup_prompt_tokens, i, salt="warmup")
            log.info("warm-up %d/%d", i + 1, protocol.warmup_requests)
            run.rows += _measure(
                run,
                meter,
                base_url,
                served,
                [PromptTask(prompt)],
                "code",
                protocol.warmup_prompt_tokens,
                i,
                protocol.warmup_output_tokens,
                True,
                client,
                engine,
            )
        # Workloads interleave within a rung so that their comparison is not confounded by drift over the sweep.
        for rung, repeats in zip(protocol.rungs, protocol.repeats, strict=True):
            for workload in protocol.workloads:
                _sweep_rung(run, meter, base_url, served, factory, engine, client, workload, rung, repeats)
    finally:
        client.close()


def _write_parquet(rows: list[dict[str, Any]], path: Path, columns: list[str] | None = None) -> None:
    import pandas as pd

    frame = pd.DataFrame(rows, columns=columns) if not rows and columns else pd.DataFrame(rows)
    frame.to_parquet(path, index=False)


STAGING_PREFIX = ".staging-"
KEPT_PREFIX = "kept-"
PORT_ATTEMPTS = 3
# On SIGTERM/SIGINT the server gets this long to exit before its group is killed: a stopped cell frees its
# GPU within seconds, not after vLLM's own shutdown.
INTERRUPT_GRACE_S = 5.0


# A cell's short temporary folder is <tmp>/wmtp-<pid>-<random>: the pid tells whose it is.
TMP_PREFIX = "wmtp-"


def _remove_orphaned_tmp() -> None:
    """Remove the temporary folders of cells whose process is gone: one killed before its server's watchdog
    started leaves its folder behind (the watchdog removes it otherwise)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{TMP_PREFIX}*-*"):
        owner = folder.name[len(TMP_PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and folder.is_dir() and not _pid_alive(int(owner)):
            shutil.rmtree(folder, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holds_measurements(staging: Path) -> bool:
    return any((staging / name).exists() for name in (layout.MANIFEST_FILE, layout.REQUESTS_FILE))


def recover_staging(out_dir: Path, identity_hash_now: str) -> bool:
    """Deal with staging folders of dead cell processes; True if one held this very cell, complete.

    A complete staging (its manifest written, moving it into place failed or the process died just then)
    of the same identity is moved into place instead of measuring again; other finished measurements are
    kept aside as ``kept-<pid>/``; a staging of an interrupted run holds nothing finished and is removed.
    """
    adopted = False
    for staging in sorted(out_dir.glob(STAGING_PREFIX + "*")):
        pid = staging.name[len(STAGING_PREFIX) :]
        if pid.isdigit() and _pid_alive(int(pid)) and int(pid) != os.getpid():
            continue  # another live process's: never touch it
        manifest_file = staging / layout.MANIFEST_FILE
        if not adopted and manifest_file.exists():
            with contextlib.suppress(OSError, ValueError):
                if json.loads(manifest_file.read_text()).get("identity_hash") == identity_hash_now and all(
                    (staging / name).exists() for name in layout.RAW_SUCCESS_FILES
                ):
                    if (staging / layout.PROFILE_DIR).is_dir():
                        shutil.rmtree(out_dir / layout.PROFILE_DIR, ignore_errors=True)
                        os.replace(staging / layout.PROFILE_DIR, out_dir / layout.PROFILE_DIR)
                    for name in layout.RAW_SUCCESS_FILES:  # manifest last
                        os.replace(staging / name, out_dir / name)
                    shutil.rmtree(staging, ignore_errors=True)
                    log.info("adopted the complete measurements of an earlier run from %s", staging)
                    adopted = True
                    continue
        if _holds_measurements(staging):
            kept = out_dir / f"{KEPT_PREFIX}{pid}"
            os.replace(staging, kept)
            log.warning("kept the measurements of an earlier, unfinished run in %s", kept)
        else:
            shutil.rmtree(staging, ignore_errors=True)
    return adopted


def set_aside_damaged(cell_dir: Path, record: Path) -> dict[str, Any]:
    """Move a damaged cell's files into a folder of their own inside the cell's, so that the cell is measured anew;
    nothing is deleted or rewritten. ``record`` says what was damaged and where it went."""
    damaged = layout.damaged_files(cell_dir)
    found: dict[str, Any] = {"cell_dir": str(cell_dir), "damaged": damaged, "moved_to": None}
    if damaged:
        aside = cell_dir / f"{layout.DAMAGED_PREFIX}{record.stem}"
        aside.mkdir(exist_ok=True)
        for name in (*layout.RAW_SUCCESS_FILES, layout.FAILURE_FILE, layout.SERVER_FAILED_LOG):
            if (cell_dir / name).exists():
                os.replace(cell_dir / name, aside / name)
        found["moved_to"] = str(aside)
        what = "; ".join(f"{name}: {why}" for name, why in damaged.items())
        log.warning(
            "cell %s: damaged raw files (%s) set aside in %s; the cell is measured again", cell_dir, what, aside
        )
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({**found, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2))
    return found


def _record_failure(out_dir: Path, staging: Path, failure: dict[str, Any]) -> None:
    """failure.json in the cell's folder; where that cannot be written, in the staging folder; and a log line."""
    text = json.dumps(failure, indent=2, default=str)
    try:
        (out_dir / layout.FAILURE_FILE).write_text(text)
        return
    except OSError as err:
        reason = err
    try:
        (staging / layout.FAILURE_FILE).write_text(text)
        log.error(
            "cannot write %s (%s); the failure record and any measurements are in %s",
            out_dir / layout.FAILURE_FILE,
            reason,
            staging,
        )
    except OSError as err:
        log.error("cannot write a failure record in %s (%s) nor in %s (%s)", out_dir, reason, staging, err)


def _build_server(run: CellRun, engine: EngineAdapter, staging: Path, cache_dir: Path, short_tmp: Path):
    """The server process for this cell on a fresh port; its argv and env, and the container's stop command."""
    cell, study = run.cell, run.study
    spec, model = study.engine(cell.engine), study.model(cell.model)
    port = free_port()
    request = ServeRequest(
        python=run.engine_manifest["python"],
        model_dir=run.model_dir,
        served_name=cell.model,
        port=port,
        max_model_len=model.max_model_len,
        draft=cell,
        engine_args=tuple(spec.serve_args),
        model_args=tuple(model.serve_args),
        arm_args=tuple(study.arm_args(cell)),
        profile_dir=run.profile_dir,
        profile_iterations=run.protocol.profile_iterations,
        profile_prompt_tokens=max(run.protocol.rungs),
    )
    argv = engine.serve_argv(request)
    env = engine.server_env(spec.env, cache_dir.resolve(), short_tmp, request)
    container_stop: list[str] | None = None
    if spec.source == "container":
        from wmtp.engines import container

        argv = container.serve_command(spec, argv, model_dir=run.model_dir, work_dir=cache_dir, port=port, env=env)
        # A Docker container outlives a killed client: remove it by name when the cell ends.
        container_stop = container.stop_argv(
            spec.container_runtime or container.default_runtime(spec.image), f"wmtp-{port}"
        )
    server = ServerProcess(
        argv,
        env,
        staging / layout.SERVER_LOG,
        f"http://127.0.0.1:{port}",
        engine.health_path,
        make_dirs=[env[k] for k in ("TMPDIR", *engine.cache_env) if k in env],
        verify_owner=spec.source != "container",
        orphan_dirs=[str(short_tmp)],
    )
    return server, container_stop


def model_config(model_dir: Path) -> dict[str, Any] | None:
    """The checkpoint's config.json, or None where it has none (or it does not parse)."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None


ENGINE_ENV_PREFIXES = ("VLLM_", "SGLANG_", "WMTP_")


def engine_settings(env: Mapping[str, str]) -> dict[str, str]:
    """The engine's own environment switches a server ran with (which model runner, KV space …), for the
    manifest: the variables the engines read by prefix, never one that names a key, token, password or credential."""
    secret = ("KEY", "TOKEN", "SECRET", "PASS", "AUTH", "CREDENTIAL")
    return {
        key: env[key]
        for key in sorted(env)
        if key.startswith(ENGINE_ENV_PREFIXES) and not any(word in key for word in secret)
    }


def _start_server(run: CellRun, engine: EngineAdapter, staging: Path, cache_dir: Path, short_tmp: Path, manifest):
    """Start the server and wait until it is healthy and proven ours; a port lost to a race is retried."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        server, container_stop = _build_server(run, engine, staging, cache_dir, short_tmp)
        log.info("cell %s: starting %s on port %d", run.cell.cell_id, run.cell.engine, server.port)
        server.start()
        manifest.update(argv=server.argv, env=server.env, server_pid=server.pid, port=server.port)
        log.info("server pid %d (process group %d)", server.pid, server.pid)
        try:
            healthy_s = server.wait_healthy(run.study.protocol.health_timeout_s)
        except PortTaken:
            server.stop()
            if container_stop:
                subprocess.run(container_stop, capture_output=True, check=False, timeout=60)
            if attempt == PORT_ATTEMPTS:
                raise
            log.warning("port %d was taken before the server bound it; retrying on another", server.port)
            continue
        except BaseException:
            server.stop(grace_s=INTERRUPT_GRACE_S)
            if container_stop:
                subprocess.run(container_stop, capture_output=True, check=False, timeout=60)
            raise
        manifest["server_ready_s"] = round(healthy_s, 1)
        manifest["server_env"] = engine_settings(server.env)
        log.info("server healthy after %.0f s", healthy_s)
        return server, container_stop
    raise AssertionError("unreachable")


def _fail(out_dir: Path, staging: Path, cell_id: str, err: BaseException, manifest: dict, finished: bool) -> bool:
    """Record a failed cell; returns whether the staging folder must stay (it holds finished measurements)."""
    keep = finished or _holds_measurements(staging)
    if keep:  # a move into place failed half-way: gather the finished files back in one folder
        for name in layout.RAW_SUCCESS_FILES:
            with contextlib.suppress(OSError):
                if (out_dir / name).exists() and not (staging / name).exists():
                    os.replace(out_dir / name, staging / name)
    failure = {
        "cell_id": cell_id,
        "error": type(err).__name__,
        "message": str(err),
        "traceback": traceback.format_exc(),
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "server_log": str(out_dir / layout.SERVER_FAILED_LOG),
        "measurements_kept_in": str(staging) if keep else None,
        "manifest": manifest,
    }
    with contextlib.suppress(OSError):
        if (staging / layout.SERVER_LOG).exists() and not keep:
            os.replace(staging / layout.SERVER_LOG, out_dir / layout.SERVER_FAILED_LOG)
    _record_failure(out_dir, staging, failure)
    log.error("cell %s failed: %s: %s (details in %s)", cell_id, type(err).__name__, err, out_dir / layout.FAILURE_FILE)
    return keep


def run_cell(run: CellRun) -> Path:
    """Run the cell; on success the raw files are in ``run.out_dir``. Raises on failure."""
    out_dir = run.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    cell, study = run.cell, run.study
    identity = cell_identity(study, cell)
    check_identity(run.expected_identity, identity)
    check_built_as(run.engine_manifest, study.engine(cell.engine))
    if recover_staging(out_dir, identity_hash(identity)):
        return out_dir
    for name in (*layout.RAW_SUCCESS_FILES, layout.FAILURE_FILE, layout.SERVER_FAILED_LOG):
        (out_dir / name).unlink(missing_ok=True)
    shutil.rmtree(out_dir / layout.PROFILE_DIR, ignore_errors=True)
    staging = out_dir / f"{STAGING_PREFIX}{os.getpid()}"
    staging.mkdir()
    if study.protocol.profile_iterations:
        run.profile_dir = staging / layout.PROFILE_DIR
        run.profile_dir.mkdir()
    # The engine's compile caches are shared by the cells of one engine, outside the raw files.
    cache_dir = run.cache_dir or (out_dir / ".cache")
    cache_dir.mkdir(parents=True, exist_ok=True)
    spec = study.engine(cell.engine)
    engine = adapter(spec.kind)
    engine.check_cell(spec, run.engine_manifest, cell, study.serve_args(cell))
    _remove_orphaned_tmp()
    short_tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-"))
    meter = open_meter(run.gpu_index)
    manifest: dict[str, Any] = {
        "cell": cell.model_dump(mode="json"),
        "cell_id": cell.cell_id,
        "study": study.study,
        "config_hash": study.config_hash(),
        "identity": identity,
        "identity_hash": identity_hash(identity),
        "wmtp_revision": git_revision(),
        # The plugin's source as this process sees it, and as the engine's environment imports it (its build).
        "wmtp_plugin_sha256": source_sha256(),
        "engine": {
            k: run.engine_manifest.get(k)
            for k in ("engine", "kind", "source", "python", "versions", "spec_hash", "build_hash")
        },
        "model_dir": str(run.model_dir),
        # The checkpoint's architecture, so the analysis can set the cost model's prediction next to this cell.
        "model_config": model_config(run.model_dir),
        "host": platform.node(),
        "gpu_at_start": meter.info(),
        "power_status": meter.status,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }

    def on_signal(signum, _frame):
        raise Interrupted(f"received signal {signum}")

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    started = time.monotonic()
    server: ServerProcess | None = None
    container_stop: list[str] | None = None
    keep_staging = False
    try:
        with device_lock(device_key(spec.device, run.gpu_index)):
            factory = PromptFactory(run.model_dir / "tokenizer.json", chat=chat_settings(study, cell.model))
            manifest["corpus_digest"] = factory.corpus.digest
            with meter.sampling(hz=10.0):
                if study.protocol.idle_baseline_s > 0 and meter.available:
                    log.info("idle baseline: %.0f s", study.protocol.idle_baseline_s)
                    meter.begin_window("idle")
                    time.sleep(study.protocol.idle_baseline_s)
                    run.windows.append(meter.end_window("idle"))
                server, container_stop = _start_server(run, engine, staging, cache_dir, short_tmp, manifest)
                _sweep(run, meter, server.base_url, cell.model, factory, engine)
            manifest["exit_status"] = server.stop()
            # After the stop, so the engine's last reports are written; a cell that did not run what its
            # arm says fails here, with the engine's reason.
            manifest.update(engine.verify_cell(staging, server.env, cell, study.protocol))
        manifest["gpu_at_end"] = meter.info()
        manifest["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        manifest["duration_s"] = round(time.monotonic() - started, 1)
        _write_parquet(run.rows, staging / layout.REQUESTS_FILE)
        _write_parquet(run.counter_rows, staging / layout.COUNTERS_FILE)
        _write_parquet(
            [{"cell_id": cell.cell_id, **w.to_dict()} for w in run.windows],
            staging / layout.ENERGY_FILE,
            columns=["cell_id", "name", "energy_j"],
        )
        _write_parquet(meter.samples(), staging / layout.POWER_FILE, columns=["t_s", "power_w"])
        (staging / layout.MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, default=str))
        keep_staging = True  # from here on the staging folder holds a finished measurement
        if run.profile_dir is not None:
            os.replace(run.profile_dir, out_dir / layout.PROFILE_DIR)
        for name in layout.RAW_SUCCESS_FILES:  # manifest.json last: its presence means the cell is complete
            os.replace(staging / name, out_dir / name)
        keep_staging = False
        return out_dir
    except BaseException as err:
        if server is not None:
            server.stop(grace_s=INTERRUPT_GRACE_S)
        keep_staging = _fail(out_dir, staging, cell.cell_id, err, manifest, keep_staging)
        raise
    finally:
        if server is not None:
            server.stop(grace_s=INTERRUPT_GRACE_S)
        if container_stop:
            subprocess.run(container_stop, capture_output=True, check=False, timeout=60)
        meter.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if not keep_staging:
            shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(short_tmp, ignore_errors=True)
