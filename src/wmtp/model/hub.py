"""Fetch a study's checkpoint from the Hugging Face Hub into its ``path``, pinned and checked.

The study names the checkpoint (``hf_id``) and the commit it was measured at (``revision``). The revision is
resolved to a commit once and every file is downloaded at that commit, so a branch that moves during a long
download cannot mix two versions. ``huggingface_hub.snapshot_download`` does the transfer: it resumes an
interrupted download, honours ``HF_ENDPOINT``, ``HF_HOME`` and ``HF_TOKEN`` (read by the library, never
by us, so the token is never in an argument list or a log). Afterwards every file is checked against the
Hub's own listing (LFS files by sha256, the others by their git blob id) and recorded with its size and
sha256 in ``wmtp-download.json`` next to the files. A checkpoint that matches its record is not fetched
again, and is not even looked up on the Hub.

Run as ``python -m wmtp.model.hub --hf-id ORG/NAME --revision REV --out DIR``. A failure the user can fix
(no network, offline mode, a gated or private checkpoint without a token, an unknown revision) ends with one
line on stderr saying what to do, and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("wmtp.model.hub")

DOWNLOAD_MANIFEST = "wmtp-download.json"
# Where snapshot_download keeps its resume state and per-file metadata inside local_dir.
HUB_STATE_DIR = Path(".cache") / "huggingface"
_CHUNK = 8 * 1024 * 1024


class FetchError(RuntimeError):
    """A checkpoint that cannot be fetched; the message is one line that says what to do."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _git_blob_id(path: Path) -> str:
    # The id git (and so the Hub's listing) gives a non-LFS file: sha1 over a "blob <size>\0" header and the bytes.
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode(), usedforsecurity=False)
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_files(model_dir: Path) -> Iterator[Path]:
    """The checkpoint's own files: everything but the download's record and the Hub client's state."""
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(model_dir)
        if rel.as_posix() == DOWNLOAD_MANIFEST or rel.parts[: len(HUB_STATE_DIR.parts)] == HUB_STATE_DIR.parts:
            continue
        yield path


