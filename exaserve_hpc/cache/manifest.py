"""Checksum manifests of model checkpoints (the model repository's integrity layer).

``manifest.json`` in a checkpoint directory records the size, sha256 and md5
of every other file::

    {"format": "exaserve-manifest-v1",
     "files": {"config.json": {"size": 123, "sha256": "...", "md5": "..."}, ...}}

Call protocol: ``write_manifest(dir)`` after writing a checkpoint;
``verify_checkpoint(dir)`` hashes every listed file; loaders use
``read_manifest`` / ``read_bytes`` to hash while reading, so a verified load
reads each file once. Failures raise ``CheckpointError`` (``ChecksumError``
for a bad hash) naming the file, both sums and what to do.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

MANIFEST_FORMAT = "exaserve-manifest-v1"
MANIFEST_FILE = "manifest.json"
_CHUNK = 8 << 20

Progress = Callable[[int, int], None]


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete, malformed or not the one expected."""


class ChecksumError(CheckpointError):
    """A file's bytes do not match the sha256/md5 recorded in the manifest."""


def write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digests(path: Path) -> dict:
    sha, md5, size = hashlib.sha256(), hashlib.md5(usedforsecurity=False), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
            md5.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": sha.hexdigest(), "md5": md5.hexdigest()}


def write_manifest(directory: str | os.PathLike) -> Path:
    """Record size, sha256 and md5 of every file under ``directory`` (but itself)."""
    root = Path(directory)
    files = {
        p.relative_to(root).as_posix(): _digests(p)
        for p in sorted(root.rglob("*")) if p.is_file() and p.name != MANIFEST_FILE
    }
    manifest = {"format": MANIFEST_FORMAT, "files": files}
    path = root / MANIFEST_FILE
    write_synced(path, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
    return path


def read_manifest(root: Path) -> dict[str, dict]:
    path = root / MANIFEST_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing, so the checkpoint cannot be verified; it may be an "
            "interrupted copy. Re-copy it, re-create it with `exaserve model create-tiny "
            f"{root}`, or run write_manifest on a directory you trust"
        )
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {manifest.get('format')!r}, expected {MANIFEST_FORMAT!r}")
        for name in files:  # a manifest must not make us hash files outside the checkpoint
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise ValueError(f"entry {name!r} points outside the checkpoint directory")
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is not a valid manifest ({e}); re-create it") from e
    return files


def check_size(root: Path, name: str, entry: dict | None) -> int:
    path = root / name
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing from the checkpoint; re-copy the checkpoint or "
            f"re-create it with `exaserve model create-tiny {root}`"
        )
    size = path.stat().st_size
    if entry is not None and size != entry["size"]:
        raise CheckpointError(
            f"{path} is {size} bytes, the manifest says {entry['size']}; the file is "
            "truncated or replaced. Re-copy it or re-create the checkpoint"
        )
    return size


def read_bytes(root: Path, name: str, entry: dict | None,
                on_bytes: Callable[[int], None] | None = None) -> bytes:
    """Read one file; when ``entry`` is given, hash as we read and compare."""
    check_size(root, name, entry)
    sha, md5, chunks = hashlib.sha256(), hashlib.md5(usedforsecurity=False), []
    with open(root / name, "rb") as f:
        while chunk := f.read(_CHUNK):
            if entry is not None:
                sha.update(chunk)
                md5.update(chunk)
            chunks.append(chunk)
            if on_bytes:
                on_bytes(len(chunk))
    if entry is not None:
        _compare(root / name, entry, sha.hexdigest(), md5.hexdigest())
    return b"".join(chunks)


def _compare(path: Path, entry: dict, sha256: str, md5: str) -> None:
    if sha256 != entry["sha256"] or md5 != entry["md5"]:
        raise ChecksumError(
            f"{path} is corrupt: sha256 expected {entry['sha256']}, actual {sha256}; "
            f"md5 expected {entry['md5']}, actual {md5}. Re-copy the file from the "
            f"shared store or re-create the checkpoint with `exaserve model create-tiny {path.parent}`"
        )


def verify_checkpoint(directory: str | os.PathLike, progress: Progress | None = None) -> None:
    """Hash every file the manifest lists; raise CheckpointError/ChecksumError."""
    root = Path(directory)
    files = read_manifest(root)
    total = sum(check_size(root, name, entry) for name, entry in files.items())
    done = 0
    for name, entry in files.items():
        actual = _digests(root / name)
        _compare(root / name, entry, actual["sha256"], actual["md5"])
        done += actual["size"]
        if progress:
            progress(done, total)
