"""BlockManager: allocation, ref counts, chained prefix hashes, LRU eviction, events."""

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exaserve_hpc.engine.block_manager import (
    ROOT_HASH, BlockManager, hash_block_tokens, prompt_block_hashes,
)
from exaserve_hpc.engine.kv_events import BlockRemoved, BlockStored


@dataclass(eq=False)
class Seq:
    token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_committed_blocks: int = 0


def computed(bm, seq):
    """Pretend the model wrote K/V for every token, then commit."""
    seq.num_computed_tokens = len(seq.token_ids)
    bm.commit(seq)


def test_hashes_are_chained_and_stable():
    # Pinned: a router in another process must compute the same names.
    assert hash_block_tokens(ROOT_HASH, [1, 2, 3, 4]) == 0x5e04d13e0b36c94f
    a = prompt_block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = prompt_block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert len(a) == 2 and len(b) == 2          # the partial tail block has no name
    assert a[1] == hash_block_tokens(a[0], [5, 6, 7, 8])
    assert a[1] != b[1]                         # same tokens, different parent


def test_allocate_free_and_ref_counts():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = Seq(list(range(10))), Seq(list(range(100, 107)))
    assert bm.can_allocate(a)
    assert bm.allocate(a) == 0 and len(a.block_table) == 3
    assert not bm.can_allocate(b)               # needs 2, one left
    with pytest.raises(RuntimeError, match="without can_allocate"):
        bm.allocate(b)
    assert bm.num_free_blocks == 1 and bm.num_used_blocks == 3
    a.token_ids += [11, 12]                     # 12 tokens: still 3 blocks
    assert bm.can_append(a)
    bm.may_append(a)
    a.token_ids.append(13)                      # 13 tokens: a 4th block
    bm.may_append(a)
    assert len(a.block_table) == 4 and bm.num_free_blocks == 0
    a.token_ids.append(14)
    a.token_ids += [0] * 3
    assert not bm.can_append(a)
    bm.deallocate(a)
    bm.check_invariants()
    assert bm.num_free_blocks == 4 and a.block_table == []
    with pytest.raises(AssertionError, match="freed twice"):
        bm.deallocate(Seq([1], block_table=[0]))


def test_prefix_hits_share_blocks_and_skip_tokens():
    bm = BlockManager(num_blocks=16, block_size=4)
    prefix = list(range(50, 60))                 # 10 tokens: 2 full blocks shared
    a = Seq(prefix + [1, 2, 3])
    bm.allocate(a)
    assert bm.allocate(Seq(prefix + [7])) == 0  # nothing committed yet: no hit
    computed(bm, a)
    b = Seq(prefix + [4, 5, 6, 7, 8])
    assert bm.allocate(b) == 8
    assert b.block_table[:2] == a.block_table[:2] and b.num_computed_tokens == 8
    assert [bm.ref_count[i] for i in a.block_table[:2]] == [2, 2]
    assert bm.prefix_hit_tokens == 8 and bm.prefix_query_tokens == 13 + 11 + 15
    # A prompt that is exactly cached full blocks still computes its last token.
    c = Seq(prefix[:8])
    assert bm.allocate(c) == 4 and c.num_computed_tokens == 4
    bm.check_invariants()


def test_cached_blocks_survive_free_and_are_evicted_lru_tail_first():
    bm = BlockManager(num_blocks=6, block_size=2, record_events=True)
    a = Seq([1, 2, 3, 4, 5, 6, 7])              # 3 full blocks + 1 partial
    bm.allocate(a)
    computed(bm, a)
    (stored,) = bm.take_events()
    assert isinstance(stored, BlockStored) and stored.parent_block_hash is None
    assert stored.block_hashes == prompt_block_hashes(a.token_ids, 2)
    assert stored.token_ids == [1, 2, 3, 4, 5, 6]
    hashes = stored.block_hashes
    bm.deallocate(a)
    assert bm.num_cached_blocks == 3 and bm.num_free_blocks == 6
    # A 2-block prefix hit revives cached blocks (they leave the evictable set).
    b = Seq([1, 2, 3, 4, 9, 9, 9])
    assert bm.allocate(b) == 4 and bm.num_cached_blocks == 1
    bm.deallocate(b)
    # Need 5 fresh blocks: 3 clean ones, then the evictable ones, a's tail first.
    c = Seq(list(range(100, 110)))
    bm.allocate(c)
    removed = [e for e in bm.take_events() if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [[hashes[2]], [hashes[1]]]
    assert bm.num_cached_blocks == 1                                   # the shared head is kept
    assert [h for h in bm.block_hash if h is not None] == [hashes[0]]
    bm.deallocate(c)
    assert bm.allocate(Seq([1, 2, 9])) == 2
    bm.check_invariants()


def test_duplicate_content_is_not_registered_twice():
    bm = BlockManager(num_blocks=8, block_size=2)
    a, b = Seq([1, 2, 3, 4, 5]), Seq([1, 2, 3, 4, 6])
    bm.allocate(a)
    bm.allocate(b)                               # concurrent: neither committed yet
    computed(bm, a)
    computed(bm, b)
    assert len({bm.block_hash[i] for i in a.block_table[:2]}) == 2
    assert all(bm.block_hash[i] is None for i in b.block_table)
    bm.deallocate(b)
    bm.check_invariants()
    assert bm.num_cached_blocks == 0             # b's duplicates went back clean


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = Seq([1, 2, 3, 4, 5])
    bm.allocate(a)
    computed(bm, a)
    bm.deallocate(a)
    assert bm.num_cached_blocks == 0 and bm.allocate(Seq([1, 2, 3, 4, 5])) == 0
    assert bm.prefix_hit_tokens == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["new", "grow", "free"]), st.integers(0, 5),
                          st.integers(1, 12)), max_size=40))
def test_random_operations_keep_invariants(ops):
    bm = BlockManager(num_blocks=10, block_size=3)
    live: list[Seq] = []
    for op, pick, n in ops:
        if op == "new":
            seq = Seq([pick % 2] * 4 + list(range(n)))  # two shared prefixes
            if bm.can_allocate(seq):
                bm.allocate(seq)
                computed(bm, seq)
                live.append(seq)
        elif live and op == "grow":
            seq = live[pick % len(live)]
            seq.token_ids.append(n)
            if bm.can_append(seq):
                bm.may_append(seq)
                computed(bm, seq)
            else:
                seq.token_ids.pop()
        elif live:
            bm.deallocate(live.pop(pick % len(live)))
        bm.check_invariants()
        refs = sum(bm.ref_count)
        assert refs == sum(len(s.block_table) for s in live)
        for s in live:
            assert len(s.block_table) * 3 >= len(s.token_ids)
