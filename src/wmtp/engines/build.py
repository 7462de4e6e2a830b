"""Build (or adopt) an engine environment, install wmtp into it, smoke-check it, write its manifest.

A venv build is keyed by a hash of what it installs; when the manifest on disk carries the same hash
and the interpreter still answers the probe, nothing is done. The probe imports the engine, checks
that our plugin's entry point is registered and that the hook points it patches exist.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

from wmtp.config import EngineSpec
from wmtp.engines import adapter
from wmtp.layout import REPO_ROOT, TRAINED_CHECKPOINT

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"


class EngineBuildError(RuntimeError):
    pass


def spec_hash(spec: EngineSpec) -> str:
    """The whole engine spec as a hash: part of every cell's identity, so any change to it reruns the cells."""
    return _hash(spec.model_dump(mode="json"), spec)


# What only shapes how a server is started, never what is installed: a change reruns the cells, not the build.
SERVE_ONLY_KEYS = ("serve_args", "allow_remote")


def build_spec(spec: EngineSpec) -> dict:
    """The spec less its serve-only keys: what an engine's environment is built and checked from."""
    return {k: v for k, v in spec.model_dump(mode="json").items() if k not in SERVE_ONLY_KEYS}


def build_hash(spec: EngineSpec) -> str:
    """The hash of :func:`build_spec`: an engine environment is rebuilt (or re-checked) only when it changes."""
    return _hash(build_spec(spec), spec)


