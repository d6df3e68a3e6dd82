"""KV snapshot migration: engine A writes its hottest prefix blocks to HDF5,
a fresh engine B loads them and its first request hits the prefix cache."""

from types import SimpleNamespace

import h5py
import numpy as np
import pytest

from exaserve_hpc.cache.checkpoint import TinyModelSpec, create_tiny_checkpoint, load_checkpoint
from exaserve_hpc.engine.base import EngineRequest
from exaserve_hpc.engine.block_manager import ROOT_HASH, BlockManager
from exaserve_hpc.engine.kv_snapshot import KVSnapshotError, load_kv_snapshot, write_kv_snapshot
from exaserve_hpc.engine.reference import ReferenceEngine
from exaserve_hpc.engine.tokenizer import ByteTokenizer

SPEC = TinyModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=172,
                     max_position=512, shards=1, seed=1)
TOK = ByteTokenizer()
SYSTEM = "You are a helpful assistant on a supercomputer. Answer briefly and precisely. "
SHARED_BLOCKS = len(TOK.encode(SYSTEM + "Question ")) // 16   # 88 tokens: 5 full blocks


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_checkpoint(create_tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny", SPEC))


@pytest.fixture
def make(loaded):
    def factory(weights=loaded, **kwargs):
        kwargs.setdefault("max_wait_ms", 0)
        kwargs.setdefault("max_seq_len", 512)
        kwargs.setdefault("num_kv_blocks", 64)
        return ReferenceEngine.from_weights(*weights, **kwargs)
    return factory


def question(i):
    return EngineRequest(f"q{i}", TOK.encode(SYSTEM + f"Question {i}: what is {i} squared?"),
                         10, stop_token_ids=())


def serve(engine, req):
    engine.add_request(req)
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    engine.blocks.check_invariants()
    return tokens


@pytest.mark.parametrize("dtype", ["fp16", "fp8", "fp32"])
def test_fresh_engine_hits_the_migrated_prefix_with_the_same_tokens(make, tmp_path, dtype):
    a = make(kv_cache_dtype=dtype)
    for i in range(3):
        serve(a, question(i))
    want = serve(a, question(7))
    path = tmp_path / "kv.h5"
    written = write_kv_snapshot(a, path, max_blocks=32)
    assert written >= SHARED_BLOCKS and not list(tmp_path.glob(".*tmp*"))

    b = make(kv_cache_dtype=dtype)
    assert load_kv_snapshot(b, path) == written
    b.blocks.check_invariants()
    stats = b.stats()
    assert stats["kv_blocks_cached"] == written and stats["kv_blocks_used"] == 0
    assert serve(b, question(7)) == want   # same greedy tokens as A
    hit = b.stats()["prefix_hit_tokens"]
    # Question 7 was served by A, so all its full blocks (not only the shared 5) are in the snapshot.
    assert hit == (len(question(7).prompt_token_ids) - 1) // 16 * 16
    assert hit > SHARED_BLOCKS * 16 - 1


def test_hottest_first_and_prefix_closed(make, tmp_path):
    a = make(kv_cache_dtype="fp32")
    for i in range(4):
        serve(a, question(i))
    blocks = a.blocks.export_cached_blocks(SHARED_BLOCKS + 1)
    # The shared prefix was hit by 3 later questions: those blocks are hottest, root first.
    assert [b.hits for b in blocks[:SHARED_BLOCKS]] == [3] * SHARED_BLOCKS
    assert blocks[0].parent_hash == ROOT_HASH
    seen = {ROOT_HASH}
    for b in blocks:
        assert b.parent_hash in seen
        seen.add(b.block_hash)
    # A budget smaller than a chain keeps its root part: still a usable prefix.
    path = tmp_path / "kv.h5"
    assert write_kv_snapshot(a, path, max_blocks=2) == 2
    b = make(kv_cache_dtype="fp32")
    assert load_kv_snapshot(b, path) == 2
    serve(b, question(9))
    assert b.stats()["prefix_hit_tokens"] == 2 * 16


def test_import_fills_clean_blocks_only_and_skips_orphans():
    src = BlockManager(num_blocks=8, block_size=4)
    seq = SimpleNamespace(token_ids=list(range(13)), block_table=[], block_hashes=[],
                          num_computed_tokens=0, num_committed_blocks=0)
    src.allocate(seq)
    seq.num_computed_tokens = 13
    src.commit(seq)
    src.deallocate(seq)
    blocks = src.export_cached_blocks(10)
    assert len(blocks) == 3
    entries = [(b.block_hash, b.parent_hash, b.token_ids) for b in blocks]
    dst = BlockManager(num_blocks=8, block_size=4)
    assert [i for i, _ in dst.import_cached_blocks(entries[1:])] == []   # no root: unusable
    assert len(dst.import_cached_blocks(entries)) == 3
    assert dst.import_cached_blocks(entries) == []                        # already cached
    dst.check_invariants()
    bad = [(entries[0][0], entries[0][1], (9, 9, 9, 9))]
    with pytest.raises(ValueError, match="corrupt"):
        BlockManager(num_blocks=8, block_size=4).import_cached_blocks(bad)
    small = BlockManager(num_blocks=2, block_size=4)
    assert len(small.import_cached_blocks(entries)) == 2                  # ran out of clean blocks
    small.check_invariants()


def test_snapshot_from_another_model_is_refused_naming_both(make, loaded, tmp_path):
    a = make()
    serve(a, question(0))
    path = tmp_path / "kv.h5"
    write_kv_snapshot(a, path, 16)
    config, weights = loaded
    other_weights = {k: (w * 1.01).astype(w.dtype) if k == "norm" else w for k, w in weights.items()}
    b = make(weights=(config, other_weights))
    with pytest.raises(KVSnapshotError) as e:
        load_kv_snapshot(b, path)
    assert a.model_identity() in str(e.value) and b.model_identity() in str(e.value)
    assert a.model_identity() != b.model_identity()
    assert b.stats()["kv_blocks_cached"] == 0
    with pytest.raises(KVSnapshotError, match="block_size 16 .* 8"):
        load_kv_snapshot(make(block_size=8), path)
    with pytest.raises(KVSnapshotError, match="'fp16'.*'fp32'"):
        load_kv_snapshot(make(kv_cache_dtype="fp32"), path)


def test_truncated_or_corrupt_snapshot_is_refused_cleanly(make, tmp_path):
    a = make()
    serve(a, question(0))
    path = tmp_path / "kv.h5"
    write_kv_snapshot(a, path, 16)
    raw = path.read_bytes()

    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(KVSnapshotError, match="truncated or corrupt"):
        load_kv_snapshot(make(), truncated)

    flipped = tmp_path / "flipped.h5"
    flipped.write_bytes(raw)
    with h5py.File(flipped, "r+") as f:   # bit rot in the K data: header intact
        k = f["k"][()]
        k.view(np.uint8).reshape(-1)[7] ^= 0x40
        f["k"][...] = k
    b = make()
    with pytest.raises(KVSnapshotError, match="digest"):
        load_kv_snapshot(b, flipped)
    assert b.stats()["kv_blocks_cached"] == 0
    b.blocks.check_invariants()

    with pytest.raises(KVSnapshotError, match="does not exist"):
        load_kv_snapshot(make(), tmp_path / "missing.h5")
    with pytest.raises(KVSnapshotError, match="cannot write"):
        write_kv_snapshot(a, tmp_path / "no-such-dir" / "kv.h5", 16)
