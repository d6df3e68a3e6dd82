"""L3: the shared store (a checkpoint directory on the parallel file system), read with checksums.

``copy_verified(src, dst, ...)`` copies every file a checkpoint's manifest
lists into ``dst`` (an L2 entry being filled, in /dev/shm), hashing the
bytes as they arrive and refusing the copy (ChecksumError) if any file does
not match. It is the only way bytes leave L3 for L2, so every L3 read is
verified. The digest is the manifest's read digest (BLAKE3; sha256 for a
manifest written before BLAKE3, see ``manifest.read_digests``).

Throughput: one pass. The calling thread reads each chunk into one of a few
reused buffers, hashes that buffer while it is still in CPU cache, and hands
it to a writer thread that pwrites it into the /dev/shm file and returns the
buffer; the bytes hashed are the bytes L2 holds, and nothing is read twice.
So the store's reads never wait on L2's page allocation, which is the other
big cost (tmpfs fills at ~3 GB/s per core). Measured on a 2-core node and
kept out on purpose: readinto straight into an mmap of the /dev/shm file
(a page fault per 4 KiB page: ~1.1 GB/s), posix_fallocate or MADV_POPULATE
ahead of it (zeroing the pages costs more than it saves),
POSIX_FADV_WILLNEED read-ahead (halved throughput), and O_DIRECT reads
(no kernel read-ahead: ~40% slower than buffered reads plus DONTNEED). Pages already read are
dropped from the page cache (POSIX_FADV_DONTNEED): the node keeps one copy
of the weights, in L2, not a second one in the page cache.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .manifest import (
    MANIFEST_FILE, CheckpointError, ChecksumError, compare_digests, new_hash, parse_manifest, read_digests,
)

CHUNK = 8 << 20
BUFFERS = 4  # chunks in flight between reader and writer: enough to ride out jitter on either side
Progress = Callable[[int, int], None]

__all__ = ["CheckpointError", "ChecksumError", "LoadCancelled", "ManifestEntry", "copy_verified",
           "manifest_bytes", "read_manifest"]


class LoadCancelled(Exception):
    """The copy was cancelled (its attempt timed out, or nobody wants the model any more)."""


@dataclass(frozen=True)
class ManifestEntry:
    name: str
    size: int
    sums: dict[str, str] = field(hash=False)  # digest name -> hex: blake3 (new manifests), sha256, md5


def read_manifest(model_dir: str | os.PathLike) -> tuple[list[ManifestEntry], bytes]:
    """(entries, the manifest's raw bytes: the identity of this checkpoint version)."""
    root = Path(model_dir)
    path = root / MANIFEST_FILE
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read {path} ({e.strerror or e}); the checkpoint is missing or "
                              "not copied completely. Fix the model path or re-copy the checkpoint") from e
    files = parse_manifest(path, raw)
    try:
        entries = [ManifestEntry(name, int(entry["size"]),
                                 {k: str(v) for k, v in entry.items() if k != "size"})
                   for name, entry in sorted(files.items())]
    except (ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path} is not a valid manifest ({e}); re-create it") from e
    return entries, raw


def manifest_bytes(model_dir: str | os.PathLike) -> int:
    return sum(e.size for e in read_manifest(model_dir)[0])


class _Writer(threading.Thread):
    """Writes filled buffers into L2 files in order and hands each buffer back through ``free``.

    Inbox items: ``(fd, offset, buffer, n)`` writes ``buffer[:n]`` at
    ``offset``; ``(fd, None, None, 0)`` closes ``fd``; ``None`` ends the
    thread. After the first error it only recycles buffers and closes fds
    (``error`` is raised by the reader at its next chunk).
    """

    def __init__(self, buffers: int, chunk: int):
        super().__init__(daemon=True, name="l3-copy-writer")
        self.inbox: queue.Queue = queue.Queue()
        self.free: queue.Queue = queue.Queue()
        for _ in range(buffers):
            self.free.put(memoryview(bytearray(chunk)))
        self.open_fds: set[int] = set()  # opened by the reader, closed here (or by the reader after join)
        self.error: BaseException | None = None

    def run(self) -> None:
        while (item := self.inbox.get()) is not None:
            fd, offset, buffer, n = item
            try:
                if buffer is None:
                    self.open_fds.discard(fd)
                    os.close(fd)
                elif self.error is None:
                    _write_all(fd, buffer[:n], offset)
            except BaseException as e:  # surfaced by the reader
                self.error = self.error or e
            finally:
                if buffer is not None:
                    self.free.put(buffer)


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _advise(fd: int, offset: int, length: int, advice: int) -> None:
    try:
        os.posix_fadvise(fd, offset, length, advice)
    except (AttributeError, OSError):
        pass


def copy_verified(src: str | os.PathLike, dst: str | os.PathLike, *, progress: Progress | None = None,
                  cancel: threading.Event | None = None, digests: tuple[str, ...] | None = None,
                  on_chunk: Callable[[int], None] | None = None) -> int:
    """Copy the checkpoint at ``src`` into the (new, empty) directory ``dst``; returns bytes read.

    Raises CheckpointError (missing/truncated file, bad manifest), ChecksumError
    (a file's bytes differ from the manifest: nothing of it may be used), or
    LoadCancelled when ``cancel`` is set. ``digests`` overrides the manifest's
    read digest (``()`` copies unverified: benchmarks only). ``on_chunk(n)``
    runs after each chunk read (a fault-injection and accounting hook). The
    caller removes ``dst`` on failure.
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
    writer = _Writer(BUFFERS, CHUNK)
    writer.start()
    try:
        for e in entries:
            names = digests if digests is not None else read_digests(src, e.sums)
            hashes = {d: new_hash(d) for d in names}
            target = dst / e.name
            target.parent.mkdir(parents=True, exist_ok=True)
            dst_fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            writer.open_fds.add(dst_fd)
            with open(src / e.name, "rb", buffering=0) as f:
                _advise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                offset = 0
                while offset < e.size:
                    if cancel is not None and cancel.is_set():
                        raise LoadCancelled(f"copy of {src} cancelled at {done}/{total} bytes")
                    buffer = writer.free.get()
                    if writer.error is not None:
                        raise writer.error
                    n = f.readinto(buffer[:min(CHUNK, e.size - offset)])
                    if not n:
                        writer.free.put(buffer)
                        raise CheckpointError(f"{src / e.name} ended at {offset} of {e.size} bytes while "
                                              "being read; it changed under us. Retry or re-copy it")
                    for h in hashes.values():
                        h.update(buffer[:n])  # releases the GIL: the writer runs meanwhile
                    writer.inbox.put((dst_fd, offset, buffer, n))
                    _advise(f.fileno(), offset, n, os.POSIX_FADV_DONTNEED)
                    offset += n
                    done += n
                    if on_chunk:
                        on_chunk(n)
                    if progress:
                        progress(done, total)
            writer.inbox.put((dst_fd, None, None, 0))
            compare_digests(src / e.name, e.sums, {d: h.hexdigest() for d, h in hashes.items()})
    finally:
        writer.inbox.put(None)
        writer.join()
        for fd in writer.open_fds:  # those whose close was never queued (an error mid-file)
            os.close(fd)
    if writer.error is not None:
        raise writer.error
    (dst / MANIFEST_FILE).write_bytes(raw_manifest)
    return done