def _hash(payload: dict, spec: EngineSpec) -> str:
    constraints = (REPO_ROOT / spec.constraints).read_text() if spec.constraints else ""
    text = json.dumps({"spec": payload, "wmtp_src": str(REPO_ROOT), "constraints": constraints}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_built_as(manifest: dict, spec: EngineSpec) -> None:
    """Refuse an engine build whose manifest was written for another build spec than the study's (a build left over
    from an earlier study file, its record of why it would rebuild lost): measuring with it would file its
    numbers under the study's engine. Serve arguments are not part of a build."""
    if manifest.get("build_hash") is None:  # a manifest from before build hashes: its whole spec must match
        check_build_hash(manifest, spec_hash(spec), key="spec_hash")
    else:
        check_build_hash(manifest, build_hash(spec))


def check_build_hash(manifest: dict, expected: str, key: str = "build_hash") -> None:
    """Refuse a manifest whose recorded build hash (``key``) is not ``expected``."""
    built = manifest.get(key)
    if built != expected:
        raise EngineBuildError(
            f"engine {manifest.get('engine')!r} was built from spec {built}, but the study describes spec "
            f"{expected}: rebuild it (snakemake --forcerun engine) before measuring with it"
        )


def engine_python(spec: EngineSpec, engine_dir: Path) -> str:
    """The interpreter that runs this engine's server."""
    if spec.source == "python":
        # A bare name (python3) is resolved here, on the machine that runs the engine: the probe runs with a PATH
        # of /usr/bin:/bin only, and the manifest records the interpreter that really served.
        return shutil.which(str(spec.python)) or str(spec.python)
    if spec.source == "container":
        return "python3"  # inside the image
    return str(engine_dir / "venv" / "bin" / "python")


def _run(argv: list[str], log_file, what: str) -> None:
    log.info("%s: %s", what, " ".join(argv))
    log_file.write(f"\n$ {' '.join(argv)}\n")
    log_file.flush()
    proc = subprocess.run(argv, stdout=log_file, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        raise EngineBuildError(f"{what} failed (exit {proc.returncode}); see {log_file.name}")


def _find_base_python(version: str) -> str:
    for name in (f"python{version}", "python3" if sys.version.startswith(version) else None):
        if name and (found := shutil.which(name)):
            return found
    if sys.version.startswith(version):
        return sys.executable
    raise EngineBuildError(
        f"engine needs Python {version}, but no python{version} is on PATH; install it "
        "or set engines[].python_version to one that is"
    )


def _run_marked(python: str, spec: EngineSpec, argv: list[str], marker: str, timeout_s: int) -> tuple[dict | None, str]:
    """Run ``python argv`` with the engine's env; the JSON after ``marker`` on stdout, else the output's tail."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), **spec.env}
    proc = subprocess.run([python, *argv], capture_output=True, text=True, env=env, check=False, timeout=timeout_s)
    for line in proc.stdout.splitlines():
        if line.startswith(marker):
            return json.loads(line[len(marker) :]), ""
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    return None, f"(exit {proc.returncode}):\n{tail}"


def probe(python: str, spec: EngineSpec) -> dict:
    """Import the engine inside its environment; check plugin entry point and hook points."""
    found, failure = _run_marked(python, spec, ["-c", adapter(spec.kind).version_probe], "WMTP-PROBE ", 600)
    if found is None:
        raise EngineBuildError(f"engine self-check failed in {python} {failure}")
    return found


# A checkpoint of the hybrid MTP family the plugin windows, small enough to serve in seconds on a CPU.
SELFCHECK_MODEL = TRAINED_CHECKPOINT


def behaviour_check(python: str, spec: EngineSpec, info: dict) -> dict:
    """Run one windowed draft in the engine and require the plugin to count it (vLLM on the CPU only).

    The hook check reads source; this proves the hook is on the path that runs. It needs a model the
    engine can serve in seconds, which on a GPU box is left to the first ``wmtp`` cell's own check.
    """
    if spec.kind != "vllm" or spec.device != "cpu":
        return {"status": "not run", "why": "runs for vLLM on the CPU; on a GPU every wmtp cell checks its counters"}
    if info.get("hook_points_refused"):
        return {"status": "not run", "why": "the hook check refused this vLLM"}
    log.info("self-check: one windowed draft on %s", SELFCHECK_MODEL.name)
    argv = ["-m", "wmtp.plugin.selfcheck", "--model", str(SELFCHECK_MODEL)]
    found, failure = _run_marked(python, spec, argv, "WMTP-SELFCHECK ", 900)
    if found is None:
        raise EngineBuildError(f"engine self-check: the windowed draft did not run in {python} {failure}")
    return {"status": "passed", **found}


# What the self-checks cover: a manifest written by older checks is re-checked (no reinstall), and the
# engine rule passes it as a parameter, so a newer check reruns the rule.
CHECKS_VERSION = 5


def build_engine(spec: EngineSpec, engine_dir: Path, force: bool = False, windowed: bool = False) -> dict:
    """Make the engine environment usable and return its manifest (also written to engine_dir).

    ``windowed``: the study runs ``wmtp`` or ``wmtp-ring`` on this engine, so a vLLM that fails the hook check
    fails the build; otherwise it is recorded and the engine serves ``none`` and ``mtp``.
    """
    engine_dir = engine_dir.resolve()
    engine_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = engine_dir / MANIFEST
    want = build_hash(spec)
    python = engine_python(spec, engine_dir)
    if manifest_path.exists() and not force:
        old = json.loads(manifest_path.read_text())
        current = old.get("checks_version") == CHECKS_VERSION
        refused = (old.get("versions") or {}).get("hook_points_refused")
        if old.get("build_hash") == want and Path(python).exists() and current and not (windowed and refused):
            log.info("engine %s is up to date (%s)", spec.name, engine_dir)
            return old
    if spec.source == "container":  # nothing to install: record the image digest and self-check inside it
        from wmtp.engines.container import ContainerError
        from wmtp.engines.container import engine_manifest as container_manifest

        try:
            manifest = container_manifest(spec, engine_dir, want)
        except ContainerError as err:
            raise EngineBuildError(str(err)) from None
        manifest_path.write_text(json.dumps(manifest, indent=2))
        log.info("engine %s: image %s, digest %s", spec.name, spec.image, manifest["container"].get("digest"))
        return manifest
    started = time.time()
    build_log = engine_dir / "build.log"
    # Marks a finished install, so a failed self-check can be fixed and rerun without reinstalling.
    installed_marker = engine_dir / ".installed"
    with build_log.open("a") as log_file:
        fresh = installed_marker.exists() and installed_marker.read_text() == want and Path(python).exists()
        if spec.source == "venv" and fresh and not force:
            log.info("engine %s already installed; re-running its self-check", spec.name)
        elif spec.source == "venv":
            installed_marker.unlink(missing_ok=True)
            venv = engine_dir / "venv"
            if venv.exists():
                log.info("removing the stale environment %s", venv)
                shutil.rmtree(venv)
            base = _find_base_python(spec.python_version)
            _run([base, "-m", "venv", str(venv)], log_file, "[1/5] create venv")
            pip = [python, "-m", "pip", "--disable-pip-version-check"]
            _run([*pip, "install", "-q", "-U", "pip"], log_file, "[2/5] upgrade pip")
            if spec.pre_packages:
                _run([*pip, "install", *spec.pre_packages], log_file, "[3/5] install base packages")
            pins = ["-c", str(REPO_ROOT / spec.constraints)] if spec.constraints else []
            _run([*pip, "install", *pins, *spec.packages], log_file, "[3/5] install the engine (minutes)")
            present = subprocess.run([*pip, "list", "--format=json"], capture_output=True, text=True, check=True).stdout
            installed = {p["name"].lower() for p in json.loads(present)}
            doomed = [p for p in spec.remove_packages if p.lower() in installed]
            if doomed:
                _run([*pip, "uninstall", "-y", *doomed], log_file, "[4/5] remove incompatible packages")
            _run(
                [*pip, "install", "--no-deps", "-e", str(REPO_ROOT)],
                log_file,
                "[5/5] install wmtp (the plugin) into the engine env",
            )
            installed_marker.write_text(want)
        freeze = subprocess.run([python, "-m", "pip", "freeze"], capture_output=True, text=True, check=False)
    log.info("self-check: importing %s and checking the hook points", spec.kind)
    info = probe(python, spec)
    if windowed and info.get("hook_points_refused"):
        raise EngineBuildError(
            f"engine {spec.name}: the study runs windowed arms on it, but {info['hook_points_refused']} "
            "(docs/vllm-versions.md lists the vLLM versions that pass)"
        )
    behaviour = behaviour_check(python, spec, info)
    manifest = {
        "engine": spec.name,
        "kind": spec.kind,
        "source": spec.source,
        "spec": spec.model_dump(mode="json"),
        "build_hash": want,
        "python": python,
        "versions": info,
        "behaviour_check": behaviour,
        "checks_version": CHECKS_VERSION,
        "packages": sorted(freeze.stdout.split()),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "build_seconds": round(time.time() - started, 1),
    }
    manifest_path.write_text(json.dumps(manifest, indent=2))
    if info.get("hook_points_refused"):
        log.warning(
            "engine %s serves none and mtp only; windowed arms refuse: %s", spec.name, info["hook_points_refused"]
        )
    log.info(
        "engine %s ready in %.0f s: vllm %s, torch %s",
        spec.name,
        manifest["build_seconds"],
        info.get("vllm"),
        info.get("torch"),
    )
    return manifest
