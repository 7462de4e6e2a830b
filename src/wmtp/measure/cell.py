"""Run one cell: start its server, warm up, sweep the rungs, write the raw files, stop the server.

Raw files are written into a staging directory and moved into place only when the whole cell has
succeeded, manifest last; a failed cell leaves ``failure.json`` with the reason and no success
outputs, so a rerun redoes exactly that cell.
"""

from __future__ import annotations

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from wmtp import layout
from wmtp.config import Cell, Study
from wmtp.engines import EngineAdapter, ServeRequest, adapter
from wmtp.layout import REPO_ROOT
from wmtp.measure.client import Completion, complete
from wmtp.measure.counters import delta
from wmtp.measure.power import EnergyWindow, PowerMeter, open_meter
from wmtp.measure.server import ServerProcess, free_port
from wmtp.measure.workload import PromptFactory, workload_prompt

log = logging.getLogger(__name__)


class PromptLengthMismatch(RuntimeError):
    pass


class Interrupted(RuntimeError):
    pass


def git_revision() -> str | None:
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
    rows: list[dict[str, Any]] = field(default_factory=list)
    counter_rows: list[dict[str, Any]] = field(default_factory=list)
    windows: list[EnergyWindow] = field(default_factory=list)

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
    }


def _top2_gap(top: dict[int, float]) -> float:
    """Logprob gap between the two best candidates: small means a near-tie that numerics may flip."""
    best = sorted(top.values(), reverse=True)
    return best[0] - best[1] if len(best) > 1 else float("inf")


