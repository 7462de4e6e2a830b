"""One real vLLM CPU server of a tiny checkpoint: started, read by its readers in turn, stopped.

A server start costs about a minute on two cores, so tests that need the same arm of the same checkpoint read one
server (tests/conftest.py, ``trained_none``) rather than each start their own.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from conftest import ENGINE_NAME, REPO, engines_dir

MAX_MODEL_LEN = 2048

# A reader gets the server's base URL and the plugin's control directory (wmtp.plugin.testing).
Reader = Callable[[str, Path], Any]


def serve(
    python: str,
    arm: str,
    model_dir: Path,
    work: Path,
    readers: Sequence[Reader],
    k: int = 0,
    sink: int | None = None,
    window: int | None = None,
) -> list[Any]:
    """Start one server of the embedded study's engine, run ``readers`` in order, stop it; what each returned."""
    import yaml

    from wmtp.config import study_from_dict
    from wmtp.engines import ServeRequest, vllm
    from wmtp.layout import Draft
    from wmtp.measure.server import ServerProcess, free_port, group_alive

    study = study_from_dict(yaml.safe_load((REPO / "config" / "config.yaml").read_text()), base_dir=REPO)
    spec = study.engine(ENGINE_NAME)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = vllm.serve_argv(
        ServeRequest(
            python,
            model_dir,
            "tiny",
            port,
            max_model_len=MAX_MODEL_LEN,
            draft=Draft(arm=arm, k=k, sink=sink, window=window),
            engine_args=spec.serve_args,
        )
    )
    short_tmp = Path(tempfile.mkdtemp(prefix="wmtp-ts-"))
    # The engine's own cache, as every cell's server gets it (wmtp.cli): vLLM keeps what it learned of a model class
    # there, which a fresh cache pays for with a subprocess that imports vLLM again at every start.
    env = vllm.server_env(spec.env, engines_dir() / ENGINE_NAME / "cache", short_tmp)
    control_dir = work / f"control-{arm}"
    control_dir.mkdir(parents=True, exist_ok=True)
    env["WMTP_PLUGIN_TEST_DIR"] = str(control_dir)
    server = ServerProcess(argv, env, work / f"server-{arm}.log", base)
    try:
        server.start()
        server.wait_healthy(600)
        results = [read(base, control_dir) for read in readers]
    finally:
        server.stop()
        shutil.rmtree(short_tmp, ignore_errors=True)
    assert not group_alive(server.pid)
    return results
