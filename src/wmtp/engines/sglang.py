"""SGLang adapter: serve argv, health probe, per-request spec-decode counts, version checks.

GPU only: SGLang's kernels are CUDA-only, so a CPU box can build argv and parse responses but cannot
serve (``check_cell`` refuses ``device: cpu``).

Arms (facts from the sglang 0.5.21 wheel's ``arg_groups/fields/spec.py`` and ``speculative_hook.py``):

* ``mtp`` — the checkpoint's own MTP head: ``--speculative-algorithm NEXTN`` (SGLang's name for a
  built-in MTP head; it resolves to its EAGLE worker, so ``EAGLE`` would do the same), a chain draft
  (``--speculative-eagle-topk 1``: one proposal per step, as vLLM's MTP in the Spark study), k draft steps
  (``--speculative-num-steps k``) and k+1 verified tokens (``--speculative-num-draft-tokens k+1``).
* ``wmtp`` — the same plus upstream's windowed draft decode (sgl-project/sglang PR #32673, first
  released in sglang 0.5.21): ``--speculative-draft-window-size W --speculative-draft-sink-size S``.
  Each draft-decode step then reads the first S and the most recent W prefix tokens (token-granular,
  unlike our block-granular vLLM plugin); the target's verify pass stays full-context. Only the
  Triton and FlashInfer *draft* attention backends honour it — others (fa3; trtllm_mha, which 0.5.21
  picks by itself for Nemotron-H drafts on Blackwell) silently read the full context — so every drafting
  arm gets ``--speculative-draft-attention-backend`` (FlashInfer unless the study's serve_args choose
  Triton): by default the same draft backend in ``mtp`` and ``wmtp``, so the arms differ only in the
  window; a study that gives an arm its own backend (the arm's ``serve_args``) says so beside it.
  With the FlashAttention (``fa3``) draft backend, which upstream does not window, the window is ours instead:
  the SGLang plugin (``wmtp.plugin.sglang``, an ``sglang.srt.plugins`` entry point, 0.5.17 on) windows each
  draft-decode step's metadata, set through ``WMTP_SGLANG_WINDOW`` in the server's environment
  (``server_env``), with no window flags; a cell needs the engine's probe to have found the plugin's hook
  points (``wmtp_hooks``), and its counters show that the window acted (``verify_cell``).
* ``wmtp-ring`` — ours, not upstream's: not built for SGLang yet (``RingNotBuilt``).

Checkpoints: SGLang's Qwen3-Next config reads ``full_attention_interval``, which a config that transformers 5
writes (``layer_types`` alone: the committed tiny checkpoint, the weightless dummies) lacks; ``serve_argv``
passes it through ``--json-model-override-args`` (``config_overrides``).

Server metrics (``--enable-metrics``, which ``serve_argv`` adds): SGLang's server keeps each request's figures
on its own clock, the tokenizer manager's (``time.perf_counter``): the request received, its first output received
from the scheduler, its last. It exports them as histograms, and the verify cycles and tokens of finished requests
as counters (:data:`SERVER_SAMPLES`, checked against SGLang's source by ``wmtp.engines.sglang_hooks``).
``read_counters`` reads them, so that a request alone on the server owns their differences as a vLLM request owns
vLLM's: ``clock_decode_s`` (end to end less time to first token: first output to last, the server's view of the
decode, which the client's stream can only see later), ``clock_prefill_s`` (time to first token, queue included),
``clock_requests`` and ``clock_generation_tokens``. The spec metrics proper are gauges (acceptance
length/rate), which cannot be differenced over a rung.

Counts: a streamed ``/v1/completions`` with ``return_spec_tokens_details: true`` (``REQUEST_EXTRA``; sglang 0.5.21
on) ends with a chunk whose ``choices`` is empty and whose ``sglext.spec_tokens_details`` holds the request's
``spec_verify_ct`` (verify cycles), ``spec_num_correct_drafts`` and ``spec_correct_drafts_histogram`` (cycles that
accepted 0, 1, … k drafts); the native ``/generate`` carries the same keys in ``meta_info``. sglang 0.5.17's
completions stream carries none of them (its ``sglext`` has routed experts and cached tokens only): there the
rung's verify cycles are the difference of ``sglang:spec_verify_calls_total`` and its tokens that of
``sglang:generation_tokens_total``, the same two numbers summed on the server. ``counters_from_requests`` turns
either into the short names the tidy step reads, chosen so that its ``1 + accepted / drafts`` is the SGLang formula
of docs/design.md ("Formulas") ``tokPerVerify = completion_tokens / spec_verify_ct``:

* ``drafts`` = Σ spec_verify_ct; ``draft_tokens`` = k · Σ spec_verify_ct;
* ``accepted`` = Σ completion_tokens − Σ spec_verify_ct (so it also counts each request's first token,
  which comes from prefill, not from a verify cycle: the acceptance rate reads up to 1/verify_ct high; a
  question answered at its first token, EOS right after the prefill, has spec_verify_ct 0 and is counted so);
* ``correct_drafts`` = Σ spec_num_correct_drafts, the strict count, when every response has it;
* ``accepted_pos_<p>`` = cycles that accepted more than p drafts, from the histograms, when present (not from
  the server's counters, which keep no histogram).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from wmtp.engines.base import CellRefused, EngineAdapter, ServeRequest, flag_value, has_flag
from wmtp.engines.prometheus import fetch_metrics, summed
from wmtp.plugin import sglang_hookpoints
from wmtp.plugin import stats as plugin_stats

HEALTH_PATH = "/health"
# The first sglang release whose server args have both window flags (checked in the 0.5.17–0.5.21
# wheels: 0.5.19 and 0.5.20 had --speculative-draft-window-size for EAGLE-3/DFLASH only, no sink).
FIRST_WINDOWED_VERSION = "0.5.21"
WINDOW_FLAGS = ("--speculative-draft-window-size", "--speculative-draft-sink-size")
DRAFT_BACKEND_FLAG = "--speculative-draft-attention-backend"
# SGLang's flag for keys merged into the checkpoint's config after loading it.
OVERRIDE_FLAG = "--json-model-override-args"
# Draft attention backends whose multi-step draft decode honours the window (PR #32673).
WINDOW_BACKENDS = ("flashinfer", "triton")
DEFAULT_DRAFT_BACKEND = "flashinfer"
# Draft attention backends the SGLang plugin windows (wmtp.plugin.sglang), where upstream does not.
PLUGIN_BACKENDS = ("fa3",)
# Flags the arm owns: a study's serve_args must not set them.
ARM_FLAGS = (
    "--speculative-algorithm",
    "--speculative-num-steps",
    "--speculative-eagle-topk",
    "--speculative-num-draft-tokens",
    *WINDOW_FLAGS,
)
# Asked of every request so that the response carries its spec-decode counts.
REQUEST_EXTRA = {"return_spec_tokens_details": True}
# Asked where a study records its tokens: SGLang names log-probability candidates by text, and gives each chunk's
# generated ids in its choice on request.
TOKEN_REQUEST_FIELDS = {"return_token_ids": True}
# The server's Prometheus metrics, off unless asked for: its per-request clock and counters.
METRICS_FLAG = "--enable-metrics"
METRICS_PREFIX = "sglang:"
# Sample names (a counter's with _total, a histogram's with _sum or _count) → short names. The verify cycles and
# tokens are counted when a request finishes, before its end-to-end latency is observed, so a snapshot that has seen
# a request's end has seen its counts.
SERVER_SAMPLES = {
    "sglang:e2e_request_latency_seconds_sum": "clock_e2e_s",
    "sglang:e2e_request_latency_seconds_count": "clock_requests",
    "sglang:time_to_first_token_seconds_sum": "clock_prefill_s",
    "sglang:time_to_first_token_seconds_count": "clock_first_tokens",
    "sglang:generation_tokens_total": "clock_generation_tokens",
    "sglang:spec_verify_calls_total": "spec_verify_calls",
}
FINISHED_REQUESTS = "clock_requests"
# Where SGLang declares them (0.5.17 to 0.5.23).
METRICS_MODULE = "sglang.srt.observability.metrics_collector"


class SGLangError(CellRefused):
    """A cell that SGLang cannot run as configured; the message names what to change."""


class RingNotBuilt(SGLangError):
    pass


def draft_backend(extra_args: Sequence[str]) -> str:
    """The draft attention backend a drafting arm runs with: the study's choice, else FlashInfer."""
    return flag_value(extra_args, DRAFT_BACKEND_FLAG) or DEFAULT_DRAFT_BACKEND