def _measure(
    run: CellRun,
    meter: PowerMeter,
    base_url: str,
    served: str,
    prompts: list[str],
    workload: str,
    rung: int,
    repeat: int,
    max_tokens: int,
    warmup: bool,
    client: httpx.Client,
    engine: EngineAdapter,
) -> list[dict[str, Any]]:
    """One repeat: ``len(prompts)`` concurrent requests. Energy windows per request at concurrency 1."""
    per_request_windows = len(prompts) == 1 and not warmup and meter.available
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
                timeout_s=run.protocol.request_timeout_s,
                on_first_token=first_token,
                client=client,
                extra_body=engine.request_extra,
            )
            if per_request_windows:
                windows[slot] = (prefill_w[0], meter.end_window(name + "/decode"))
        except BaseException as err:
            results[slot] = err

    threads = [threading.Thread(target=one, args=(slot,), daemon=True) for slot in range(len(prompts))]
    repeat_window = f"{workload}/rung{rung}/rep{repeat}/all"
    if meter.available and not warmup and len(prompts) > 1:
        meter.begin_window(repeat_window)
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if meter.available and not warmup and len(prompts) > 1:
        run.windows.append(meter.end_window(repeat_window))
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
    prompts = [
        [workload_prompt(factory, workload, rung, rep * c + slot, salt=f"measure/{rung}") for slot in range(c)]
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
            prompts[rep],
            workload,
            rung,
            rep,
            protocol.output_tokens,
            False,
            client,
            engine,
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
    after = engine.read_counters(base_url)
    t_after = time.time()
    measured = [r for r in run.rows if r["rung"] == rung and r["workload"] == workload and not r["warmup"]]
    from_requests = engine.counters_from_requests(measured, run.cell.arm, run.cell.k)
    if from_requests is not None:  # server counters cannot be differenced (SGLang)
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
                [prompt],
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


def run_cell(run: CellRun) -> Path:
    """Run the cell; on success the raw files are in ``run.out_dir``. Raises on failure."""
    out_dir = run.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in (*layout.RAW_SUCCESS_FILES, layout.FAILURE_FILE, layout.SERVER_FAILED_LOG):
        (out_dir / name).unlink(missing_ok=True)
    staging = out_dir / f".staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    # The engine's compile caches are shared by the cells of one engine, outside the raw files.
    cache_dir = run.cache_dir or (out_dir / ".cache")
    cache_dir.mkdir(parents=True, exist_ok=True)
    cell, study = run.cell, run.study
    spec = study.engine(cell.engine)
    model = study.model(cell.model)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    served = cell.model
    python = run.engine_manifest["python"]
    engine = adapter(spec.kind)
    engine.check_cell(spec, run.engine_manifest, cell, [*spec.serve_args, *model.serve_args])
    argv = engine.serve_argv(
        ServeRequest(
            python=python,
            model_dir=run.model_dir,
            served_name=served,
            port=port,
            max_model_len=model.max_model_len,
            arm=cell.arm,
            k=cell.k,
            sink=cell.sink,
            window=cell.window,
            engine_args=tuple(spec.serve_args),
            model_args=tuple(model.serve_args),
        )
    )
    short_tmp = Path(tempfile.mkdtemp(prefix="wmtp-"))
    env = engine.server_env(spec.env, cache_dir.resolve(), short_tmp)
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
        base_url,
        engine.health_path,
        make_dirs=[env[k] for k in ("TMPDIR", *engine.cache_env) if k in env],
    )
    meter = open_meter(run.gpu_index)
    manifest: dict[str, Any] = {
        "cell": cell.model_dump(mode="json"),
        "cell_id": cell.cell_id,
        "study": study.study,
        "config_hash": study.config_hash(),
        "wmtp_revision": git_revision(),
        "engine": {
            k: run.engine_manifest.get(k) for k in ("engine", "kind", "source", "python", "versions", "spec_hash")
        },
        "model_dir": str(run.model_dir),
        "argv": argv,
        "env": env,
        "host": platform.node(),
        "gpu_at_start": meter.info(),
        "power_status": meter.status,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }

    def on_signal(signum, _frame):
        raise Interrupted(f"received signal {signum}")

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    started = time.monotonic()
    try:
        factory = PromptFactory(run.model_dir / "tokenizer.json")
        manifest["corpus_digest"] = factory.corpus.digest
        with meter.sampling(hz=10.0):
            if study.protocol.idle_baseline_s > 0 and meter.available:
                log.info("idle baseline: %.0f s", study.protocol.idle_baseline_s)
                meter.begin_window("idle")
                time.sleep(study.protocol.idle_baseline_s)
                run.windows.append(meter.end_window("idle"))
            log.info("cell %s: starting %s on port %d", cell.cell_id, spec.name, port)
            server.start()
            manifest["server_pid"] = server.pid
            log.info("server pid %d (process group %d)", server.pid, server.pid)
            healthy_s = server.wait_healthy(study.protocol.health_timeout_s)
            manifest["server_ready_s"] = round(healthy_s, 1)
            log.info("server healthy after %.0f s", healthy_s)
            _sweep(run, meter, base_url, served, factory, engine)
        manifest["exit_status"] = server.stop()
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
        for name in layout.RAW_SUCCESS_FILES:  # manifest.json last: its presence means the cell is complete
            os.replace(staging / name, out_dir / name)
        return out_dir
    except BaseException as err:
        failure = {
            "cell_id": cell.cell_id,
            "error": type(err).__name__,
            "message": str(err),
            "traceback": traceback.format_exc(),
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "server_log": str(out_dir / layout.SERVER_FAILED_LOG),
            "manifest": manifest,
        }
        server.stop()
        if (staging / layout.SERVER_LOG).exists():
            os.replace(staging / layout.SERVER_LOG, out_dir / layout.SERVER_FAILED_LOG)
        (out_dir / layout.FAILURE_FILE).write_text(json.dumps(failure, indent=2, default=str))
        log.error(
            "cell %s failed: %s: %s (details in %s)",
            cell.cell_id,
            type(err).__name__,
            err,
            out_dir / layout.FAILURE_FILE,
        )
        raise
    finally:
        server.stop()
        if container_stop:
            subprocess.run(container_stop, capture_output=True, check=False, timeout=60)
        meter.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(short_tmp, ignore_errors=True)
