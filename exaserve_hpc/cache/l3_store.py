"""L3: the shared store (a checkpoint directory on the parallel file system), read with checksums.

``copy_verified(src, dst, ...)`` copies every file a checkpoint's manifest
lists into ``dst`` (an L2 entry being filled, in /dev/shm), hashing the
bytes as they arrive and refusing the copy (ChecksumError) if any file does
not match. It is the only way bytes leave L3 for L2, so every L3 read is
verified. The digest is the manifest's read digest (BLAKE3; sha256 for a
manifest written before BLAKE3, see ``manifest.read_digests``).

Throughput: one pass, three threads. The calling thread reads each chunk
into one of a few reused buffers; a hasher thread hashes it; a writer thread
pwrites it into the L2 file and returns the buffer. The bytes hashed are the
bytes L2 holds, and nothing is read twice. Hashing and writing release the
GIL, so on 2+ cores the copy runs at the speed of its slowest stage: the
store's reads where L2 is a tmpfs with huge pages, L2's page allocation where
it is a tmpfs with 4 KiB pages (about half as fast; the agent warns, see
``l2_shm.l2_page_note``). Measured on a 2-core node and kept out on purpose:
readinto straight into an mmap of the L2 file (a page fault per 4 KiB page:
~1.1 GB/s), sendfile into it (slower than pwrite on huge pages),
posix_fallocate or MADV_POPULATE ahead of it (zeroing the pages costs more
than it saves), POSIX_FADV_WILLNEED read-ahead (halved throughput), and
O_DIRECT reads (no kernel read-ahead: ~40% slower than buffered reads plus
DONTNEED). Pages already read are dropped from the page cache
(POSIX_FADV_DONTNEED): the node keeps one copy of the weights, in L2, not a
second one in the page cache.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from exaserve_hpc.cache.manifest import (
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


class _Stage(threading.Thread):
    """One stage of the copy pipeline: reader -> hasher -> writer, each its own thread.

    Items are ``(fd, offset, buffer, n, hashes, path, sums)``. The hasher
    feeds ``buffer[:n]`` to every hash in ``hashes``; at a file's end marker
    (``buffer is None``) it compares the digests. The writer pwrites
    ``buffer[:n]`` at ``offset``, closes ``fd`` at the end marker, and hands
    each buffer back through ``free``. ``None`` ends a stage (and is passed
    on). After its first error a stage only passes items on (the writer still
    recycles buffers and closes fds); ``error`` is raised by the reader at its
    next chunk or after the join. Hashing and writing both release the GIL,
    so with 2+ cores the three run at the speed of the slowest: the store's
    reads on a node whose L2 pages are cheap, L2's page allocation otherwise.
    """

    def __init__(self, name: str, outbox: queue.Queue):
        super().__init__(daemon=True, name=f"l3-copy-{name}")
        self.inbox: queue.Queue = queue.Queue()
        self.outbox = outbox
        self.error: BaseException | None = None

    def run(self) -> None:
        while (item := self.inbox.get()) is not None:
            try:
                if self.error is None:
                    self.process(*item)
            except BaseException as e:  # surfaced by the reader
                self.error = e
            finally:
                self.done(item)
        self.finish()

    def process(self, fd, offset, buffer, n, hashes, path, sums) -> None:
        raise NotImplementedError

    def done(self, item) -> None:
        self.outbox.put(item)

    def finish(self) -> None:
        self.outbox.put(None)


class _Hasher(_Stage):
    def process(self, fd, offset, buffer, n, hashes, path, sums) -> None:
        if buffer is not None:
            for h in hashes.values():
                h.update(buffer[:n])
        else:
            compare_digests(path, sums, {d: h.hexdigest() for d, h in hashes.items()})


class _Writer(_Stage):
    def __init__(self, buffers: int, chunk: int):
        self.free: queue.Queue = queue.Queue()
        super().__init__("writer", self.free)
        for _ in range(buffers):
            self.free.put(memoryview(bytearray(chunk)))
        self.open_fds: set[int] = set()  # opened by the reader, closed here (or by the reader after join)

    def process(self, fd, offset, buffer, n, hashes, path, sums) -> None:
        if buffer is not None:
            _write_all(fd, buffer[:n], offset)

    def done(self, item) -> None:
        fd, _, buffer, *_ = item
        if buffer is None:
            self.open_fds.discard(fd)
            try:
                os.close(fd)  # tmpfs can report a failed write only here
            except OSError as e:
                self.error = self.error or e  # the thread must live on: the reader waits on `free`
        else:
            self.free.put(buffer)

    def finish(self) -> None:
        pass  # the last stage


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
    hasher = _Hasher("hasher", writer.inbox)
    writer.start()
    hasher.start()
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
                    if hasher.error or writer.error:
                        writer.free.put(buffer)
                        raise hasher.error or writer.error
                    n = f.readinto(buffer[:min(CHUNK, e.size - offset)])
                    if not n:
                        writer.free.put(buffer)
                        raise CheckpointError(f"{src / e.name} ended at {offset} of {e.size} bytes while "
                                              "being read; it changed under us. Retry or re-copy it")
                    hasher.inbox.put((dst_fd, offset, buffer, n, hashes, None, None))
                    _advise(f.fileno(), offset, n, os.POSIX_FADV_DONTNEED)
                    offset += n
                    done += n
                    if on_chunk:
                        on_chunk(n)
                    if progress:
                        progress(done, total)
            hasher.inbox.put((dst_fd, None, None, 0, hashes, src / e.name, e.sums))
    finally:
        hasher.inbox.put(None)
        hasher.join()
        writer.join()
        for fd in writer.open_fds:  # those whose close was never queued (an error mid-file)
            os.close(fd)
    if hasher.error or writer.error:
        raise hasher.error or writer.error
    fd = os.open(dst / MANIFEST_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # private, like the weights
    with os.fdopen(fd, "wb") as f:
        f.write(raw_manifest)
    return done