def speculative_args(
    arm: str, k: int, sink: int | None, window: int | None, extra_args: Sequence[str] = ()
) -> list[str]:
    """The speculative flags of an arm (empty for ``none``); ``extra_args`` are the study's serve_args."""
    owned = [flag for flag in ARM_FLAGS if has_flag(extra_args, flag)]
    if owned:
        raise SGLangError(
            f"engine/model/arm serve_args set {', '.join(owned)}, which the arm sets; remove them "
            "(the arm, k, sink and window of a cell decide them)"
        )
    if arm == "none":
        return []
    if arm == "wmtp-ring":
        raise RingNotBuilt(
            "arm 'wmtp-ring' on SGLang is not built yet: upstream SGLang windows the draft's "
            "reads (--speculative-draft-window-size) but has no compact ring buffer for the draft "
            "KV (and the vLLM plugin has none yet either); run arm 'wmtp'"
        )
    if arm not in ("mtp", "wmtp"):
        raise SGLangError(f"unknown arm {arm!r}")
    if k < 1:
        raise SGLangError(f"arm {arm!r} needs k ≥ 1 (got {k})")
    args = [
        "--speculative-algorithm",
        "NEXTN",
        "--speculative-num-steps",
        str(k),
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        str(k + 1),
    ]
    backend = draft_backend(extra_args)
    if not has_flag(extra_args, DRAFT_BACKEND_FLAG):
        args += [DRAFT_BACKEND_FLAG, backend]
    if arm == "wmtp":
        if backend not in (*WINDOW_BACKENDS, *PLUGIN_BACKENDS):
            raise SGLangError(
                f"arm 'wmtp': draft attention backend {backend!r} ignores the draft window; set "
                f"{DRAFT_BACKEND_FLAG} to one of {', '.join(WINDOW_BACKENDS)} (upstream's window) or "
                f"{', '.join(PLUGIN_BACKENDS)} (the SGLang plugin's) in the engine's or the arm's serve_args "
                "(or leave it out for FlashInfer)"
            )
        if window is None or window < 1:
            raise SGLangError(f"arm 'wmtp' needs a window ≥ 1 (got {window})")
        if sink is None or sink < 0:
            raise SGLangError(f"arm 'wmtp' needs a sink ≥ 0 (got {sink})")
        if backend in WINDOW_BACKENDS:
            args += [WINDOW_FLAGS[0], str(window), WINDOW_FLAGS[1], str(sink)]
    return args


