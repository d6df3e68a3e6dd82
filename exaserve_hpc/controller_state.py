"""The controller's state in one HDF5 file, so a requeued job restarts where it stopped.

    save_state(job_dir / "controller-state.h5", state)     # atomic: temp file + fsync + rename, mode 0600
    state = load_state(job_dir / "controller-state.h5")    # == what was saved

(Not a model checkpoint: those are cache/checkpoint.py.) The job directory usually sits on Lustre or
NFS: HDF5's own file locking (flock/fcntl) fails there unless the mount has locks, so files are opened
with locking off (h5py `locking=False`, or HDF5_USE_FILE_LOCKING=FALSE for older h5py); the data is
fsynced before the rename and the directory after it, so a node crash leaves the old file or the new
one, never a torn one.

Layout (every string is UTF-8, variable length):
    /            attrs: format, job_id, restart, saved_at, excluded_nodes
    /placement   replica_id[], model[], node[]              ("" = unplaced)
    /affinity    block_hash[] (uint64), offsets[] (int64), replica_ids[]   prefix block -> replicas (CSR)
    /quota       group[], tokens_used[] (int64), requests[] (int64), usage_group[],
                 usage[] (float64; attrs usage_at), ledger_file[], ledger_offset[] (int64)
                 per quota group the tokens and requests billed in the usage ledger and the fair share's
                 decayed usage at usage_at, and how far into each ledger file they go (quota/ledger.py);
                 files written before usage and ledger_* existed read back as empty
    /rollout     model[], version[], stage[], weight[] (float64)

The prefix-affinity part stores whatever index the router hands over; the router does not yet
export one, so today it is written empty and read back empty.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

FORMAT = "exaserve-controller-state/1"
CHECKPOINT_FILE = "controller-state.h5"  # in the job directory (or `exaserve serve`'s run_dir)
STR = h5py.string_dtype("utf-8")


class CheckpointFormatError(Exception):
    pass


@dataclass
class RolloutState:
    version: str
    stage: str = "stable"     # e.g. "canary", "stable"
    weight: float = 1.0       # share of traffic


@dataclass
class ControllerState:
    job_id: str
    restart: int
    saved_at: float
    placement: dict[str, tuple[str, str]] = field(default_factory=dict)   # replica id -> (model, node or "")
    affinity: dict[int, list[str]] = field(default_factory=dict)          # prefix block hash -> replica ids
    quota: dict[str, tuple[int, int]] = field(default_factory=dict)       # group -> (tokens used, requests)
    quota_usage: dict[str, float] = field(default_factory=dict)           # group -> fair-share usage at _at
    quota_usage_at: float = 0.0                                           # Unix time
    ledger_offsets: dict[str, int] = field(default_factory=dict)          # usage ledger file -> bytes counted
    rollout: dict[str, RolloutState] = field(default_factory=dict)        # model -> rollout
    excluded_nodes: list[str] = field(default_factory=list)


def _strings(group: h5py.Group, name: str, values: list[str]) -> None:
    group.create_dataset(name, data=np.array(values, dtype=object), dtype=STR)


def _read_strings(group: h5py.Group, name: str) -> list[str]:
    return [v.decode() if isinstance(v, bytes) else str(v) for v in group[name][()]]


def open_h5(path: Path, mode: str) -> h5py.File:
    """An HDF5 file without HDF5's file locks (which shared filesystems without flock refuse)."""
    try:
        return h5py.File(path, mode, locking=False)
    except TypeError:  # h5py < 3.5 has no `locking`: the library reads the variable when it opens files
        os.environ.setdefault("HDF5_USE_FILE_LOCKING", "FALSE")
        return h5py.File(path, mode)


