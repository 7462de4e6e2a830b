"""The `model` rule's fetch (wmtp.model.hub) against a stand-in Hub on 127.0.0.1.

The stand-in serves the routes huggingface_hub's snapshot_download uses: the revision's info
(``/api/models/{repo}/revision/{rev}``), the recursive tree listing (``/api/models/{repo}/tree/{commit}``) and
the files (``HEAD``/``GET /{repo}/resolve/{rev}/{file}`` with ETag, X-Repo-Commit, Content-Length and byte
ranges). The real library talks to it through ``HF_ENDPOINT``; nothing of ours is mocked. The fetch runs as the
rule runs it: ``python -m wmtp.model.hub`` in a subprocess.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from wmtp.layout import REPO_ROOT
from wmtp.model.hub import DOWNLOAD_MANIFEST, manifest_mismatch

REPO = "acme/tiny-mtp"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_standinsecretstandinsecret"  # a stand-in's token, checked never to be printed
FILES = {
    "config.json": json.dumps({"model_type": "qwen3_next", "max_position_embeddings": 4096}).encode(),
    "tokenizer.json": b'{"version": "1.0"}',
    "sub/notes.txt": b"hello\n",
    # An LFS file on the Hub (listed with its sha256), larger than the client's 10 MiB write chunk so that a cut
    # transfer leaves something to resume from.
    "model.safetensors": bytes(range(256)) * (12 * 4096),
}
LFS = {"model.safetensors"}


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data, usedforsecurity=False).hexdigest()


@dataclass
class StandInHub:
    """What the stand-in Hub holds and what it was asked."""

    files: dict[str, bytes]
    token: str | None = None
    refs: dict[str, str] = field(default_factory=lambda: {"main": COMMIT, COMMIT: COMMIT})
    cut_first_get: set[str] = field(default_factory=set)
    requests: list[str] = field(default_factory=list)
    ranges: list[str] = field(default_factory=list)

    def etag(self, path: str) -> str:
        data = self.files[path]
        return hashlib.sha256(data).hexdigest() if path in LFS else _blob_id(data)

    def tree(self) -> list[dict]:
        out = []
        for path, data in sorted(self.files.items()):
            entry = {"type": "file", "path": path, "size": len(data), "oid": _blob_id(data)}
            if path in LFS:
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            out.append(entry)
        return out


class _StandInHandler(BaseHTTPRequestHandler):
    hub: StandInHub  # set on a subclass per server

    protocol_version = "HTTP/1.1"

    def log_message(self, *_args) -> None:
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, payload: object) -> None:
        self._send(200, json.dumps(payload).encode(), {"Content-Type": "application/json"})

    def _authorised(self) -> bool:
        if self.hub.token is None or self.headers.get("Authorization") == f"Bearer {self.hub.token}":
            return True
        headers = {"X-Error-Code": "GatedRepo", "X-Error-Message": f"Access to model {REPO} is restricted."}
        self._send(401, b'{"error": "gated"}', headers)
        return False

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        self.hub.requests.append(f"{self.command} {path}")
        if not self._authorised():
            return
        api = f"/api/models/{REPO}/"
        if path.startswith(api + "revision/"):
            rev = path[len(api + "revision/") :]
            if rev not in self.hub.refs:
                return self._send(404, b"{}", {"X-Error-Code": "RevisionNotFound", "X-Error-Message": "no rev"})
            siblings = [{"rfilename": p} for p in sorted(self.hub.files)]
            return self._json({"id": REPO, "modelId": REPO, "sha": self.hub.refs[rev], "siblings": siblings})
        if path.startswith(api + "tree/"):
            return self._json(self.hub.tree())
        prefix = f"/{REPO}/resolve/"
        if path.startswith(prefix):
            rev, _, name = path[len(prefix) :].partition("/")
            if rev not in self.hub.refs or name not in self.hub.files:
                return self._send(404, b"{}", {"X-Error-Code": "EntryNotFound"})
            return self._file(self.hub.refs[rev], name)
        self._send(404, b"{}", {"X-Error-Code": "RepoNotFound"})

    def _file(self, commit: str, name: str) -> None:
        data = self.hub.files[name]
        headers = {"ETag": f'"{self.hub.etag(name)}"', "X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
        start = 0
        if self.headers.get("Range"):
            self.hub.ranges.append(f"{name} {self.headers['Range']}")
            start = int(self.headers["Range"].split("=")[1].split("-")[0])
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        if self.command == "GET" and name in self.hub.cut_first_get:
            # An interrupted transfer: announce the whole file, send all but its last MiB, drop the connection.
            self.hub.cut_first_get.discard(name)
            self.send_response(200)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[: len(data) - 2**20])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self._send(206 if start else 200, data[start:], headers)


@pytest.fixture
def hub() -> Iterator[tuple[StandInHub, str]]:
    state = StandInHub(files=dict(FILES))
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (_StandInHandler,), {"hub": state}))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _fetch(endpoint: str, out: Path, home: Path, revision: str = COMMIT, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    environ.update(HF_ENDPOINT=endpoint, HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1", **env)
    environ["PYTHONPATH"] = str(REPO_ROOT / "src")
    argv = [sys.executable, "-m", "wmtp.model.hub", "--hf-id", REPO, "--revision", revision, "--out", str(out)]
    return subprocess.run(argv, env=environ, capture_output=True, text=True, timeout=120)


def test_fetch_records_commit_and_hashes_and_resumes(hub, tmp_path):
    state, endpoint = hub
    state.cut_first_get.add("model.safetensors")
    out = tmp_path / "models" / "tiny"
    proc = _fetch(endpoint, out, tmp_path / "hf", revision="main")
    assert proc.returncode == 0, proc.stderr
    for name, data in FILES.items():
        assert (out / name).read_bytes() == data
    # The cut transfer was resumed from where it stopped, not started over.
    assert state.ranges == ["model.safetensors bytes=10485760-"], state.ranges
    manifest = json.loads((out / DOWNLOAD_MANIFEST).read_text())
    assert manifest["hf_id"] == REPO and manifest["revision"] == "main" and manifest["commit"] == COMMIT
    assert manifest["files"] == {
        name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()} for name, data in FILES.items()
    }
    # The Hub client's state (timestamps) does not stay among the checkpoint's files.
    assert not (out / ".cache").exists()
    assert manifest_mismatch(out, REPO, "main") is None


def test_present_checkpoint_is_not_fetched_again(hub, tmp_path):
    state, endpoint = hub
    out = tmp_path / "ckpt"
    assert _fetch(endpoint, out, tmp_path / "hf").returncode == 0
    state.requests.clear()
    proc = _fetch(endpoint, out, tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    assert state.requests == []  # not even looked up
    assert "not fetched again" in proc.stderr
    # A changed file is noticed and fetched again.
    (out / "sub" / "notes.txt").write_text("edited\n")
    assert "notes.txt differs" in manifest_mismatch(out, REPO, COMMIT)
    proc = _fetch(endpoint, out, tmp_path / "hf")
    assert proc.returncode == 0, proc.stderr
    assert (out / "sub" / "notes.txt").read_bytes() == FILES["sub/notes.txt"]
    assert state.requests


def test_offline_says_what_to_do(hub, tmp_path):
    _state, endpoint = hub
    proc = _fetch(endpoint, tmp_path / "ckpt", tmp_path / "hf", HF_HUB_OFFLINE="1")
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("model: cannot fetch acme/tiny-mtp@") and "HF_HUB_OFFLINE" in last and "hf download" in last
    assert "Traceback" not in proc.stderr


def test_unreachable_hub_says_what_to_do(tmp_path):
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = _fetch(f"http://127.0.0.1:{port}", tmp_path / "ckpt", tmp_path / "hf")
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("model: cannot reach http://127.0.0.1:") and "hf download" in last, proc.stderr
    assert "Traceback" not in proc.stderr


def test_gated_checkpoint_asks_for_a_token_and_never_prints_it(hub, tmp_path):
    state, endpoint = hub
    state.token = TOKEN
    proc = _fetch(endpoint, tmp_path / "ckpt", tmp_path / "hf")
    assert proc.returncode == 2
    assert "set HF_TOKEN" in proc.stderr.strip().splitlines()[-1], proc.stderr
    wrong = _fetch(endpoint, tmp_path / "ckpt", tmp_path / "hf", HF_TOKEN="hf_wrongwrongwrongwrong")
    assert wrong.returncode == 2 and "hf_wrongwrong" not in wrong.stderr + wrong.stdout
    proc = _fetch(endpoint, tmp_path / "ckpt", tmp_path / "hf", HF_TOKEN=TOKEN)
    assert proc.returncode == 0, proc.stderr
    assert TOKEN not in proc.stderr + proc.stdout


def test_unknown_revision_names_the_study_key(hub, tmp_path):
    _state, endpoint = hub
    proc = _fetch(endpoint, tmp_path / "ckpt", tmp_path / "hf", revision="v9")
    assert proc.returncode == 2
    assert "no revision 'v9'" in proc.stderr and "models[].revision" in proc.stderr