def windowed_by_plugin(arm: str, extra_args: Sequence[str]) -> bool:
    """Whether the SGLang plugin, not upstream's flags, windows this arm's draft (its draft backend decides)."""
    return arm == "wmtp" and draft_backend(extra_args) in PLUGIN_BACKENDS


def _given_args(request: ServeRequest) -> list[str]:
    return [*request.engine_args, *request.model_args, *request.arm_args]


def full_attention_interval(layer_types: Sequence[str]) -> int | None:
    """The N for which layer i is full attention exactly when (i + 1) % N == 0, the one way SGLang's Qwen3-Next
    config places its full-attention layers (``layers_block_type`` from ``full_attention_interval``); None where
    ``layer_types`` follow no such pattern."""
    full = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    if not full:
        return None
    interval = full[0] + 1
    return interval if full == list(range(interval - 1, len(layer_types), interval)) else None


def config_overrides(config: Mapping[str, Any], source: str = "config.json") -> dict[str, Any]:
    """What SGLang needs added to a checkpoint's config: a Qwen3-Next written with transformers' ``layer_types``
    alone (the committed tiny checkpoint, the weightless dummies) gets the ``full_attention_interval`` SGLang
    reads; nothing for any other config. A ``layer_types`` that no interval describes is refused."""
    if config.get("model_type") != "qwen3_next" or "full_attention_interval" in config:
        return {}
    layer_types = config.get("layer_types")
    if not layer_types:
        return {}
    interval = full_attention_interval(layer_types)
    if interval is None:
        raise SGLangError(
            f"{source}: SGLang places a Qwen3-Next's full-attention layers every N layers "
            f"(full_attention_interval); layer_types {layer_types} follow no such pattern"
        )
    return {"full_attention_interval": interval}


