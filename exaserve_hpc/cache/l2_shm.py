"""L2: the node's host-memory weight cache, in POSIX shared memory (files under /dev/shm).

One directory per cached checkpoint version, ``<root>/<key>/``, holding the
same files as L3 (config.json, shards, manifest.json), so every replica of
the node maps the same pages and the node reads L3 once per model. An entry
is filled into ``<root>/.fill-<key>-<n>/`` and renamed into place only after
every checksum matched, so a reader never sees a half or unverified entry.

Bookkeeping (this class) is plain data driven by the node agent, which is
its only writer; the clock is passed in. Capacity is bounded: room for a new
entry is made by evicting the least recently used entries that no replica
pins and that are not filling. ``choose_victims`` is the pure policy.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from exaserve_hpc.protocol import L2EntryStatus, L2Status
from exaserve_hpc.units import format_size

READY, FILLING = "ready", "filling"
_MARKER = ".exaserve-l2.json"


class L2Full(Exception):
    """The entry cannot fit: pinned and filling entries hold the room it needs."""


@dataclass
class L2Entry:
    key: str
    model: str
    nbytes: int
    state: str = FILLING
    pins: set[str] = field(default_factory=set)
    last_used: float = 0.0
    done: int = 0  # bytes filled so far

    @property
    def evictable(self) -> bool:
        return self.state == READY and not self.pins


def entry_key(model: str, manifest_raw: bytes) -> str:
    """Directory name of a checkpoint version: readable model name + the manifest's digest."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", model)[:64] or "model"
    return f"{safe}-{hashlib.sha256(manifest_raw).hexdigest()[:16]}"


def choose_victims(entries: list[L2Entry], need: int, capacity: int) -> list[str]:
    """Keys to evict, least recently used first, so ``need`` more bytes fit; L2Full if they cannot."""
    used = sum(e.nbytes for e in entries)
    if need > capacity:
        raise L2Full(f"{format_size(need)} is more than the whole L2 capacity ({format_size(capacity)})")
    victims = []
    for entry in sorted((e for e in entries if e.evictable), key=lambda e: (e.last_used, e.key)):
        if used + need <= capacity:
            break
        victims.append(entry.key)
        used -= entry.nbytes
    if used + need > capacity:
        held = sum(e.nbytes for e in entries if not e.evictable)
        raise L2Full(f"L2 needs {format_size(need)} more but pinned or filling entries hold "
                     f"{format_size(held)} of {format_size(capacity)}")
    return victims


def l2_page_note(path: str | os.PathLike, mounts: str, shmem_enabled: str = "") -> str | None:
    """Why L2 at ``path`` runs slow, or None: a tmpfs without huge pages fills 4 KiB at a time.

    ``mounts`` is /proc/mounts' text; ``shmem_enabled`` the text of
    /sys/kernel/mm/transparent_hugepage/shmem_enabled (its ``force`` gives
    every tmpfs huge pages). Measured on a 2-core node, the verified L3 -> L2
    copy runs at ~50-75% of a raw read into 4 KiB pages and ~90% into a tmpfs
    mounted with ``huge=within_size``. Pure: tested on captured texts.
    """
    target = os.path.realpath(path)
    best: tuple[str, str, str] | None = None  # the deepest mount point holding path
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        point = fields[1].replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and \
                (best is None or len(point) > len(best[0])):
            best = (point, fields[2], fields[3])
    if best is None or best[1] != "tmpfs":
        return None
    point, _, options = best
    huge = next((o.split("=", 1)[1] for o in options.split(",") if o.startswith("huge=")), "never")
    # `advise` gives huge pages only to madvise()d mappings, and L2 is filled by pwrite; `deny` turns them off
    if "[deny]" not in shmem_enabled and (huge in ("always", "within_size") or "[force]" in shmem_enabled):
        return None
    return (f"L2 at {target} is on a tmpfs ({point}) without huge pages, so copies from the shared store "
            "into it run at about half speed; give L2 its own tmpfs with huge pages, e.g. "
            f"`mount -t tmpfs -o huge=within_size,size=SIZE tmpfs /dev/shm/exaserve`, and set "
            "weight_cache.l2_path to it")


def read_l2_page_note(path: str | os.PathLike) -> str | None:
    """`l2_page_note` for this node (None where /proc/mounts cannot be read)."""
    try:
        mounts = Path("/proc/mounts").read_text()
    except OSError:
        return None
    try:
        shmem = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
    except OSError:
        shmem = ""
    return l2_page_note(path, mounts, shmem)


def private_l2_dirs(root: Path) -> None:
    """The L2 root and the per-user directory above it (exaserve-l2-UID, made with the default mode by
    mkdir(parents=True)) are 0700 when they are ours: another user must not read or replace weights. The
    shared place above them (weight_cache.l2_path, /dev/shm) is left alone."""
    for directory in (root, root.parent) if root.parent.name.startswith("exaserve-l2-") else (root,):
        try:
            if directory.stat().st_uid == os.getuid():
                os.chmod(directory, 0o700)
        except OSError:
            pass


