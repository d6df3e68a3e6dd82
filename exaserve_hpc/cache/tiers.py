"""L1: the replica's own copy of the weights, loaded from an L2 entry (or, bypassing L2, from L3).

On CPU nodes L1 is process-private numpy arrays: ``load_from_l2`` maps the
entry's shared-memory safetensors shards and copies each shard's tensors once
into one fresh array, each tensor a view of it (the CPU analogue of a host-to-device copy from pinned memory).
L2 bytes were verified against the manifest when they were copied in from
L3, so they are not hashed again here; shapes and names are checked.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

from exaserve_hpc.cache.checkpoint import (
    CONFIG_FILE, CheckpointError, check_weights, internal_weights, load_checkpoint, parse_config, weight_files,
)
from exaserve_hpc.cache.hf_format import safetensors_dtype

Progress = Callable[[int, int], None]
def shard_names(entry_dir: Path, config: dict | None = None) -> list[str]:
    """The weight files of an L2 entry (laid out as its L3 checkpoint: either format); ``config``: its
    parsed config, read from the entry when not given."""
    if config is None:
        config = parse_config(entry_dir, (entry_dir / CONFIG_FILE).read_bytes())
    return weight_files(entry_dir, [p.name for p in entry_dir.iterdir()], config)


COPY_CHUNK = 64 << 20  # progress is reported per chunk copied


def _copy_shard(path: Path, weights: dict[str, np.ndarray], on_bytes: Callable[[int], None]) -> None:
    """Copy one shard's tensor bytes into one fresh array and hand out each tensor as a view of it.

    One large destination per shard, not one per tensor: numpy asks for huge
    pages on large allocations, so the copy runs at memcpy speed, while
    per-tensor allocations fault in 4 KiB pages (measured on a huge-page L2:
    71% of memcpy per tensor, against ~100% for one arena). The tensors
    then share the arena's lifetime, which is the replica's.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    try:
        (header_len,) = struct.unpack_from("<Q", mm, 0)
        header = json.loads(mm[8:8 + header_len])
        base = 8 + header_len
        tensors = [(name, info) for name, info in header.items() if name != "__metadata__"]
        data_len = max((int(info["data_offsets"][1]) for _, info in tensors), default=0)
        if base + data_len > size:
            raise CheckpointError(f"{path} is truncated: its header names {base + data_len} bytes, "
                                  f"the file has {size}")
        arena = np.empty(data_len, np.uint8)
        source = np.frombuffer(mm, np.uint8, count=data_len, offset=base)
        for lo in range(0, data_len, COPY_CHUNK):
            hi = min(data_len, lo + COPY_CHUNK)
            np.copyto(arena[lo:hi], source[lo:hi])
            on_bytes(hi - lo)
        del source
        for name, info in tensors:
            begin, end = (int(x) for x in info["data_offsets"])
            dtype = safetensors_dtype(info["dtype"], f"{path}:{name}")
            weights[name] = arena[begin:end].view(dtype).reshape(tuple(info["shape"]))
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise CheckpointError(f"{path} is not a valid safetensors file ({e})") from e
    finally:
        try:
            mm.close()
        except BufferError:  # a view outlived an error; the GC closes the map
            pass


def load_from_l2(entry_dir: str | os.PathLike, progress: Progress | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """(config, weights) copied from an L2 entry into this process; CheckpointError if malformed."""
    root = Path(entry_dir)
    try:
        config = parse_config(root, (root / CONFIG_FILE).read_bytes())
    except OSError as e:
        raise CheckpointError(f"{root / CONFIG_FILE} cannot be read ({e})") from e
    shards = shard_names(root, config)
    total = sum((root / s).stat().st_size for s in shards)
    done = 0

    def on_bytes(n: int) -> None:
        nonlocal done
        done += n
        if progress:
            progress(done, total)

    weights: dict[str, np.ndarray] = {}
    for shard in shards:
        tensors: dict[str, np.ndarray] = {}
        _copy_shard(root / shard, tensors, on_bytes)
        weights.update(internal_weights(config, tensors))
    check_weights(config, weights)
    if progress:
        progress(total, total)
    return config, weights


def load_weights(weights_dir: str | os.PathLike, source: str,
                 progress: Progress | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """From L2 (``source == "l2"``), else straight from L3 with the manifest's checksums."""
    if source == "l2":
        return load_from_l2(weights_dir, progress)
    return load_checkpoint(weights_dir, verify=True, progress=progress)