def read_manifest(model_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((model_dir / DOWNLOAD_MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def manifest_mismatch(model_dir: Path, hf_id: str, revision: str) -> str | None:
    """Why the checkpoint in ``model_dir`` is not the one asked for (None: it is, file by file)."""
    manifest = read_manifest(model_dir)
    if manifest is None:
        return f"no readable {DOWNLOAD_MANIFEST}"
    if (manifest.get("hf_id"), manifest.get("revision")) != (hf_id, revision):
        return f"it records {manifest.get('hf_id')}@{manifest.get('revision')}, not {hf_id}@{revision}"
    recorded: dict[str, dict[str, Any]] = manifest.get("files") or {}
    present = {p.relative_to(model_dir).as_posix(): p for p in checkpoint_files(model_dir)}
    if set(recorded) != set(present):
        extra, missing = sorted(set(present) - set(recorded)), sorted(set(recorded) - set(present))
        return f"files differ from the record (missing {missing[:3]}, not recorded {extra[:3]})"
    for rel, path in present.items():
        if path.stat().st_size != recorded[rel].get("size") or file_sha256(path) != recorded[rel].get("sha256"):
            return f"{rel} differs from its recorded size or sha256"
    return None


def _hub_errors() -> tuple[type[BaseException], ...]:
    from huggingface_hub import errors

    found: list[type[BaseException]] = [errors.HfHubHTTPError, errors.OfflineModeIsEnabled, OSError]
    # A refused or dropped connection is the HTTP client's own error (httpx2 under huggingface_hub 2, httpx before).
    for client in ("httpx2", "httpx"):
        with contextlib.suppress(ImportError):
            found.append(__import__(client).TransportError)
    return tuple(found)


def _explain(err: BaseException, hf_id: str, revision: str, out_dir: Path) -> str:
    """The one line a user needs: what went wrong and what to do about it (never the token)."""
    from huggingface_hub import constants, errors

    where = f"{hf_id}@{revision}"
    by_hand = (
        f"or download it elsewhere (hf download {hf_id} --revision {revision} --local-dir DIR) and copy it to {out_dir}"
    )
    if isinstance(err, errors.OfflineModeIsEnabled) or constants.HF_HUB_OFFLINE:
        return f"model: cannot fetch {where}: HF_HUB_OFFLINE is set; unset it on a machine with network, {by_hand}"
    if isinstance(err, errors.RevisionNotFoundError):
        return (
            f"model: {hf_id} has no revision {revision!r} on {constants.ENDPOINT}; fix models[].revision in the study"
        )
    if isinstance(err, errors.HfHubHTTPError) and err.response is not None and err.response.status_code in (401, 403):
        return (
            f"model: {constants.ENDPOINT} refused {where} ({err.response.status_code}): it is gated or private, or the "
            "token is not valid; accept its terms on the model's page and set HF_TOKEN (or run `hf auth login`)"
        )
    if isinstance(err, errors.RepositoryNotFoundError):
        return (
            f"model: {hf_id} was not found on {constants.ENDPOINT} (or it is private and no valid token was sent); "
            "fix models[].hf_id, or set HF_TOKEN"
        )
    reason = " ".join(str(err).split())[:200]
    return f"model: cannot reach {constants.ENDPOINT} to fetch {where} ({type(err).__name__}: {reason}); {by_hand}"


def _check_against_listing(out_dir: Path, listing: dict[str, Any]) -> None:
    for rel, entry in listing.items():
        path = out_dir / rel
        if not path.is_file() or path.stat().st_size != entry.size:
            raise FetchError(f"model: {rel} is missing or has the wrong size after the download; run it again")
        expected = entry.lfs.sha256 if entry.lfs is not None else entry.blob_id
        actual = file_sha256(path) if entry.lfs is not None else _git_blob_id(path)
        if actual != expected:
            raise FetchError(f"model: {rel} does not match the Hub's hash ({actual} != {expected}); run it again")


def fetch_checkpoint(hf_id: str, revision: str, out_dir: Path, *, max_workers: int = 8) -> dict[str, Any]:
    """Make ``out_dir`` hold ``hf_id`` at ``revision``, exactly; returns the download record."""
    out_dir = Path(out_dir)
    if out_dir.is_dir():
        why = manifest_mismatch(out_dir, hf_id, revision)
        if why is None:
            log.info("%s@%s is already in %s and matches %s; not fetched again", hf_id, revision, out_dir,
                     DOWNLOAD_MANIFEST)  # fmt: skip
            manifest = read_manifest(out_dir)
            assert manifest is not None
            return manifest
        log.info("%s: %s; fetching", out_dir, why)
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.hf_api import RepoFile

    api = HfApi()
    started = time.monotonic()
    try:
        commit = api.model_info(hf_id, revision=revision).sha
        assert commit is not None, "the Hub answered without a commit"
        listing = {
            f.path: f for f in api.list_repo_tree(hf_id, revision=commit, recursive=True) if isinstance(f, RepoFile)
        }
        log.info("fetching %s@%s (commit %s, %d files) from %s into %s", hf_id, revision, commit, len(listing),
                 constants.ENDPOINT, out_dir)  # fmt: skip
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / DOWNLOAD_MANIFEST).unlink(missing_ok=True)
        snapshot_download(hf_id, revision=commit, local_dir=out_dir, max_workers=max_workers)
    except _hub_errors() as err:
        raise FetchError(_explain(err, hf_id, revision, out_dir)) from err
    _check_against_listing(out_dir, listing)
    unlisted = [p for p in checkpoint_files(out_dir) if p.relative_to(out_dir).as_posix() not in listing]
    if unlisted:
        raise FetchError(f"model: {out_dir} holds files the checkpoint does not have ({unlisted[:3]}); remove them")
    manifest = {
        "hf_id": hf_id,
        "revision": revision,
        "commit": commit,
        "files": {
            p.relative_to(out_dir).as_posix(): {"size": p.stat().st_size, "sha256": file_sha256(p)}
            for p in checkpoint_files(out_dir)
        },
    }
    # The Hub client's per-file state carries timestamps; the checkpoint's fingerprint (part of every cell's
    # identity) must depend on the checkpoint alone, and the record above replaces it.
    shutil.rmtree(out_dir / HUB_STATE_DIR, ignore_errors=True)
    with contextlib.suppress(OSError):  # .cache may hold something of the user's: then it stays
        (out_dir / HUB_STATE_DIR.parent).rmdir()
    tmp = out_dir / f".{DOWNLOAD_MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out_dir / DOWNLOAD_MANIFEST)  # written last: its presence means the download is complete
    log.info("fetched %s@%s in %.0f s", hf_id, revision, time.monotonic() - started)
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m wmtp.model.hub", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-id", required=True)
    parser.add_argument("--revision", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--log", type=Path, help="also write the log to this file")
    args = parser.parse_args(argv)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if args.log:
        args.log.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(args.log))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", handlers=handlers)
    try:
        fetch_checkpoint(args.hf_id, args.revision, args.out)
    except FetchError as err:
        log.debug("fetch failed", exc_info=err)
        print(str(err), file=sys.stderr)
        if args.log:
            with args.log.open("a") as handle:
                handle.write(f"{err}\n")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
