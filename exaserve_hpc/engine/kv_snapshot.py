"""KV snapshot migration: a draining replica writes its hottest prefix KV
blocks to an HDF5 file on shared storage; the replica that replaces it loads
them, so the first requests after the move hit the prefix cache.

Not the controller's HDF5 checkpoint (``exaserve_hpc/controller_state.py``): this
file holds one engine's cache contents and nothing about placement.

File layout (``FORMAT``), n blocks hottest first and prefix-closed (each
block's parent is the root or an earlier block)::

    attrs     format, model_identity, block_size, kv_cache_dtype,
              block_shape [layers, kv_heads, block_size, head_dim],
              num_blocks, created_unix, digest (blake2b of the datasets)
    block_hash   uint64 [n]        chained hash (block_manager.hash_block_tokens)
    parent_hash  uint64 [n]        ROOT_HASH for a sequence's first block
    token_ids    uint32 [n, block_size]
    hits         int64 [n]         prefix hits each served (the heat measure)
    k, v         [n, layers, kv_heads, block_size, head_dim], the cache's
                 storage dtype (fp8 stored as its uint8 bytes)

Heat: prefix hits since the block was named, then recency (in use, then most
recently freed); see ``BlockManager.export_cached_blocks``.

Call protocol: ``write_kv_snapshot(engine, path, max_blocks)`` (atomic:
temp file in the same directory, fsync, rename) -> blocks written;
``load_kv_snapshot(engine, path)`` -> blocks installed as evictable cached
blocks. ``KVSnapshotError`` for a snapshot of another model, block size or
dtype, or an unreadable / corrupt file; nothing is installed then.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import numpy as np

from exaserve_hpc.cache.manifest import fsync_dir
from exaserve_hpc.controller_state import open_h5  # no HDF5 file locks: shared filesystems may lack flock

FORMAT = "exaserve-kv-snapshot-v1"
_DATASETS = ("block_hash", "parent_hash", "token_ids", "hits", "k", "v")


class KVSnapshotError(Exception):
    """A snapshot that cannot be written or must not be loaded (the message says why)."""


def _check_engine(engine) -> None:
    if not hasattr(engine, "kv") or not hasattr(engine, "model_identity"):
        raise KVSnapshotError(f"{type(engine).__name__} holds no KV data to snapshot; "
                              "KV snapshots need the reference engine")


def _digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in _DATASETS:
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name} {a.dtype.str} {a.shape}".encode())
        h.update(a.data)
    return h.hexdigest()


def _stored(a: np.ndarray, dtype_name: str) -> np.ndarray:
    """h5py has no float8: keep its bytes."""
    return a.view(np.uint8) if dtype_name == "fp8" else a


def write_kv_snapshot(engine, path: str | os.PathLike, max_blocks: int) -> int:
    """Write the engine's ``max_blocks`` hottest cached full blocks to ``path``
    atomically; returns how many were written (0 is a valid, empty snapshot)."""
    _check_engine(engine)
    if max_blocks < 0:
        raise ValueError(f"max_blocks must be >= 0, got {max_blocks}")
    blocks = engine.blocks.export_cached_blocks(max_blocks)
    bs, kv = engine.blocks.block_size, engine.kv
    ids = [b.block_id for b in blocks]
    k, v = kv.read_blocks(ids)
    arrays = {
        "block_hash": np.array([b.block_hash for b in blocks], np.uint64),
        "parent_hash": np.array([b.parent_hash for b in blocks], np.uint64),
        "token_ids": np.array([b.token_ids for b in blocks], np.uint32).reshape(len(blocks), bs),
        "hits": np.array([b.hits for b in blocks], np.int64),
        "k": _stored(k, engine.kv_cache_dtype), "v": _stored(v, engine.kv_cache_dtype),
    }
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp.{os.uname().nodename}.{os.getpid()}")  # shared FS
    try:
        with open_h5(tmp, "w") as f:
            f.attrs.update(format=FORMAT, model_identity=engine.model_identity(), block_size=bs,
                           kv_cache_dtype=engine.kv_cache_dtype,
                           block_shape=np.array(kv.block_shape, np.int64),
                           num_blocks=len(blocks), created_unix=time.time(),
                           digest=_digest(arrays))
            for name in _DATASETS:
                f.create_dataset(name, data=arrays[name])
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, target)
        fsync_dir(target.parent)
    except (OSError, ValueError, TypeError) as e:   # h5py reports I/O trouble as OSError
        tmp.unlink(missing_ok=True)
        raise KVSnapshotError(f"cannot write KV snapshot {target} ({e}); check the directory "
                              "exists on shared storage and is writable") from e
    return len(blocks)


def _read(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    try:
        with open_h5(path, "r") as f:
            attrs = {key: f.attrs[key] for key in f.attrs}
            if attrs.get("format") != FORMAT:
                raise KVSnapshotError(f"{path} has format {attrs.get('format')!r}, expected "
                                      f"{FORMAT!r}; it is not a KV snapshot")
            missing = [n for n in _DATASETS if n not in f]
            if missing:
                raise KVSnapshotError(f"{path} lacks datasets {missing}; it is corrupt, delete it")
            arrays = {name: f[name][()] for name in _DATASETS}
    except KVSnapshotError:
        raise
    except FileNotFoundError as e:
        raise KVSnapshotError(f"KV snapshot {path} does not exist; start without it or fix "
                              "kv_snapshot_in") from e
    except Exception as e:  # h5py raises OSError/KeyError/ValueError for damaged files
        raise KVSnapshotError(f"{path} is not a readable KV snapshot ({e}); it may be truncated "
                              "or corrupt: delete it and start cold") from e
    return attrs, arrays


def load_kv_snapshot(engine, path: str | os.PathLike) -> int:
    """Install the snapshot's blocks into the engine's prefix cache (clean
    free blocks only); returns how many were installed. KVSnapshotError if it
    comes from another model, block size or dtype, or is damaged."""
    _check_engine(engine)
    path = Path(path)
    attrs, arrays = _read(path)
    theirs, ours = str(attrs.get("model_identity")), engine.model_identity()
    if theirs != ours:
        raise KVSnapshotError(f"KV snapshot {path} is from model {theirs!r}; this engine runs "
                              f"{ours!r}. Its K/V would be wrong here: not loaded")
    bs, dtype = engine.blocks.block_size, engine.kv_cache_dtype
    if int(attrs.get("block_size", -1)) != bs or str(attrs.get("kv_cache_dtype")) != dtype:
        raise KVSnapshotError(
            f"KV snapshot {path} has block_size {attrs.get('block_size')} and kv_cache_dtype "
            f"{attrs.get('kv_cache_dtype')!r}; this engine uses {bs} and {dtype!r}: not loaded")
    if attrs.get("digest") != _digest(arrays):
        raise KVSnapshotError(f"KV snapshot {path}: data digest does not match its header; the "
                              "file is corrupt, delete it and start cold")
    n = len(arrays["block_hash"])
    want = (n, *engine.kv.block_shape)
    k, v = arrays["k"], arrays["v"]
    if dtype == "fp8":
        k, v = k.view(engine.kv.dtype), v.view(engine.kv.dtype)
    if k.shape != want or v.shape != want or k.dtype != engine.kv.dtype \
            or arrays["token_ids"].shape != (n, bs) or len(arrays["parent_hash"]) != n:
        raise KVSnapshotError(f"KV snapshot {path}: K/V of shape {k.shape} {k.dtype} for {n} "
                              f"blocks, expected {want} {engine.kv.dtype}; not loaded")
    entries = list(zip(arrays["block_hash"].tolist(), arrays["parent_hash"].tolist(),
                       arrays["token_ids"].tolist()))
    try:
        installed = engine.blocks.import_cached_blocks(entries)
    except ValueError as e:  # a hash that does not match its tokens
        raise KVSnapshotError(f"KV snapshot {path}: {e}") from e
    if installed:
        index = [i for i, _ in installed]
        engine.kv.write_blocks([b for _, b in installed], k[index], v[index])
    return len(installed)
