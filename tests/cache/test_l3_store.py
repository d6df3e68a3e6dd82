"""L3 -> L2 copy: verified against the manifest, refused on mismatch; L2 -> L1 loads the same weights."""

import threading

import numpy as np
import pytest

from exaserve_hpc.cache.checkpoint import (
    CheckpointError, ChecksumError, TinyModelSpec, create_tiny_checkpoint, load_checkpoint,
)
from exaserve_hpc.cache.l3_store import LoadCancelled, copy_verified, manifest_bytes
from exaserve_hpc.cache.tiers import load_from_l2

SPEC = TinyModelSpec(layers=1, hidden=32, heads=4, kv_heads=2, intermediate=48, max_position=128, shards=3,
                     dtype="float16")


@pytest.fixture
def ckpt(tmp_path):
    return create_tiny_checkpoint(tmp_path / "l3" / "tiny", SPEC)


def test_copy_then_l1_load_gives_the_same_weights_as_a_direct_read(ckpt, tmp_path):
    dst = tmp_path / "l2"
    dst.mkdir()
    seen = []
    n = copy_verified(ckpt, dst, progress=lambda d, t: seen.append((d, t)), digests=("sha256", "md5"), workers=2)
    assert n == manifest_bytes(ckpt) and seen[-1] == (n, n)
    config, weights = load_from_l2(dst)
    want_config, want = load_checkpoint(ckpt)
    assert config == want_config and set(weights) == set(want)
    for name in want:
        assert weights[name].dtype == want[name].dtype and np.array_equal(weights[name], want[name])
        assert weights[name].flags.writeable and weights[name].base is None  # a private copy, not a view of L2


@pytest.mark.parametrize("digest", ["sha256", "md5"])
def test_a_corrupt_shard_is_refused_with_the_file_and_both_hashes(ckpt, tmp_path, digest):
    shard = ckpt / "model-00002-of-00003.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    dst = tmp_path / "l2"
    dst.mkdir()
    with pytest.raises(ChecksumError) as info:
        copy_verified(ckpt, dst, digests=(digest,))
    assert "model-00002-of-00003.safetensors is corrupt" in str(info.value) and f"{digest} expected" in str(info.value)


def test_a_truncated_file_is_refused_before_reading(ckpt, tmp_path):
    shard = ckpt / "model-00001-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="truncated"):
        copy_verified(ckpt, tmp_path)


def test_cancel_stops_the_copy(ckpt, tmp_path):
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(LoadCancelled):
        copy_verified(ckpt, tmp_path, cancel=cancel)