def _override_args(extra: Sequence[str], model_dir: Path | str) -> list[str]:
    """``--json-model-override-args`` with the checkpoint's needs merged into the study's own overrides (a study's
    value for the same key must agree); nothing where neither has any."""
    config_path = Path(model_dir) / "config.json"
    needed = config_overrides(json.loads(config_path.read_text()), str(config_path)) if config_path.is_file() else {}
    if not needed:
        return []
    given_text = flag_value(extra, OVERRIDE_FLAG)
    given = json.loads(given_text) if given_text else {}
    clashing = {key: given[key] for key in needed if key in given and given[key] != needed[key]}
    if clashing:
        raise SGLangError(
            f"{OVERRIDE_FLAG} in serve_args sets {clashing}, where {config_path} needs {needed}; drop those keys"
        )
    return [OVERRIDE_FLAG, json.dumps({**given, **needed}, sort_keys=True)]


def serve_argv(request: ServeRequest) -> list[str]:
    """The server command as a list (never a shell string). A checkpoint whose config SGLang cannot read as it
    stands gets what it lacks through ``--json-model-override-args`` (``config_overrides``), after the study's own
    serve_args, so that the merged value is the one argparse keeps."""
    r = request
    given = _given_args(r)
    extra = [*given, *_override_args(given, r.model_dir)]
    argv = [
        r.python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(r.model_dir),
        "--served-model-name",
        r.served_name,
        "--host",
        r.host,
        "--port",
        str(r.port),
        "--context-length",
        str(r.max_model_len),
    ]
    draft = r.draft
    metrics = [] if has_flag(extra, METRICS_FLAG) else [METRICS_FLAG]
    return argv + metrics + extra + speculative_args(draft.arm, draft.k, draft.sink, draft.window, extra)


def server_env(
    engine_env: Mapping[str, str],
    work_dir: Path,
    tmp_dir: Path | None = None,
    request: ServeRequest | None = None,
) -> dict[str, str]:
    """Temporary files in ``tmp_dir``, kernel caches under ``work_dir`` (the cache directory the cell runner
    gives, shared by the cells of one engine), never the user's home. Where the SGLang plugin windows the
    request's draft, its settings, and where it reports what it windowed: the cell's own temporary directory."""
    env = dict(engine_env)
    tmp = tmp_dir or work_dir / "tmp"
    env.setdefault("TMPDIR", str(tmp))
    # The same folder names as the H200 runner's kernel caches (scripts/device/h200_background.sh), which it carries.
    env.setdefault("TRITON_CACHE_DIR", str(work_dir / "triton"))
    # SGLang's own JIT kernels (built with nvcc through TVM-FFI) go to ~/.cache/tvm-ffi unless told: a path under
    # the home directory, which XDG_CACHE_HOME does not move.
    env.setdefault("TVM_FFI_CACHE_DIR", str(work_dir / "tvm-ffi"))
    env.setdefault("XDG_CACHE_HOME", str(work_dir / "cache"))
    env.setdefault("DO_NOT_TRACK", "1")
    # Only the cell's draft decides whether the plugin windows: set empty otherwise, so that a value in the runner's
    # own environment, which the server inherits, never windows another arm.
    env[sglang_hookpoints.SETTINGS_ENV] = ""
    if request is not None and windowed_by_plugin(request.draft.arm, _given_args(request)):
        draft = request.draft
        env[sglang_hookpoints.SETTINGS_ENV] = json.dumps({"sink": draft.sink, "window": draft.window})
        env[plugin_stats.ENV] = str(tmp / "wmtp-stats")
    return env


def verify_windowed(server_env: Mapping[str, str], cell: Any, protocol: Any) -> dict[str, Any]:
    """A cell the SGLang plugin windowed: its counters; raises ``WindowNotApplied`` when the window never ran
    (SGLang only logs a plugin whose registration failed, and then serves plain MTP)."""
    if not server_env.get(sglang_hookpoints.SETTINGS_ENV):
        return {}
    return plugin_stats.cell_record(server_env.get(plugin_stats.ENV), cell, max(protocol.rungs))


def metric_families() -> set[str]:
    """The metrics :data:`SERVER_SAMPLES` reads, as SGLang's source declares them (a histogram without the suffix
    of its sample, a counter with ``_total``)."""
    return {name.removesuffix("_sum").removesuffix("_count") for name in SERVER_SAMPLES}


def server_counters(text: str) -> dict[str, float]:
    """The server's cumulative figures from its /metrics text (short names of :data:`SERVER_SAMPLES`, each summed
    over its labels), with ``clock_decode_s`` = end to end less time to first token where both are there."""
    found = summed(text, METRICS_PREFIX, SERVER_SAMPLES)
    if "clock_e2e_s" in found and "clock_prefill_s" in found:
        found["clock_decode_s"] = found["clock_e2e_s"] - found["clock_prefill_s"]
    return found


