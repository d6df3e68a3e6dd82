"""The prefix index: longest cached match, bounded memory, forgetting, KV events, engine-compatible hashes."""

from __future__ import annotations

from exaserve_hpc.engine.block_manager import prompt_block_hashes
from exaserve_hpc.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from exaserve_hpc.router.prefix_index import EngineBlockHasher, FastBlockHasher, PrefixIndex


def test_engine_hasher_names_blocks_exactly_as_the_engine_does():
    tokens = list(range(1000, 1000 + 70))
    assert EngineBlockHasher(16)(tokens) == prompt_block_hashes(tokens, 16)
    assert len(EngineBlockHasher(16)(tokens)) == 4  # only full blocks


def test_fast_hasher_is_chained_and_bounded():
    h = FastBlockHasher(4, max_blocks=3)
    a, b = h([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9, 1, 1, 1, 1]), h([1, 2, 3, 4, 5, 6, 7, 0, 1])
    assert len(a) == 3 and len(b) == 2  # full blocks only, at most max_blocks
    assert a[0] == b[0] and a[1] != b[1]
    # Same second block after a different first one: a different name (the hash names the whole prefix).
    assert h([0, 0, 0, 0, 5, 6, 7, 8])[1] != a[1]


def test_match_returns_deepest_holders_first_and_respects_usable():
    index = PrefixIndex()
    index.record("r1", [1, 2, 3, 4])
    index.record("r2", [1, 2])
    index.record("r3", [1, 2, 3, 9])
    assert index.match([1, 2, 3, 4, 5]) == [("r1", 4), ("r3", 3), ("r2", 2)]
    assert index.match([1, 2, 3, 4, 5], exclude={"r1"}) == [("r3", 3), ("r2", 2)]
    assert index.match([1, 2, 3, 4, 5], allowed={"r2", "r3"}, exclude={"r3"}) == [("r2", 2)]
    assert index.match([7, 8]) == []
    assert index.deepest([1, 2, 3, 4, 5]) == 4


def test_forget_drops_a_replica_in_o1_and_it_can_come_back_cold():
    index = PrefixIndex()
    index.record("r1", [1, 2, 3])
    index.record("r2", [1])
    index.forget("r1")
    assert index.match([1, 2, 3]) == [("r2", 1)]
    index.record("r1", [1])
    assert dict(index.match([1, 2, 3])) == {"r1": 1, "r2": 1}


def test_memory_is_bounded_and_oldest_prefixes_go_first():
    index = PrefixIndex(max_blocks=8)
    for i in range(20):
        index.record("r1", [1000 + i])
    assert len(index) <= 8
    assert index.match([1019]) == [("r1", 1)]
    assert index.match([1000]) == []
    # A prefix touched again survives eviction of its generation.
    index = PrefixIndex(max_blocks=8)
    index.record("r1", [1, 2])
    for i in range(3):
        index.record("r2", [100 + i])
    index.record("r1", [1, 2])  # refreshed
    for i in range(3, 6):
        index.record("r2", [100 + i])
    assert index.match([1, 2]) == [("r1", 2)]


def test_holders_per_block_are_capped():
    index = PrefixIndex(max_holders=3)
    for i in range(10):
        index.record(f"r{i}", [5])
    assert index.holders(5) == ["r7", "r8", "r9"]


def test_kv_events_store_evict_and_clear():
    index = PrefixIndex()
    index.apply_events("r1", [BlockStored(block_hashes=[11, 12, 13], parent_block_hash=None,
                                          token_ids=[0] * 12, block_size=4)])
    index.apply_events("r2", [BlockStored(block_hashes=[11], parent_block_hash=None, token_ids=[0] * 4,
                                          block_size=4)])
    assert index.match([11, 12, 13]) == [("r1", 3), ("r2", 1)]
    index.apply_events("r1", [BlockRemoved(block_hashes=[13])])
    assert index.match([11, 12, 13])[0] == ("r1", 2)
    index.apply_events("r1", [AllBlocksCleared()])
    assert index.match([11, 12, 13]) == [("r2", 1)]


def test_match_work_is_bounded_when_every_replica_holds_the_prefix():
    index = PrefixIndex()
    for i in range(3000):
        index.record(f"r{i}", [1, 2])
    found = index.match([1, 2], limit=4)
    assert len(found) == 4 and all(depth == 2 for _, depth in found)


def test_held_is_the_depth_one_replica_holds_and_forgetting_clears_it():
    index = PrefixIndex(max_blocks=1000)
    hashes = list(range(100, 110))
    index.record("a", hashes[:7])
    index.record("b", hashes[:3])
    assert [index.held(r, hashes, 10) for r in ("a", "b", "c")] == [7, 3, 0]
    assert index.held("a", hashes, 5) == 5  # capped at `deepest`
    assert index.held("a", [999] + hashes[1:], 10) == 0  # another first block: another prefix
    index.forget("a")
    assert index.held("a", hashes, 10) == 0
