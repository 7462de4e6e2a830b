"""Engines from a container image: argv construction, the plugin made importable, the image digest, and the
engine build through a stand-in ``docker`` (no container runtime runs here)."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from wmtp.config import REPO_ROOT, EngineSpec
from wmtp.engines import container
from wmtp.engines.build import build_engine

FAKE_SGLANG = Path(__file__).parent / "fixtures" / "sglang" / "fake_site"
SERVE = ["python3", "-m", "sglang.launch_server", "--model-path", "/m/q", "--host", "127.0.0.1", "--port", "8123"]


def _pairs(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]


def test_docker_argv(tmp_path):
    model = tmp_path / "model"
    argv = container.wrap_argv(
        SERVE,
        runtime="docker",
        image="nvcr.io/nvidia/vllm:26.09",
        work_dir=tmp_path / "w",
        model_dir=model,
        env={"HF_HUB_OFFLINE": "1"},
        name="wmtp-8123",
        binary="docker",
    )
    assert argv[:5] == ["docker", "run", "--rm", "--init", "--ipc=host"]
    assert _pairs(argv, "--gpus") == ["all"] and _pairs(argv, "--network") == ["host"]
    assert _pairs(argv, "--name") == ["wmtp-8123"]
    repo, work, m = REPO_ROOT.resolve(), (tmp_path / "w").resolve(), model.resolve()
    assert set(_pairs(argv, "-v")) == {f"{repo}:{repo}:ro", f"{work}:{work}:rw", f"{m}:{m}:ro"}
    env = dict(e.split("=", 1) for e in _pairs(argv, "-e"))
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["PYTHONPATH"].split(":") == [str(work / "wmtp-site"), str(repo / "src")]
    image_at = argv.index("nvcr.io/nvidia/vllm:26.09")
    assert argv[image_at + 1 :] == SERVE  # the serve argv unchanged: paths keep their host names


def test_docker_bridge_publishes_the_port_and_binds_all_interfaces(tmp_path):
    argv = container.wrap_argv(
        SERVE,
        runtime="docker",
        image="img",
        work_dir=tmp_path,
        network="bridge",
        port=8123,
        gpus=[0, 2],
        binary="docker",
    )
    assert _pairs(argv, "-p") == ["127.0.0.1:8123:8123"] and "--network" not in argv
    assert _pairs(argv, "--gpus") == ["device=0,2"]
    assert _pairs(argv[argv.index("img") :], "--host") == ["0.0.0.0"]
    with pytest.raises(container.ContainerError, match="needs the server's port"):
        container.wrap_argv(SERVE, runtime="docker", image="img", work_dir=tmp_path, network="bridge")


def test_apptainer_argv(tmp_path):
    argv = container.wrap_argv(
        SERVE,
        runtime="apptainer",
        image="/images/sglang-0.5.21.sif",
        work_dir=tmp_path,
        model_dir=tmp_path / "m",
        env={"A": "b c"},
        binary="apptainer",
    )
    assert argv[:3] == ["apptainer", "exec", "--nv"]
    assert len(_pairs(argv, "--bind")) == 3
    assert "A=b c" in _pairs(argv, "--env")
    assert "--cleanenv" not in argv  # CUDA_VISIBLE_DEVICES from the SLURM job must reach the server
    assert argv[argv.index("/images/sglang-0.5.21.sif") + 1 :] == SERVE
    no_gpu = container.wrap_argv(
        ["python3", "-V"], runtime="apptainer", image="x.sif", work_dir=tmp_path, gpus=None, binary="apptainer"
    )
    assert "--nv" not in no_gpu


def test_serve_command_of_a_cell(tmp_path):
    spec = EngineSpec(name="v", kind="vllm", source="container", image="nvcr.io/nvidia/vllm:26.09")
    env = {"TMPDIR": str(tmp_path / "t"), "VLLM_CACHE_ROOT": str(tmp_path / "cache" / "vllm")}
    argv = container.serve_command(
        spec, SERVE, model_dir=tmp_path / "m", work_dir=tmp_path / "cache", port=8123, env=env
    )
    assert argv[0] == "docker" and _pairs(argv, "--name") == ["wmtp-8123"]
    t = (tmp_path / "t").resolve()
    assert f"{t}:{t}:rw" in _pairs(argv, "-v")  # the server's TMPDIR exists inside too
    assert (tmp_path / "cache" / "wmtp-site").is_dir()


def test_pip_install_at_start(tmp_path):
    argv = container.wrap_argv(SERVE, runtime="docker", image="img", work_dir=tmp_path, install="pip", binary="docker")
    tail = argv[argv.index("img") + 1 :]
    assert tail[:2] == ["sh", "-c"] and "pip install" in tail[2] and 'exec "$@"' in tail[2]
    assert tail[4:] == SERVE
    env = dict(e.split("=", 1) for e in _pairs(argv, "-e"))
    assert env["WMTP_REPO"] == str(REPO_ROOT.resolve()) and env["WMTP_PIP_PYTHON"] == "python3"


def test_runtime_binary_falls_back_to_singularity(tmp_path, monkeypatch):
    fake = tmp_path / "singularity"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert container.runtime_binary("apptainer") == "singularity"
    assert container.default_runtime("/x/y.sif") == "apptainer"
    assert container.default_runtime("nvcr.io/nvidia/vllm:26.09") == "docker"
    assert container.stop_argv("docker", "wmtp-1") == ["docker", "rm", "--force", "wmtp-1"]


def test_plugin_site_makes_the_entry_point_visible_without_pip(tmp_path):
    site = container.plugin_site(tmp_path / "site")
    code = (
        "import importlib.metadata as md, importlib.util, json; "
        "eps = [e.value for e in md.entry_points(group='vllm.general_plugins') if e.name == 'wmtp']; "
        "print(json.dumps([eps, importlib.util.find_spec('wmtp.plugin').origin]))"
    )
    # -S: no site-packages, so only PYTHONPATH can provide wmtp (as in an image without it installed).
    out = subprocess.run(
        [sys.executable, "-S", "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": f"{site}:{REPO_ROOT / 'src'}"},
    ).stdout
    eps, origin = json.loads(out)
    assert eps == ["wmtp.plugin:register"]
    assert origin.startswith(str(REPO_ROOT / "src"))


def test_docker_inspect_parsing_and_sif_digest(tmp_path):
    text = json.dumps({"Id": "sha256:abc", "RepoDigests": ["lmsysorg/sglang@sha256:def"], "Created": "2026-09-01"})
    parsed = container.parse_docker_inspect(text)
    assert parsed["digest"] == "lmsysorg/sglang@sha256:def" and parsed["image_id"] == "sha256:abc"
    assert container.parse_docker_inspect(json.dumps({"Id": "sha256:local"}))["digest"] == "sha256:local"
    sif = tmp_path / "e.sif"
    sif.write_bytes(b"not really an image")
    out = container.image_digest("apptainer", str(sif), binary=str(tmp_path / "no-such-apptainer"))
    assert out["digest"] == "sha256:" + hashlib.sha256(b"not really an image").hexdigest()
    assert "not on PATH" in out["error"]
    assert container.inspect_argv("docker", "img", "docker")[:3] == ["docker", "image", "inspect"]
    assert container.inspect_argv("apptainer", "e.sif", "apptainer") == ["apptainer", "inspect", "--json", "e.sif"]


FAKE_DOCKER = textwrap.dedent('''\
    #!{python}
    """Stand-in docker for tests: answers `image inspect`, runs `run ... IMAGE CMD` on the host with -e env."""
    import json, os, subprocess, sys
    args = sys.argv[1:]
    if args[:2] == ["image", "inspect"]:
        print(json.dumps({{"Id": "sha256:feed", "RepoDigests": ["example/sglang@sha256:beef"]}}))
        sys.exit(0)
    assert args[0] == "run", args
    env, i = {{"PATH": os.environ["PATH"]}}, 1
    takes_value = {{"--name", "--gpus", "--network", "-p", "-v", "-w"}}
    while args[i].startswith("-"):
        if args[i] == "-e":
            key, _, value = args[i + 1].partition("=")
            env[key] = value
        i += 2 if args[i] in takes_value | {{"-e"}} else 1
    sys.exit(subprocess.run(args[i + 1:], env=env).returncode)
''')


def test_build_engine_from_an_image_records_its_digest(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    docker = bin_dir / "docker"
    docker.write_text(FAKE_DOCKER.format(python=sys.executable))
    docker.chmod(docker.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    spec = EngineSpec(
        name="sg",
        kind="sglang",
        source="container",
        image="example/sglang:v0.5.21",
        container_runtime="docker",
        python=sys.executable,
        env={"PYTHONPATH": str(FAKE_SGLANG)},
    )
    manifest = build_engine(spec, tmp_path / "engines" / "sg")
    assert manifest["container"]["digest"] == "example/sglang@sha256:beef"
    assert manifest["container"]["image_id"] == "sha256:feed"
    assert manifest["versions"]["sglang"] == "0.5.21" and manifest["versions"]["draft_window_flags"] is True
    on_disk = json.loads((tmp_path / "engines" / "sg" / "manifest.json").read_text())
    assert on_disk["container"]["digest"] == "example/sglang@sha256:beef"


def test_build_engine_without_the_runtime_says_so(tmp_path, monkeypatch):
    from wmtp.engines.build import EngineBuildError

    monkeypatch.setenv("PATH", str(tmp_path))
    spec = EngineSpec(name="sg", kind="sglang", source="container", image="x.sif", container_runtime="apptainer")
    with pytest.raises(EngineBuildError, match="'apptainer' is not on PATH"):
        build_engine(spec, tmp_path / "e")