def read_counters(base_url: str) -> dict[str, float]:
    """The server's cumulative clock sums and counts (``server_counters``); raises where its metrics are off."""
    return server_counters(fetch_metrics(base_url))


def check_cell(spec: Any, engine_manifest: Mapping[str, Any], cell: Any, extra_args: Sequence[str] = ()) -> None:
    """Refuse, before a server starts, a cell this engine cannot run; the message says what to change.

    ``extra_args`` are the engine's, the model's and the arm's serve_args, as ``serve_argv`` gets them.
    """
    if getattr(spec, "device", "cuda") != "cuda":
        raise SGLangError(
            f"engine {spec.name!r}: SGLang cannot run on a CPU box (CUDA-only kernels); set "
            "device: cuda and run on a GPU machine, or use a vLLM engine"
        )
    if cell.arm == "wmtp-ring":
        speculative_args(cell.arm, cell.k, cell.sink, cell.window)  # raises RingNotBuilt
    versions = engine_manifest.get("versions") or {}
    if versions.get("prometheus_client") is False:
        raise SGLangError(
            f"engine {spec.name!r}: prometheus_client is not installed beside SGLang, and {METRICS_FLAG} (which the "
            "cells time and count requests by) needs it; add it to the engine's packages"
        )
    metrics = versions.get("server_metrics") or {}
    if metrics and not metrics.get("ok"):
        why = "; ".join(metrics.get("missing") or []) or metrics.get("error") or "?"
        raise SGLangError(
            f"engine {spec.name!r}: this SGLang does not export what the cells time and count a request by ({why}); "
            f"without them no cycle is timed on the server's clock and no verify cycle is counted on sglang "
            f"< {FIRST_WINDOWED_VERSION}"
        )
    if cell.arm == "wmtp" and windowed_by_plugin(cell.arm, extra_args):
        versions = engine_manifest.get("versions") or {}
        if cell.k < 2:
            raise SGLangError(
                f"arm 'wmtp' with k {cell.k} on the {draft_backend(extra_args)!r} draft: SGLang drafts one step "
                "without its multi-step draft backend, which is what the SGLang plugin windows (its first draft "
                "forward, the draft-extend, reads the full context); use k ≥ 2"
            )
        if versions.get("wmtp_plugin_registered") is False:
            raise SGLangError(
                f"engine {spec.name!r}: wmtp is not registered as an SGLang plugin (no entry point 'wmtp' in group "
                f"{sglang_hookpoints.PLUGINS_GROUP!r} where SGLang looks), so SGLang would serve plain MTP; install "
                "this checkout's wmtp beside SGLang (pip install, not a bare PYTHONPATH) and build the engine again"
            )
        hooks = versions.get("wmtp_hooks") or {}
        if not hooks.get("ok"):
            why = "; ".join(hooks.get("missing") or []) or hooks.get("error") or "the engine's probe did not check them"
            raise SGLangError(
                f"engine {spec.name!r}: the SGLang plugin cannot window the {draft_backend(extra_args)!r} draft of "
                f"sglang {versions.get('sglang', '?')} ({why}); install wmtp beside SGLang and build the engine "
                f"again, or pin sglang>={FIRST_WINDOWED_VERSION} with {DRAFT_BACKEND_FLAG} in "
                f"{', '.join(WINDOW_BACKENDS)} for upstream's window"
            )
    elif cell.arm == "wmtp":
        versions = engine_manifest.get("versions") or {}
        if versions.get("draft_window_flags") is False:
            raise SGLangError(
                f"engine {spec.name!r}: sglang {versions.get('sglang', '?')} lacks {' and '.join(WINDOW_FLAGS)} "
                f"(upstream PR #32673, first released in sglang {FIRST_WINDOWED_VERSION}); pin "
                f"sglang>={FIRST_WINDOWED_VERSION} for arm 'wmtp'"
            )
        backend = draft_backend(extra_args)
        honouring = versions.get("window_backends")
        if honouring is not None and backend not in honouring:
            raise SGLangError(
                f"engine {spec.name!r}: in sglang {versions.get('sglang', '?')} the {backend!r} draft "
                f"backend does not apply the draft window (only {honouring or 'none'} do); set "
                f"{DRAFT_BACKEND_FLAG} accordingly in the engine's or the arm's serve_args"
            )


