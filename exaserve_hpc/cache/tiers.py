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

from .checkpoint import CONFIG_FILE, SHARD_RE, CheckpointError, check_weights, load_checkpoint, validate_config

Progress = Callable[[int, int], None]
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
           "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def _dtype(code: str, where: str) -> np.dtype:
    if code == "BF16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    if code not in _DTYPES:
        raise CheckpointError(f"{where}: dtype {code!r} is not supported; valid: BF16, {', '.join(_DTYPES)}")
    return np.dtype(_DTYPES[code])


def shard_names(entry_dir: Path) -> list[str]:
    shards = sorted(p.name for p in entry_dir.iterdir() if SHARD_RE.match(p.name))
    if not shards:
        raise CheckpointError(f"{entry_dir} has no model-XXXXX-of-XXXXX.safetensors shards")
    return shards


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
            dtype = _dtype(info["dtype"], f"{path}:{name}")
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
    shards = shard_names(root)
    total = sum((root / s).stat().st_size for s in shards)
    done = 0

    def on_bytes(n: int) -> None:
        nonlocal done
        done += n
        if progress:
            progress(done, total)

    try:
        config = validate_config(json.loads((root / CONFIG_FILE).read_text()))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{root / CONFIG_FILE} cannot be read ({e})") from e
    weights: dict[str, np.ndarray] = {}
    for shard in shards:
        _copy_shard(root / shard, weights, on_bytes)
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
