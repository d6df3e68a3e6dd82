"""L3 -> L2 copy: verified against the manifest, refused on mismatch; L2 -> L1 loads the same weights."""

import json
import os
import re
import threading

import numpy as np
import pytest

from exaserve_hpc.cache.checkpoint import (
    CheckpointError, ChecksumError, TinyModelSpec, create_tiny_checkpoint, load_checkpoint,
)
from exaserve_hpc.cache.l3_store import LoadCancelled, copy_verified, manifest_bytes
from exaserve_hpc.cache.tiers import load_from_l2, shard_names

SPEC = TinyModelSpec(layers=1, hidden=32, heads=4, kv_heads=2, intermediate=48, max_position=128, shards=3,
                     dtype="float16")


@pytest.fixture
def ckpt(tmp_path):
    return create_tiny_checkpoint(tmp_path / "l3" / "tiny", SPEC)


def test_copy_then_l1_load_gives_the_same_weights_as_a_direct_read(ckpt, tmp_path):
    dst = tmp_path / "l2"
    dst.mkdir()
    seen = []
    n = copy_verified(ckpt, dst, progress=lambda d, t: seen.append((d, t)), digests=("sha256", "md5"))
    assert n == manifest_bytes(ckpt) and seen[-1] == (n, n)
    for name in json.loads((ckpt / "manifest.json").read_text())["files"]:
        assert (dst / name).read_bytes() == (ckpt / name).read_bytes()
    config, weights = load_from_l2(dst)
    want_config, want = load_checkpoint(ckpt)
    assert config == want_config and set(weights) == set(want)
    for name in want:
        assert weights[name].dtype == want[name].dtype and np.array_equal(weights[name], want[name])
        owner = weights[name]
        while isinstance(owner.base, np.ndarray):
            owner = owner.base
        # a private copy (a view of the shard's own array), not a view of the L2 mapping
        assert weights[name].flags.writeable and owner.base is None and owner.flags.owndata
    l2_bytes = sum((dst / s).stat().st_size for s in shard_names(dst))
    arenas = {id(w.base) for w in weights.values()}
    assert len(arenas) == len(shard_names(dst)) and l2_bytes > sum(w.nbytes for w in weights.values())


def flip_byte(path, where):
    data = bytearray(path.read_bytes())
    data[where] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("digest", [None, "sha256", "md5"])  # None: the manifest's read digest, BLAKE3
@pytest.mark.parametrize("where", [0, -1])
def test_a_corrupt_shard_is_refused_with_the_file_and_both_hashes(ckpt, tmp_path, digest, where):
    name = "model-00002-of-00003.safetensors"
    want = json.loads((ckpt / "manifest.json").read_text())["files"][name][digest or "blake3"]
    flip_byte(ckpt / name, where)
    dst = tmp_path / "l2"
    dst.mkdir()
    with pytest.raises(ChecksumError) as info:
        copy_verified(ckpt, dst, digests=(digest,) if digest else None)
    message = str(info.value)
    assert f"{name} is corrupt: {digest or 'blake3'} expected {want}, actual " in message
    assert len([s for s in re.findall(r"[0-9a-f]{32,}", message) if len(s) == len(want)]) == 2, message


def test_a_manifest_without_blake3_is_checked_with_sha256(ckpt, tmp_path, caplog):
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for entry in manifest["files"].values():
        del entry["blake3"]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    dst = tmp_path / "l2"
    dst.mkdir()
    with caplog.at_level("WARNING", logger="exaserve.checkpoint"):
        assert copy_verified(ckpt, dst) == manifest_bytes(ckpt)
    assert any("check sha256 instead" in r.getMessage() for r in caplog.records)
    flip_byte(ckpt / "model-00003-of-00003.safetensors", 100)
    (tmp_path / "again").mkdir()
    with pytest.raises(ChecksumError, match="model-00003-of-00003.safetensors is corrupt: sha256 expected"):
        copy_verified(ckpt, tmp_path / "again")


def test_chunks_larger_than_the_copy_buffer_are_copied_whole(ckpt, tmp_path, monkeypatch):
    import exaserve_hpc.cache.l3_store as l3_store
    monkeypatch.setattr(l3_store, "CHUNK", 4096)  # every shard spans many chunks and buffers
    dst = tmp_path / "l2"
    dst.mkdir()
    chunks = []
    copy_verified(ckpt, dst, on_chunk=chunks.append)
    assert max(chunks) == 4096 and sum(chunks) == manifest_bytes(ckpt)
    for name in json.loads((ckpt / "manifest.json").read_text())["files"]:
        assert (dst / name).read_bytes() == (ckpt / name).read_bytes()


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


def test_a_failed_l2_write_surfaces_and_leaks_no_descriptor(ckpt, tmp_path, monkeypatch):
    import exaserve_hpc.cache.l3_store as l3_store

    def no_space(fd, view, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(l3_store, "_write_all", no_space)
    before = len(os.listdir("/proc/self/fd"))
    dst = tmp_path / "l2"
    dst.mkdir()
    with pytest.raises(OSError, match="No space left"):
        copy_verified(ckpt, dst)
    assert len(os.listdir("/proc/self/fd")) == before


def mount_tmpfs(point, options: str):
    import subprocess
    point.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}); needs root")
    return lambda: subprocess.run(["umount", "-l", str(point)], check=False)


@pytest.fixture
def huge_tmpfs(tmp_path):
    """A tmpfs with transparent huge pages, mounted for the test (needs root; skipped elsewhere)."""
    unmount = mount_tmpfs(tmp_path / "huge", "huge=within_size,size=256M")
    yield tmp_path / "huge"
    unmount()


def test_the_agent_names_the_fix_for_l2_on_a_tmpfs_without_huge_pages(tmp_path):
    from exaserve_hpc.cache.l2_shm import read_l2_page_note
    unmount = mount_tmpfs(tmp_path / "small", "huge=never,size=16M")
    try:
        try:
            forced = "[force]" in open("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read()
        except OSError:  # a kernel without transparent huge pages
            forced = False
        note = read_l2_page_note(tmp_path / "small" / "exaserve-l2-0" / "n1")
        assert (note is None) if forced else ("huge=within_size" in note and str(tmp_path / "small") in note)
    finally:
        unmount()


def test_l2_on_a_huge_page_tmpfs_is_recognised_and_filled_with_huge_pages(huge_tmpfs, tmp_path):
    from exaserve_hpc.cache.l2_shm import read_l2_page_note

    def shmem_huge_kib() -> int:
        for line in open("/proc/meminfo"):
            if line.startswith("ShmemHugePages:"):
                return int(line.split()[1])
        return 0

    assert read_l2_page_note(huge_tmpfs / "exaserve-l2-0" / "n1") is None
    big = create_tiny_checkpoint(tmp_path / "l3" / "big", TinyModelSpec(
        layers=2, hidden=512, heads=8, kv_heads=8, intermediate=1024, max_position=64, shards=2, dtype="float32"))
    before = shmem_huge_kib()
    (huge_tmpfs / "entry").mkdir()
    copy_verified(big, huge_tmpfs / "entry")
    assert shmem_huge_kib() - before >= 2048  # at least one 2 MiB page holds the copy
    config, weights = load_from_l2(huge_tmpfs / "entry")
    _, want = load_checkpoint(big)
    assert all(np.array_equal(weights[name], want[name]) for name in want)