# --- per-request spec-decode counts ------------------------------------------------------------------


def spec_details(extensions: Mapping[str, Any]) -> dict[str, Any]:
    """The spec-decode statistics of one response, from ``sglext.spec_tokens_details`` (OpenAI-compatible
    endpoints) or ``meta_info`` (native ``/generate``); empty when the server sent none (arm ``none``)."""
    details: Any = (extensions.get("sglext") or {}).get("spec_tokens_details")
    if details is None:
        details = extensions.get("meta_info") or {}
    if isinstance(details, list):  # n > 1 choices: one entry each; we always ask for one
        details = details[0] if details else {}
    return dict(details or {})


def request_fields(extensions: Mapping[str, Any]) -> dict[str, Any]:
    """Columns of requests.parquet for one response: verify cycles, correct drafts, accept histogram."""
    details = spec_details(extensions)
    verify = details.get("spec_verify_ct")
    correct = details.get("spec_num_correct_drafts")
    histogram = details.get("spec_correct_drafts_histogram")
    if histogram is None:
        histogram = details.get("spec_accept_histogram")  # older name
    # 0 is a count: an answer that ends at its first token (the prefill's) has had no verify cycle.
    return {
        "spec_verify_ct": int(verify) if verify is not None else None,
        "spec_correct_drafts": int(correct) if correct is not None and verify is not None else None,
        "spec_accept_histogram": [int(x) for x in histogram] if histogram else None,
    }


def _server_verify_count(
    rows: Sequence[Mapping[str, Any]], arm: str, server_delta: Mapping[str, float] | None, missing: int
) -> float:
    """The rung's verify cycles as the server counted them, where the responses carry none; raises where the
    server's count is missing or its tokens are not the rung's own."""
    where = f"rung {rows[0].get('rung')}"
    delta = server_delta or {}
    verify, tokens = delta.get("spec_verify_calls"), delta.get("clock_generation_tokens")
    if verify is None or tokens is None:
        raise SGLangError(
            f"{where}: {missing} of {len(rows)} responses carry no spec_verify_ct and the server counted no verify "
            f"cycles, so tokPerVerify cannot be computed; the server must run a draft (arm {arm!r}) with "
            f"{METRICS_FLAG}, or answer return_spec_tokens_details (sglang>={FIRST_WINDOWED_VERSION})"
        )
    completion = sum(int(r["completion_tokens"]) for r in rows)
    if tokens != completion:
        raise SGLangError(
            f"{where}: the server counted {tokens:g} generated tokens over the rung, its {len(rows)} measured "
            f"responses {completion}; another request ran on the server meanwhile, so its verify cycles are not "
            "the rung's"
        )
    return float(verify)


def counters_from_requests(
    rows: Sequence[Mapping[str, Any]], arm: str, k: int, server_delta: Mapping[str, float] | None = None
) -> dict[str, float]:
    """The rung's counters (short names, see the module docstring) from its measured request rows, or from the
    server's counts over the rung (``server_delta``: differences of ``read_counters``) where the rows have none."""
    out = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0}
    if arm == "none" or not rows:
        return out
    missing = [r for r in rows if r.get("spec_verify_ct") is None]
    completion = float(sum(r["completion_tokens"] for r in rows))
    if missing:
        verify = _server_verify_count(rows, arm, server_delta, len(missing))
        out.update(drafts=verify, draft_tokens=k * verify, accepted=completion - verify)
        return out
    verify = float(sum(r["spec_verify_ct"] for r in rows))
    out.update(drafts=verify, draft_tokens=k * verify, accepted=completion - verify)
    if all(r.get("spec_correct_drafts") is not None for r in rows):
        out["correct_drafts"] = float(sum(r["spec_correct_drafts"] for r in rows))
    # A response without a verify cycle has no histogram to give and adds nothing to one.
    histograms = [r.get("spec_accept_histogram") for r in rows if r["spec_verify_ct"] > 0]
    if histograms and all(h is not None and len(h) > 0 for h in histograms):
        for p in range(k):
            out[f"accepted_pos_{p}"] = float(sum(sum(h[p + 1 :]) for h in histograms))
    return out


