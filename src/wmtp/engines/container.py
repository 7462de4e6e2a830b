"""Engines from a container image: the serve argv wrapped for Docker (a DGX Spark) or Apptainer/Singularity
(a SLURM cluster), the image digest for the manifest, and the self-check run inside the image.

Everything here builds argv lists; nothing runs a container except ``image_digest`` and ``probe``.

* Paths keep their host names inside the container: the repository, the model directory and the cell's
  work directory are bind-mounted at the same absolute paths, so the adapter's serve argv (model path,
  caches, TMPDIR) is valid on both sides and needs no rewriting.
* The wmtp plugin must be importable inside the image. ``install="pythonpath"`` (default) puts the
  repository's ``src`` on ``PYTHONPATH`` together with a generated ``wmtp-<version>.dist-info`` that
  declares the ``vllm.general_plugins`` entry point, so vLLM discovers the plugin without a pip install
  (works on read-only Apptainer images). ``install="pip"`` instead runs ``pip install --no-deps
  --no-build-isolation --target <work>/wmtp-site <repo>`` when the container starts, then execs the
  server.
* GPUs: Docker gets ``--gpus all`` (or ``device=0,1``); Apptainer gets ``--nv`` and inherits
  ``CUDA_VISIBLE_DEVICES`` from the SLURM job, so a job only sees the GPUs it was given.
* Network: Apptainer shares the host's network, so the server's ``--port`` is the port. Docker uses
  ``--network host`` by default; with ``network="bridge"`` the port is published on 127.0.0.1 and the
  server binds 0.0.0.0 inside the container.
* Stopping: ``docker run`` forwards SIGTERM to the container (``--init`` passes it on to the server) and
  ``--rm`` removes it; a container whose client was SIGKILLed keeps running, so ``stop_argv`` gives
  the command that removes it by name.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from wmtp.layout import REPO_ROOT

Runtime = Literal["docker", "apptainer"]
PROBE_PREFIX = "WMTP-PROBE "


class ContainerError(RuntimeError):
    pass


def runtime_binary(runtime: str) -> str:
    """The command for a runtime: ``apptainer`` also drives a site that only has ``singularity``."""
    if runtime == "docker":
        return "docker"
    if runtime == "apptainer":
        if shutil.which("apptainer") or not shutil.which("singularity"):
            return "apptainer"
        return "singularity"
    raise ContainerError(f"unknown container runtime {runtime!r}; use docker or apptainer")


def default_runtime(image: str) -> Runtime:
    """Apptainer for .sif files and apptainer-style URIs, Docker otherwise."""
    if image.endswith(".sif") or image.split("://", 1)[0] in ("library", "oras", "shub"):
        return "apptainer"
    return "docker"


# --- the wmtp plugin inside the image -----------------------------------------------------------------


def plugin_site(site_dir: Path, repo: Path = REPO_ROOT) -> Path:
    """Write a minimal ``wmtp-<version>.dist-info`` whose entry points match pyproject.toml.

    With ``site_dir`` and ``<repo>/src`` on PYTHONPATH, ``import wmtp`` works and
    ``importlib.metadata.entry_points(group='vllm.general_plugins')`` lists ``wmtp``.
    """
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    info = site_dir / f"{name}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = []
    for group, entries in sorted(project.get("entry-points", {}).items()):
        lines.append(f"[{group}]")
        lines += [f"{key} = {value}" for key, value in sorted(entries.items())]
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))
    (info / "top_level.txt").write_text(f"{name}\n")
    return site_dir


def _pythonpath(site_dir: Path, repo: Path, env: Mapping[str, str]) -> str:
    parts = [str(site_dir), str(repo / "src")]
    if env.get("PYTHONPATH"):
        parts.append(env["PYTHONPATH"])
    return ":".join(parts)


def _pip_start(argv: Sequence[str]) -> list[str]:
    """Install wmtp into the (bind-mounted, writable) site dir when the container starts, then exec argv."""
    script = (
        '"$WMTP_PIP_PYTHON" -m pip install --quiet --no-deps --no-build-isolation --target "$WMTP_SITE" '
        '"$WMTP_REPO" && exec "$@"'
    )
    return ["sh", "-c", script, "wmtp-start", *argv]


def _with_host(argv: Sequence[str], host: str) -> list[str]:
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg == "--host":
            out[i + 1] = host
    return out


def wrap_argv(
    argv: Sequence[str],
    *,
    runtime: Runtime,
    image: str,
    work_dir: Path,
    model_dir: Path | None = None,
    repo: Path = REPO_ROOT,
    env: Mapping[str, str] | None = None,
    gpus: str | Sequence[int] | None = "all",
    name: str | None = None,
    network: Literal["host", "bridge"] = "host",
    port: int | None = None,
    install: Literal["pythonpath", "pip"] = "pythonpath",
    binary: str | None = None,
    extra_binds: Sequence[Path] = (),
) -> list[str]:
    """``argv`` (the engine's serve or probe command) run inside ``image``.

    ``gpus``: ``"all"``, GPU indices, or ``None`` (no GPU, e.g. the self-check on a login node).
    ``env`` is set inside the container (with PYTHONPATH for the plugin added). The caller creates
    ``work_dir`` (``plugin_site`` writes into it for the default install). ``extra_binds`` are more
    host directories the server writes to (its TMPDIR), mounted read-write at the same path.
    """
    repo, work_dir = repo.resolve(), work_dir.resolve()
    site_dir = work_dir / "wmtp-site"
    inner_env = dict(env or {})
    inner_env["PYTHONPATH"] = _pythonpath(site_dir, repo, inner_env)
    inner = list(argv)
    if install == "pip":
        inner_env.update(WMTP_SITE=str(site_dir), WMTP_REPO=str(repo), WMTP_PIP_PYTHON=inner[0])
        inner = _pip_start(inner)
    binds = [(repo, repo, "ro"), (work_dir, work_dir, "rw")]
    if model_dir is not None:
        binds.append((model_dir.resolve(), model_dir.resolve(), "ro"))
    binds += [(Path(p).resolve(), Path(p).resolve(), "rw") for p in extra_binds]
    exe = binary or runtime_binary(runtime)
    if runtime == "docker":
        out = [exe, "run", "--rm", "--init", "--ipc=host"]
        if name:
            out += ["--name", name]
        if gpus is not None:
            out += ["--gpus", gpus if isinstance(gpus, str) else f"device={','.join(str(g) for g in gpus)}"]
        if network == "host":
            out += ["--network", "host"]
        else:
            if port is None:
                raise ContainerError("network 'bridge' needs the server's port to publish it")
            out += ["-p", f"127.0.0.1:{port}:{port}"]
            inner = _with_host(inner, "0.0.0.0")
        for src, dst, mode in binds:
            out += ["-v", f"{src}:{dst}:{mode}"]
        for key, value in sorted(inner_env.items()):
            out += ["-e", f"{key}={value}"]
        out += ["-w", str(work_dir), image]
        return out + inner
    if runtime == "apptainer":
        out = [exe, "exec"]
        if gpus is not None:
            out.append("--nv")
        for src, dst, mode in binds:
            out += ["--bind", f"{src}:{dst}:{mode}"]
        for key, value in sorted(inner_env.items()):
            out += ["--env", f"{key}={value}"]
        out += ["--pwd", str(work_dir), image]
        return out + inner
    raise ContainerError(f"unknown container runtime {runtime!r}; use docker or apptainer")


def stop_argv(runtime: Runtime, name: str, binary: str | None = None) -> list[str] | None:
    """The command that removes a named Docker container left behind (Apptainer has nothing to remove)."""
    if runtime == "docker":
        return [binary or "docker", "rm", "--force", name]
    return None


# --- image digest and self-check ----------------------------------------------------------------------


def inspect_argv(runtime: Runtime, image: str, binary: str | None = None) -> list[str]:
    exe = binary or runtime_binary(runtime)
    if runtime == "docker":
        return [exe, "image", "inspect", "--format", "{{json .}}", image]
    return [exe, "inspect", "--json", image]


def parse_docker_inspect(text: str) -> dict:
    """The image id and repo digests from ``docker image inspect --format '{{json .}}'``."""
    data = json.loads(text.strip().splitlines()[0])
    if isinstance(data, list):
        data = data[0]
    digests = data.get("RepoDigests") or []
    return {
        "digest": digests[0] if digests else data.get("Id"),
        "image_id": data.get("Id"),
        "repo_digests": digests,
        "created": data.get("Created"),
    }


def parse_apptainer_inspect(text: str) -> dict:
    """Labels of ``apptainer inspect --json`` (the build date, the base image's digest when recorded)."""
    data = json.loads(text)
    attrs = (data.get("data") or {}).get("attributes") or data.get("attributes") or {}
    labels = attrs.get("labels") or {}
    return {"labels": labels}


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return "sha256:" + digest.hexdigest()


def image_digest(runtime: Runtime, image: str, binary: str | None = None) -> dict:
    """What identifies the image, for the manifest: Docker's repo digest (or image id), a .sif's sha256.

    Never raises: a runtime that is missing or fails leaves ``digest`` None and says why in ``error``.
    """
    out: dict = {"runtime": runtime, "image": image, "digest": None}
    if runtime == "apptainer" and Path(image).is_file():
        out["digest"] = file_sha256(Path(image))
        out["how"] = "sha256 of the image file"
    exe = binary or runtime_binary(runtime)
    if not shutil.which(exe):
        out.setdefault("error", f"{exe} is not on PATH")
        return out
    try:
        proc = subprocess.run(
            inspect_argv(runtime, image, exe), capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.SubprocessError) as err:
        out["error"] = f"{exe} inspect failed: {err!r}"
        return out
    if proc.returncode != 0:
        out["error"] = f"{exe} inspect exited {proc.returncode}: {proc.stderr.strip()[-300:]}"
        return out
    try:
        if runtime == "docker":
            out.update(parse_docker_inspect(proc.stdout), how="docker image inspect")
        else:
            out.update(parse_apptainer_inspect(proc.stdout))
    except (ValueError, KeyError, IndexError) as err:
        out["error"] = f"could not read {exe} inspect output: {err!r}"
    return out


def parse_probe(stdout: str) -> dict | None:
    for line in stdout.splitlines():
        if line.startswith(PROBE_PREFIX):
            return json.loads(line[len(PROBE_PREFIX) :])
    return None


def probe(
    probe_source: str,
    *,
    runtime: Runtime,
    image: str,
    work_dir: Path,
    env: Mapping[str, str],
    python: str = "python3",
    repo: Path = REPO_ROOT,
    timeout_s: float = 900.0,
) -> dict:
    """Run the adapter's VERSION_PROBE inside the image (no GPU needed); raise with the output's tail."""
    work_dir.mkdir(parents=True, exist_ok=True)
    plugin_site(work_dir.resolve() / "wmtp-site", repo)
    argv = wrap_argv(
        [python, "-c", probe_source], runtime=runtime, image=image, work_dir=work_dir, repo=repo, env=env, gpus=None
    )
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    info = parse_probe(proc.stdout)
    if info is None:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise ContainerError(f"engine self-check failed inside {image} (exit {proc.returncode}):\n{tail}")
    return info


def serve_command(
    spec, argv: Sequence[str], *, model_dir: Path, work_dir: Path, port: int, env: Mapping[str, str]
) -> list[str]:
    """The serve argv of a cell whose engine comes from ``spec.image`` (GPUs: all that the job sees)."""
    runtime: Runtime = spec.container_runtime or default_runtime(spec.image)
    work_dir = work_dir.resolve()
    plugin_site(work_dir / "wmtp-site")
    tmp = [Path(env["TMPDIR"])] if env.get("TMPDIR", "").startswith("/") else []
    return wrap_argv(
        argv,
        runtime=runtime,
        image=spec.image,
        work_dir=work_dir,
        model_dir=Path(model_dir),
        env=env,
        name=f"wmtp-{port}",
        port=port,
        extra_binds=tmp,
    )


def engine_manifest(spec, engine_dir: Path, build_hash: str) -> dict:
    """The manifest of a container engine: the image and its digest, and the self-check's answer."""
    from wmtp.engines import adapter

    runtime: Runtime = spec.container_runtime or default_runtime(spec.image)
    exe = runtime_binary(runtime)
    if not shutil.which(exe):
        raise ContainerError(
            f"engine {spec.name!r}: the container runtime {exe!r} is not on PATH here; install "
            f"it, or build the engine where it is (the image is {spec.image})"
        )
    started = time.time()
    digest = image_digest(runtime, spec.image, exe)
    python = spec.python or "python3"
    info = probe(
        adapter(spec.kind).version_probe,
        runtime=runtime,
        image=spec.image,
        work_dir=engine_dir / "probe",
        env=spec.env,
        python=python,
    )
    return {
        "engine": spec.name,
        "kind": spec.kind,
        "source": "container",
        "spec": spec.model_dump(mode="json"),
        "build_hash": build_hash,
        "python": python,
        "container": {**digest, "binary": exe},
        "versions": info,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "build_seconds": round(time.time() - started, 1),
    }
