"""Checksum manifests of model checkpoints (the model repository's integrity layer).

``manifest.json`` in a checkpoint directory records the size, BLAKE3, sha256
and md5 of every other file::

    {"format": "exaserve-manifest-v1",
     "files": {"config.json": {"size": 123, "blake3": "...", "sha256": "...", "md5": "..."}, ...}}

BLAKE3 is the read-path digest: it is cryptographic like sha256 (a file
cannot be altered to keep its digest) but ~8 GB/s on one core against ~1-2
for sha256, so a load can check every byte it reads from the shared store
and still run at the store's speed. sha256 and md5 stay for provenance (what
other tools publish) and are checked by ``verify_checkpoint``. Manifests
written before BLAKE3 (no "blake3" field) still load: reads then check
sha256, and say so once per checkpoint in the log.

Call protocol: ``write_manifest(dir)`` after writing a checkpoint;
``verify_checkpoint(dir)`` hashes every listed file with every recorded
digest; loaders use ``read_manifest`` / ``read_bytes`` (or
``read_digests`` + ``new_hash`` + ``compare_digests`` for their own loop) to
hash while reading, so a verified load reads each file once. Failures raise
``CheckpointError`` (``ChecksumError`` for a bad hash) naming the file, both
sums and what to do.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import blake3

MANIFEST_FORMAT = "exaserve-manifest-v1"
MANIFEST_FILE = "manifest.json"
FAST_DIGEST = "blake3"  # checked on every read
LEGACY_DIGEST = "sha256"  # checked on reads of manifests without FAST_DIGEST
ALL_DIGESTS = (FAST_DIGEST, "sha256", "md5")  # what write_manifest records, verify_checkpoint checks
_CHUNK = 8 << 20

log = logging.getLogger("exaserve.checkpoint")
_legacy_logged: set[str] = set()  # checkpoints whose sha256 fallback was already logged

Progress = Callable[[int, int], None]


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete, malformed or not the one expected."""


class ChecksumError(CheckpointError):
    """A file's bytes do not match the sha256/md5 recorded in the manifest."""


def write_synced(path: Path, data: bytes) -> None:
    """Created 0600: checkpoints and manifests are the user's own (issue 13 item 14)."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def new_hash(name: str):
    """A fresh hash object for a manifest digest name (``update``/``hexdigest``; updates release the GIL)."""
    if name == FAST_DIGEST:
        return blake3.blake3()  # one thread: the other core is copying
    if name == "md5":
        return hashlib.md5(usedforsecurity=False)
    return hashlib.new(name)


def read_digests(root: Path, entry: dict) -> tuple[str, ...]:
    """The digests a read of ``entry`` checks: BLAKE3, or sha256 for a manifest written before it."""
    if FAST_DIGEST in entry:
        return (FAST_DIGEST,)
    key = str(root.resolve())
    if key not in _legacy_logged:
        _legacy_logged.add(key)
        log.warning("checkpoint %s: manifest has no %s digests (written by an older exaserve); reads "
                    "check %s instead, several times slower. To load at full speed, run `exaserve model verify %s` "
                    "and then write_manifest on it", root, FAST_DIGEST, LEGACY_DIGEST, root)
    return (LEGACY_DIGEST,)


def _digests(path: Path, names: tuple[str, ...] = ALL_DIGESTS) -> dict:
    hashes, size = {name: new_hash(name) for name in names}, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            for h in hashes.values():
                h.update(chunk)
            size += len(chunk)
    return {"size": size, **{name: h.hexdigest() for name, h in hashes.items()}}


def write_manifest(directory: str | os.PathLike) -> Path:
    """Record size, BLAKE3, sha256 and md5 of every file under ``directory`` (but itself)."""
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
    return parse_manifest(path, path.read_bytes())


def parse_manifest(path: Path, raw: bytes) -> dict[str, dict]:
    """The ``files`` table of manifest bytes read from ``path``; CheckpointError if malformed."""
    try:
        manifest = json.loads(raw)
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            raise ValueError(f"format {manifest.get('format')!r}, expected {MANIFEST_FORMAT!r}")
        for name, entry in files.items():  # a manifest must not make us hash files outside the checkpoint
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise ValueError(f"entry {name!r} points outside the checkpoint directory")
            missing = [k for k in ("size", "sha256", "md5") if k not in entry]
            if missing:
                raise ValueError(f"entry {name!r} lacks {', '.join(missing)}")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
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
    """Read one file; when ``entry`` is given, hash as we read (``read_digests``) and compare."""
    size = check_size(root, name, entry)
    hashes = {d: new_hash(d) for d in read_digests(root, entry)} if entry is not None else {}
    data = bytearray(size)
    view, done = memoryview(data), 0
    with open(root / name, "rb", buffering=0) as f:
        while done < size and (n := f.readinto(view[done:done + _CHUNK])):
            for h in hashes.values():
                h.update(view[done:done + n])
            done += n
            if on_bytes:
                on_bytes(n)
    if done != size:
        raise CheckpointError(f"{root / name} ended at {done} of {size} bytes while being read; it "
                              "changed under us. Retry, or re-copy the checkpoint")
    if entry is not None:
        compare_digests(root / name, entry, {d: h.hexdigest() for d, h in hashes.items()})
    return bytes(data)


def compare_digests(path: Path, entry: dict, actual: dict[str, str]) -> None:
    """ChecksumError naming the file and, for each digest checked, the expected and actual sums."""
    if any(actual[d] != entry[d] for d in actual):
        sums = "; ".join(f"{d} expected {entry[d]}, actual {actual[d]}" for d in actual)
        raise ChecksumError(
            f"{path} is corrupt: {sums}. Nothing of it was used; re-copy the file from the shared store, "
            f"import the checkpoint again (`exaserve model import SRC --name {path.parent.name} --force`), or, "
            f"for a tiny model, remove {path.parent} to have it re-created"
        )


def verify_checkpoint(directory: str | os.PathLike, progress: Progress | None = None) -> None:
    """Hash every file the manifest lists with every digest it records; raise CheckpointError/ChecksumError."""
    root = Path(directory)
    files = read_manifest(root)
    total = sum(check_size(root, name, entry) for name, entry in files.items())
    done = 0
    for name, entry in files.items():
        actual = _digests(root / name, tuple(d for d in ALL_DIGESTS if d in entry))
        done += actual.pop("size")
        compare_digests(root / name, entry, actual)
        if progress:
            progress(done, total)