# Runs inside the engine environment. Reads sglang's source rather than importing it (importing the
# server args pulls in torch and CUDA probes, and the engine rule runs on a cluster's login node), then
# confirms through the real argument parser when that import works.
VERSION_PROBE = (
    "import argparse, importlib.metadata as md, importlib.util, json, pathlib, sys\n"
    "info = {'python': sys.version.split()[0], 'sglang': md.version('sglang')}\n"
    "for dist in ('torch', 'transformers', 'flashinfer-python', 'sgl-kernel', 'sglang-kernel'):\n"
    "    try:\n"
    "        info[dist] = md.version(dist)\n"
    "    except md.PackageNotFoundError:\n"
    "        pass\n"
    "srt = pathlib.Path(next(iter(importlib.util.find_spec('sglang').submodule_search_locations))) / 'srt'\n"
    "args_src = [srt / 'server_args.py', *sorted((srt / 'arg_groups').rglob('*.py'))]\n"
    "text = '\\n'.join(p.read_text(errors='replace') for p in args_src if p.exists())\n"
    f"fields = {tuple(f[2:].replace('-', '_') for f in WINDOW_FLAGS)!r}\n"
    "info['draft_window_flags'] = all(f in text for f in fields)\n"
    "backends = {b: srt / 'layers' / 'attention' / f'{b}_backend.py' for b in ('triton', 'flashinfer')}\n"
    "info['window_backends'] = sorted(b for b, p in backends.items()\n"
    "                                 if p.exists() and 'resolve_draft_decode_window' in p.read_text())\n"
    f"plugins = md.entry_points(group={sglang_hookpoints.PLUGINS_GROUP!r})\n"
    "info['wmtp_plugin_registered'] = any(ep.name == 'wmtp' for ep in plugins)\n"
    "try:\n"
    "    from wmtp.engines.sglang_hooks import check_hook_points\n"
    "    info['wmtp_hooks'] = check_hook_points(srt.parent)\n"
    "except Exception as err:\n"
    "    info['wmtp_hooks'] = {'ok': False, 'error': repr(err)[:300]}\n"
    "info['prometheus_client'] = importlib.util.find_spec('prometheus_client') is not None\n"
    "try:\n"
    "    from wmtp.engines.sglang_hooks import check_metrics\n"
    "    info['server_metrics'] = check_metrics(srt.parent)\n"
    "except Exception as err:\n"
    "    info['server_metrics'] = {'ok': False, 'error': repr(err)[:300]}\n"
    "try:\n"
    "    from sglang.srt import server_args as sa\n"
    "    parser = argparse.ArgumentParser()\n"
    "    sa.ServerArgs.add_cli_args(parser)\n"
    "    options = {o for action in parser._actions for o in action.option_strings}\n"
    f"    info['draft_window_flags_cli'] = all(f in options for f in {WINDOW_FLAGS!r})\n"
    "except Exception as err:\n"
    "    info['cli_check_error'] = repr(err)[:300]\n"
    "print('WMTP-PROBE ' + json.dumps(info))\n"
)


class SGLangAdapter(EngineAdapter):
    kind = "sglang"
    health_path = HEALTH_PATH
    version_probe = VERSION_PROBE
    request_extra = REQUEST_EXTRA
    token_request_fields = TOKEN_REQUEST_FIELDS
    finished_requests_counter = FINISHED_REQUESTS
    cache_env = ("TRITON_CACHE_DIR", "TVM_FFI_CACHE_DIR", "XDG_CACHE_HOME")

    def serve_argv(self, request: ServeRequest) -> list[str]:
        return serve_argv(request)

    def server_env(
        self, engine_env: Mapping[str, str], work_dir: Path, tmp_dir: Path, request: ServeRequest | None = None
    ) -> dict[str, str]:
        return server_env(engine_env, work_dir, tmp_dir, request)

    def verify_cell(self, run_dir: Path, server_env: Mapping[str, str], cell: Any, protocol: Any) -> dict[str, Any]:
        return verify_windowed(server_env, cell, protocol)

    def read_counters(self, base_url: str) -> dict[str, float]:
        return read_counters(base_url)

    def check_cell(self, spec: Any, engine_manifest: Mapping[str, Any], cell: Any, extra_args: Sequence[str]) -> None:
        check_cell(spec, engine_manifest, cell, extra_args)

    def request_fields(self, extensions: Mapping[str, Any]) -> dict[str, Any]:
        return request_fields(extensions)

    def counters_from_requests(
        self,
        rows: Sequence[Mapping[str, Any]],
        arm: str,
        k: int,
        server_delta: Mapping[str, float] | None = None,
    ) -> dict[str, float]:
        return counters_from_requests(rows, arm, k, server_delta)