class L2Error(OSError):
    """The L2 directory cannot be made or used (the message says where and why)."""


def make_l2_root(root: Path, attempts: int = 20) -> None:
    """Make ``root`` (0700) and its parents. Another agent of the same user may remove the per-user
    directory above it (its last agent leaving, at exit) between our mkdir of it and of ``root``: retried.
    A path that cannot be made (a file in the way, another user's directory) raises L2Error naming it."""
    for attempt in range(attempts):
        try:
            root.mkdir(parents=True, exist_ok=True, mode=0o700)
            return
        except FileNotFoundError:  # a parent vanished between the two mkdirs
            if attempt == attempts - 1:
                raise L2Error(f"cannot make the L2 directory {root}: its parent keeps disappearing") from None
        except OSError as exc:
            raise L2Error(f"cannot make the L2 directory {root}: {exc.strerror}; set weight_cache.l2_path (or "
                          "--l2-dir) to a directory of yours") from exc


class L2Cache:
    def __init__(self, root: str | os.PathLike, capacity: int):
        self.root = Path(root)
        self.capacity = capacity
        self.entries: dict[str, L2Entry] = {}
        self.l3_bytes_read = 0  # every byte this node read from the shared store into L2
        self.fills = 0
        self.hits = 0
        self.evictions = 0
        self._attempt = 0
        make_l2_root(self.root)
        private_l2_dirs(self.root)

    # ------------------------------------------------------------ entries

    def path(self, key: str) -> Path:
        return self.root / key

    def adopt(self, now: float) -> list[str]:
        """Take over complete entries left by an earlier agent on this node; remove partial fills."""
        adopted = []
        for child in sorted(self.root.iterdir()):
            marker = child / _MARKER
            if child.name.startswith(".fill-") or not marker.is_file():
                shutil.rmtree(child, ignore_errors=True)
                continue
            try:
                info = json.loads(marker.read_text())
                entry = L2Entry(child.name, info["model"], int(info["nbytes"]), READY, last_used=now)
            except (ValueError, KeyError, OSError):
                shutil.rmtree(child, ignore_errors=True)
                continue
            if self.used() + entry.nbytes > self.capacity:
                shutil.rmtree(child, ignore_errors=True)
                continue
            self.entries[entry.key] = entry
            adopted.append(entry.key)
        return adopted

    def used(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def begin_fill(self, key: str, model: str, nbytes: int, now: float) -> Path:
        """Make room (LRU eviction), account the entry as filling; returns the directory to fill."""
        assert key not in self.entries, key
        for victim in choose_victims(list(self.entries.values()), nbytes, self.capacity):
            self.evict(victim)
        self.entries[key] = L2Entry(key, model, nbytes, FILLING, last_used=now)
        self._attempt += 1
        fill_dir = self.root / f".fill-{key}-{os.getpid()}-{self._attempt}"
        shutil.rmtree(fill_dir, ignore_errors=True)
        fill_dir.mkdir(mode=0o700)
        return fill_dir

    def finish_fill(self, key: str, fill_dir: Path, now: float) -> None:
        entry = self.entries[key]
        fd = os.open(fill_dir / _MARKER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"model": entry.model, "nbytes": entry.nbytes}))
        shutil.rmtree(self.path(key), ignore_errors=True)
        os.rename(fill_dir, self.path(key))
        entry.state, entry.done, entry.last_used = READY, entry.nbytes, now
        self.fills += 1

    def abort_fill(self, key: str, fill_dir: Path) -> None:
        shutil.rmtree(fill_dir, ignore_errors=True)
        entry = self.entries.get(key)
        if entry is not None and entry.state == FILLING:
            del self.entries[key]

    def evict(self, key: str) -> None:
        entry = self.entries.pop(key)
        assert entry.evictable, f"evicting {key} which is {entry.state} with pins {sorted(entry.pins)}"
        shutil.rmtree(self.path(key), ignore_errors=True)
        self.evictions += 1

    def pin(self, key: str, holder: str, now: float) -> None:
        entry = self.entries[key]
        entry.pins.add(holder)
        entry.last_used = now

    def unpin(self, key: str, holder: str, now: float) -> None:
        entry = self.entries.get(key)
        if entry is not None and holder in entry.pins:
            entry.pins.discard(holder)
            entry.last_used = now

    def clear(self) -> None:
        """Remove every entry and the root (clean agent exit)."""
        self.entries.clear()
        shutil.rmtree(self.root, ignore_errors=True)

    def status(self, now: float) -> L2Status:
        return L2Status(capacity=self.capacity, used=self.used(), l3_bytes_read=self.l3_bytes_read,
                        fills=self.fills, hits=self.hits, evictions=self.evictions,
                        entries=[L2EntryStatus(model=e.model, nbytes=e.nbytes, state=e.state, pins=len(e.pins),
                                               idle_s=round(max(0.0, now - e.last_used), 3),
                                               progress=round(e.done / e.nbytes, 4) if e.nbytes else 1.0)
                                 for e in self.entries.values()])