def _fsync(path: Path, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_state(path: Path, state: ControllerState) -> Path:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.close(fd)
    try:
        _write(tmp, state)
        _fsync(tmp)  # the data is on disk before the name points at it
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync(path.parent, os.O_RDONLY | os.O_DIRECTORY)  # and the rename itself survives a crash
    return path


def _write(tmp: Path, state: ControllerState) -> None:
    with open_h5(tmp, "w") as f:
        f.attrs.update(format=FORMAT, job_id=state.job_id, restart=state.restart, saved_at=state.saved_at)
        _strings(f, "excluded_nodes", list(state.excluded_nodes))
        placement = f.create_group("placement")
        ids = sorted(state.placement)
        _strings(placement, "replica_id", ids)
        _strings(placement, "model", [state.placement[r][0] for r in ids])
        _strings(placement, "node", [state.placement[r][1] or "" for r in ids])
        affinity = f.create_group("affinity")
        hashes = sorted(state.affinity)
        affinity.create_dataset("block_hash", data=np.array(hashes, dtype=np.uint64))
        affinity.create_dataset("offsets", data=np.cumsum([0] + [len(state.affinity[h]) for h in hashes],
                                                          dtype=np.int64))
        _strings(affinity, "replica_ids", [r for h in hashes for r in state.affinity[h]])
        quota = f.create_group("quota")
        groups = sorted(state.quota)
        _strings(quota, "group", groups)
        quota.create_dataset("tokens_used", data=np.array([state.quota[g][0] for g in groups], dtype=np.int64))
        quota.create_dataset("requests", data=np.array([state.quota[g][1] for g in groups], dtype=np.int64))
        users = sorted(state.quota_usage)
        _strings(quota, "usage_group", users)
        quota.create_dataset("usage", data=np.array([state.quota_usage[g] for g in users], dtype=np.float64))
        quota.attrs["usage_at"] = state.quota_usage_at
        files = sorted(state.ledger_offsets)
        _strings(quota, "ledger_file", files)
        quota.create_dataset("ledger_offset", data=np.array([state.ledger_offsets[f] for f in files], dtype=np.int64))
        rollout = f.create_group("rollout")
        models = sorted(state.rollout)
        _strings(rollout, "model", models)
        _strings(rollout, "version", [state.rollout[m].version for m in models])
        _strings(rollout, "stage", [state.rollout[m].stage for m in models])
        rollout.create_dataset("weight", data=np.array([state.rollout[m].weight for m in models], dtype=np.float64))


def load_state(path: Path) -> ControllerState:
    with open_h5(path, "r") as f:
        if f.attrs.get("format") != FORMAT:
            raise CheckpointFormatError(f"{path}: format {f.attrs.get('format')!r}, expected {FORMAT!r}")
        p, a, q, r = f["placement"], f["affinity"], f["quota"], f["rollout"]
        nodes = _read_strings(p, "node")
        placement = {rid: (model, node) for rid, model, node in
                     zip(_read_strings(p, "replica_id"), _read_strings(p, "model"), nodes)}
        offsets, flat = a["offsets"][()], _read_strings(a, "replica_ids")
        affinity = {int(h): flat[offsets[i]:offsets[i + 1]] for i, h in enumerate(a["block_hash"][()])}
        quota = {g: (int(t), int(n)) for g, t, n in zip(_read_strings(q, "group"), q["tokens_used"][()],
                                                        q["requests"][()])}
        usage = ({g: float(u) for g, u in zip(_read_strings(q, "usage_group"), q["usage"][()])}
                 if "usage" in q else {})
        offsets = ({f: int(o) for f, o in zip(_read_strings(q, "ledger_file"), q["ledger_offset"][()])}
                   if "ledger_file" in q else {})
        rollout = {m: RolloutState(v, s, float(w)) for m, v, s, w in
                   zip(_read_strings(r, "model"), _read_strings(r, "version"), _read_strings(r, "stage"),
                       r["weight"][()])}
        return ControllerState(job_id=str(f.attrs["job_id"]), restart=int(f.attrs["restart"]),
                               saved_at=float(f.attrs["saved_at"]), placement=placement, affinity=affinity,
                               quota=quota, rollout=rollout, excluded_nodes=_read_strings(f, "excluded_nodes"),
                               quota_usage=usage, quota_usage_at=float(q.attrs.get("usage_at", 0.0)),
                               ledger_offsets=offsets)


def state_from_status(status: dict, job_id: str, restart: int, saved_at: float,
                      excluded_nodes: list[str] = ()) -> ControllerState:
    """The part of a controller's status() a restart needs (placement); the rest starts empty."""
    placement = {r["replica_id"]: (r["model"], r["node"] or "") for r in status.get("replicas", [])}
    return ControllerState(job_id, restart, saved_at, placement=placement, excluded_nodes=list(excluded_nodes))
