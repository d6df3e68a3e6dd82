"""L3: the shared store (a checkpoint directory on the parallel file system), read with checksums.

``copy_verified(src, dst, ...)`` copies every file a checkpoint's manifest
lists into ``dst`` (an L2 entry being filled, in /dev/shm), hashing the
bytes as they arrive and refusing the copy (ChecksumError) if any file does
not match. It is the only way bytes leave L3 for L2, so every L3 read is
verified.

Throughput: one thread copies each file in the kernel (sendfile from L3 into
the /dev/shm file: no trip through user memory, no page faults); hash
workers re-read the chunks already copied from L2 (RAM) into a small buffer
and digest them, so copying overlaps hashing, and on nodes with more cores
several files are hashed at once. sha256 alone is verified by
default: it is ~2.4x faster than md5 here and md5 adds no integrity the
sha256 does not give (pass ``digests=("sha256", "md5")`` to check both).
Pages already read are dropped from the page cache (POSIX_FADV_DONTNEED):
the node keeps one copy of the weights, in L2, not a second one in the
page cache.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import MANIFEST_FILE, CheckpointError, ChecksumError

MANIFEST_FORMAT = "exaserve-manifest-v1"
CHUNK = 16 << 20
Progress = Callable[[int, int], None]


class LoadCancelled(Exception):
    """The copy was cancelled (its attempt timed out, or nobody wants the model any more)."""


@dataclass(frozen=True)
class ManifestEntry:
    name: str
    size: int
    sha256: str
    md5: str


def read_manifest(model_dir: str | os.PathLike) -> tuple[list[ManifestEntry], bytes]:
    """(entries, the manifest's raw bytes: the identity of this checkpoint version)."""
    root = Path(model_dir)
    path = root / MANIFEST_FILE
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read {path} ({e.strerror or e}); the checkpoint is missing or "
                              "not copied completely. Fix the model path or re-copy the checkpoint") from e
    try:
        manifest = json.loads(raw)
        if manifest.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}, expected {MANIFEST_FORMAT!r}")
        entries = []
        for name, entry in sorted(manifest["files"].items()):
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise ValueError(f"entry {name!r} points outside the checkpoint directory")
            entries.append(ManifestEntry(name, int(entry["size"]), entry["sha256"], entry["md5"]))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path} is not a valid manifest ({e}); re-create it") from e
    return entries, raw


def manifest_bytes(model_dir: str | os.PathLike) -> int:
    return sum(e.size for e in read_manifest(model_dir)[0])


class _Hasher(threading.Thread):
    """Digests the files given to it, chunk by chunk in order, re-reading them from L2 (pread: no page faults)."""

    def __init__(self, digests: tuple[str, ...]):
        super().__init__(daemon=True)
        self.digests = digests
        self.inbox: queue.Queue = queue.Queue(maxsize=16)
        self.results: dict[str, dict[str, str]] = {}
        self.error: BaseException | None = None
        self._buffer = bytearray(CHUNK)

    def run(self) -> None:
        current: dict[str, dict] = {}
        view = memoryview(self._buffer)
        while (item := self.inbox.get()) is not None:
            name, fd, offset, n = item
            try:
                if n is None:  # end of this file
                    os.close(fd)
                    self.results[name] = {d: h.hexdigest() for d, h in current.pop(name, self._new()).items()}
                    continue
                hashes = current.setdefault(name, self._new())
                got = os.preadv(fd, [view[:n]], offset)
                for h in hashes.values():
                    h.update(view[:got])  # releases the GIL: copying goes on meanwhile
            except BaseException as e:  # surfaced by the copier after join()
                self.error = e

    def _new(self) -> dict:
        return {d: hashlib.new(d) for d in self.digests}


def _drop_cache(fd: int, offset: int, length: int) -> None:
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass


def _copy_chunk(src_fd: int, dst_fd: int, offset: int, n: int) -> int:
    """In-kernel copy (sendfile: no trip through user memory); read + write where it is not supported."""
    try:
        return os.sendfile(dst_fd, src_fd, offset, n)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
    data = os.pread(src_fd, n, offset)
    return os.write(dst_fd, data)


def copy_verified(src: str | os.PathLike, dst: str | os.PathLike, *, progress: Progress | None = None,
                  cancel: threading.Event | None = None, digests: tuple[str, ...] = ("sha256",),
                  workers: int | None = None, on_chunk: Callable[[int], None] | None = None) -> int:
    """Copy the checkpoint at ``src`` into the (new, empty) directory ``dst``; returns bytes read.

    Raises CheckpointError (missing/truncated file, bad manifest), ChecksumError
    (a file's bytes differ from the manifest: nothing of it may be used), or
    LoadCancelled when ``cancel`` is set. ``on_chunk(n)`` runs after each chunk
    read (a fault-injection and accounting hook). The caller removes ``dst``
    on failure.
    """
    src, dst = Path(src), Path(dst)
    entries, raw_manifest = read_manifest(src)
    for e in entries:
        try:
            size = (src / e.name).stat().st_size
        except OSError as err:
            raise CheckpointError(f"{src / e.name} is listed in the manifest but cannot be read "
                                  f"({err.strerror or err}); re-copy the checkpoint") from err
        if size != e.size:
            raise CheckpointError(f"{src / e.name} is {size} bytes, the manifest says {e.size}; the file is "
                                  "truncated or replaced. Re-copy it or re-create the checkpoint")
    total, done = sum(e.size for e in entries), 0
    n_workers = workers or max(1, min(4, (os.cpu_count() or 2) - 1, len(entries)))
    hashers = [_Hasher(digests) for _ in range(n_workers)]
    for h in hashers:
        h.start()
    try:
        for index, e in enumerate(entries):
            hasher = hashers[index % n_workers]
            target = dst / e.name
            target.parent.mkdir(parents=True, exist_ok=True)
            dst_fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                with open(src / e.name, "rb", buffering=0) as f:
                    try:
                        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                    except (AttributeError, OSError):
                        pass
                    offset = 0
                    while offset < e.size:
                        if cancel is not None and cancel.is_set():
                            raise LoadCancelled(f"copy of {src} cancelled at {done}/{total} bytes")
                        n = _copy_chunk(f.fileno(), dst_fd, offset, min(CHUNK, e.size - offset))
                        if not n:
                            raise CheckpointError(f"{src / e.name} ended at {offset} of {e.size} bytes while "
                                                  "being read; it changed under us. Retry or re-copy it")
                        if digests:
                            hasher.inbox.put((e.name, dst_fd, offset, n))
                        _drop_cache(f.fileno(), offset, n)
                        offset += n
                        done += n
                        if on_chunk:
                            on_chunk(n)
                        if progress:
                            progress(done, total)
            except BaseException:
                hasher.inbox.put((e.name, dst_fd, 0, None))  # the hasher closes it after what it has queued
                raise
            hasher.inbox.put((e.name, dst_fd, 0, None))
    finally:
        for h in hashers:
            h.inbox.put(None)
        for h in hashers:
            h.join()
    for h in hashers:
        if h.error is not None:
            raise h.error
    results = {name: d for h in hashers for name, d in h.results.items()}
    for e in entries:
        actual = results[e.name]
        for d in digests:
            want = getattr(e, d)
            if actual[d] != want:
                raise ChecksumError(
                    f"{src / e.name} is corrupt: {d} expected {want}, actual {actual[d]}. Nothing of this "
                    f"checkpoint was used; re-copy the file into the shared store (or re-create the checkpoint)")
    (dst / MANIFEST_FILE).write_bytes(raw_manifest)
    return done
