"""Paged KV-cache bookkeeping: fixed-size blocks, ref counts, prefix cache.

No tensors here (the numpy pool is ``kv_cache.py``): the same manager drives
the reference engine and the timing-model engine, so both have identical
cache behaviour.

Prefix caching names a *full* block by ``hash_block_tokens(parent_hash,
token_ids)``, chained from ``ROOT_HASH`` (the scheme vLLM and SGLang use), so
two blocks with the same hash hold the K/V of the same whole prefix. A block
whose last user finished stays cached (ref_count 0, still hashed) until a new
allocation needs it; such blocks are reused least-recently-freed first.

Call protocol (``seq`` is any object with the attributes of ``BlockSequence``):
- ``can_allocate(seq)`` / ``allocate(seq)`` at admission: the block table
  covers all of ``seq.token_ids``; cached full blocks of its prefix are
  shared, and ``seq.num_computed_tokens`` starts after them.
- ``can_append(seq)`` / ``may_append(seq)`` before a step feeds one more
  token of a running sequence.
- ``commit(seq)`` after the model wrote K/V up to ``seq.num_computed_tokens``:
  newly full blocks get their hash and become shareable.
- ``deallocate(seq)`` when it finishes, is aborted or preempted.
- ``take_events()``: blocks stored / evicted since the last call (KV events).
- ``export_cached_blocks(n)`` / ``import_cached_blocks(blocks)``: the hottest
  named blocks with their parents and tokens (KV snapshot migration,
  ``kv_snapshot.py``), and installing such blocks into clean free blocks.

Heat (for export): prefix hits a block served since it was named, then
recency (blocks in use count as most recent, then the evictable LRU from
most recently freed).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from exaserve_hpc.engine.kv_events import BlockRemoved, BlockStored, KVEvent
from exaserve_hpc.jobdir import JobDir, run_salt

ROOT_HASH = 0x6578617365727665  # b"exaserve": parent of a sequence's first block


_SALT = b""  # this process's block-hash key: the run's secret salt (set_block_hash_salt), b"" = unsalted


def set_block_hash_salt(salt: bytes) -> None:
    """Key every block hash of this process with the run's salt (``install_block_hash_salt``).

    Block names leave the replica in KV events; unsalted, a guess of a prompt can be checked against them
    offline (a 4-digit secret in a known template falls to 10,000 hashes). Keyed blake2b with a per-run
    secret makes them useless to anyone without the run's keys. The replicas, the router and the gateway
    of one run must use the same salt (they read it from the run's keys directory); set it before any
    engine or ``EngineBlockHasher`` is made."""
    global _SALT
    if not isinstance(salt, (bytes, bytearray)) or len(salt) > 64:
        raise ValueError("the block-hash salt must be at most 64 bytes (a blake2b key)")
    _SALT = bytes(salt)


def block_hash_salt() -> bytes:
    return _SALT


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int], salt: bytes | None = None) -> int:
    """64-bit hash of a full block given its parent's hash: stable across
    processes and machines of one run (blake2b keyed with the run's salt, not
    Python's per-process ``hash``), so that run's router can compute the same
    names from a prompt. ``salt``: None = this process's (``set_block_hash_salt``)."""
    data = parent_hash.to_bytes(8, "little") + np.asarray(token_ids, dtype="<u4").tobytes()
    key = _SALT if salt is None else salt
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, key=key).digest(), "little")


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of every full block of ``token_ids``."""
    hashes, parent = [], ROOT_HASH
    for lo in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[lo:lo + block_size])
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class CachedBlock:
    """A named block as exported: what rebuilds its prefix-cache entry elsewhere."""

    block_id: int                  # in this manager's pool
    block_hash: int
    parent_hash: int               # ROOT_HASH for a sequence's first block
    token_ids: tuple[int, ...]     # block_size ids
    hits: int                      # prefix hits served since it was named


class BlockSequence(Protocol):
    """What the manager reads and writes on a sequence."""

    token_ids: list[int]           # every token whose K/V the sequence needs (prompt, then output)
    block_table: list[int]         # block ids, position p lives in block_table[p // block_size]
    block_hashes: list[int]        # memo: content hashes of its full blocks, by index
    num_computed_tokens: int       # tokens whose K/V are written
    num_committed_blocks: int      # leading blocks already hashed/registered


@dataclass
class BlockManager:
    """Allocates fixed-size KV blocks to sequences; see the module docstring."""

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    record_events: bool = False    # keep BlockStored/BlockRemoved for take_events()
    # Per block id (plain lists, not objects: a simulator builds thousands of managers).
    ref_count: list[int] = field(init=False, repr=False)
    block_hash: list[int | None] = field(init=False, repr=False)  # set while cached
    block_parent: list[int | None] = field(init=False, repr=False)  # parent's hash, while named
    block_tokens: list[tuple[int, ...] | None] = field(init=False, repr=False)  # while named
    block_hits: list[int] = field(init=False, repr=False)  # prefix hits since named (heat)
    prefix_hit_tokens: int = field(init=False, default=0)     # computation skipped, total
    prefix_query_tokens: int = field(init=False, default=0)   # tokens looked up, total

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError(f"num_blocks ({self.num_blocks}) and block_size ({self.block_size}) "
                             "must be >= 1")
        self.ref_count = [0] * self.num_blocks
        self.block_hash = [None] * self.num_blocks
        self.block_parent = [None] * self.num_blocks
        self.block_tokens = [None] * self.num_blocks
        self.block_hits = [0] * self.num_blocks
        self._clean: deque[int] = deque(range(self.num_blocks))   # free, never hashed
        self._evictable: OrderedDict[int, None] = OrderedDict()   # free, hashed; LRU first
        self._cached: dict[int, int] = {}                           # hash -> block id
        self._events: list[KVEvent] = []

    # ------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take (clean ones plus evictable cached ones)."""
        return len(self._clean) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks still holding a reusable prefix."""
        return len(self._evictable)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_hash(self, seq: BlockSequence, index: int) -> int:
        while len(seq.block_hashes) <= index:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if i else ROOT_HASH
            bs = self.block_size
            seq.block_hashes.append(hash_block_tokens(parent, seq.token_ids[i * bs:(i + 1) * bs]))
        return seq.block_hashes[index]

    def _prefix_hits(self, seq: BlockSequence) -> list[int]:
        """Cached blocks matching the sequence's leading full blocks. The last
        token is never covered: its logits must be computed."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for index in range((len(seq.token_ids) - 1) // self.block_size):
            block_id = self._cached.get(self._block_hash(seq, index))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # ------------------------------------------------------------ allocation

    def can_allocate(self, seq: BlockSequence) -> bool:
        hits = self._prefix_hits(seq)
        revived = sum(1 for b in hits if self.ref_count[b] == 0)  # leave the free pool
        new = self.blocks_needed(len(seq.token_ids)) - len(hits)
        return new + revived <= self.num_free_blocks

    def allocate(self, seq: BlockSequence) -> int:
        """Give ``seq`` blocks for all its tokens; returns the prefix-hit tokens."""
        assert not seq.block_table and seq.num_computed_tokens == 0, "sequence already holds blocks"
        if not self.can_allocate(seq):
            raise RuntimeError(f"allocate without can_allocate: {self.num_free_blocks} free blocks")
        hits = self._prefix_hits(seq)
        for block_id in hits:
            if self.ref_count[block_id] == 0:
                del self._evictable[block_id]
            self.ref_count[block_id] += 1
            self.block_hits[block_id] += 1
        seq.block_table = hits + [self._take_free() for _ in
                                  range(self.blocks_needed(len(seq.token_ids)) - len(hits))]
        hit_tokens = len(hits) * self.block_size
        seq.num_computed_tokens = hit_tokens
        seq.num_committed_blocks = len(hits)
        if self.enable_prefix_caching:
            self.prefix_hit_tokens += hit_tokens
            self.prefix_query_tokens += len(seq.token_ids)
        return hit_tokens

    def _take_free(self) -> int:
        if self._clean:
            block_id = self._clean.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)
            h = self.block_hash[block_id]
            assert h is not None and self._cached[h] == block_id
            del self._cached[h]
            if self.record_events:
                self._events.append(BlockRemoved(block_hashes=[h]))
            self._forget_name(block_id)
        assert self.ref_count[block_id] == 0, f"block {block_id} taken while in use"
        self.ref_count[block_id] = 1
        return block_id

    def can_append(self, seq: BlockSequence) -> bool:
        missing = self.blocks_needed(len(seq.token_ids)) - len(seq.block_table)
        return missing <= self.num_free_blocks

    def may_append(self, seq: BlockSequence) -> None:
        """Grow the block table to cover every token of ``seq``."""
        while len(seq.block_table) < self.blocks_needed(len(seq.token_ids)):
            seq.block_table.append(self._take_free())

    def commit(self, seq: BlockSequence) -> None:
        """Register the blocks that became full since the last commit."""
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if not self.enable_prefix_caching:
            seq.num_committed_blocks = full
            return
        stored: list[int] = []
        first = seq.num_committed_blocks
        for index in range(first, full):
            h = self._block_hash(seq, index)
            block_id = seq.block_table[index]
            if self.block_hash[block_id] is None and h not in self._cached:
                # (a duplicate of a cached block stays unnamed)
                bs = self.block_size
                self._name(block_id, h, seq.block_hashes[index - 1] if index else ROOT_HASH,
                           tuple(seq.token_ids[index * bs:(index + 1) * bs]))
                stored.append(h)
        if stored and self.record_events:
            bs = self.block_size
            self._events.append(BlockStored(
                block_hashes=stored,
                parent_block_hash=seq.block_hashes[first - 1] if first else None,
                token_ids=list(seq.token_ids[first * bs:full * bs]), block_size=bs))
        seq.num_committed_blocks = full

    def deallocate(self, seq: BlockSequence) -> None:
        """Release the sequence's blocks; hashed ones stay cached until evicted.
        The tail is released first so it is evicted before the shared head."""
        for block_id in reversed(seq.block_table):
            assert self.ref_count[block_id] > 0, f"block {block_id} freed twice"
            self.ref_count[block_id] -= 1
            if self.ref_count[block_id] == 0:
                if self.block_hash[block_id] is not None:
                    self._evictable[block_id] = None
                else:
                    self._clean.append(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0

    def _name(self, block_id: int, h: int, parent: int, tokens: tuple[int, ...]) -> None:
        self.block_hash[block_id] = h
        self.block_parent[block_id] = parent
        self.block_tokens[block_id] = tokens
        self.block_hits[block_id] = 0
        self._cached[h] = block_id

    def _forget_name(self, block_id: int) -> None:
        self.block_hash[block_id] = None
        self.block_parent[block_id] = None
        self.block_tokens[block_id] = None
        self.block_hits[block_id] = 0

    # ------------------------------------------------------------ snapshot export / import

    def export_cached_blocks(self, max_blocks: int) -> list[CachedBlock]:
        """Up to ``max_blocks`` named blocks, hottest first (see the module
        docstring), prefix-closed: each block's parent is ROOT_HASH or comes
        earlier in the list. A block whose chain lost an ancestor to eviction
        can never be hit, so it is left out."""
        recency = {b: rank for rank, b in enumerate(self._evictable)}   # higher: freed later
        in_use = len(recency)
        named = [b for b, h in enumerate(self.block_hash) if h is not None]
        named.sort(key=lambda b: (self.block_hits[b], recency.get(b, in_use + self.ref_count[b])),
                   reverse=True)
        chosen: set[int] = set()
        out: list[CachedBlock] = []
        for block_id in named:
            chain, h = [], self.block_hash[block_id]
            while h != ROOT_HASH and h not in chosen:
                b = self._cached.get(h)
                if b is None:
                    chain = []   # orphan: an ancestor was evicted
                    break
                chain.append(b)
                h = self.block_parent[b]
            for b in reversed(chain):
                if len(out) >= max_blocks:
                    return out
                chosen.add(self.block_hash[b])
                out.append(CachedBlock(b, self.block_hash[b], self.block_parent[b],
                                       self.block_tokens[b], self.block_hits[b]))
        return out

    def import_cached_blocks(self, blocks: Sequence[tuple[int, int, Sequence[int]]]
                             ) -> list[tuple[int, int]]:
        """Name clean free blocks after ``(hash, parent_hash, token_ids)``
        entries given root-first (as ``export_cached_blocks`` lists them), as
        evictable cached blocks, the first entry the most recently used.
        Returns ``(entry index, block id)`` for each installed one: the caller
        writes their K/V. Skipped: hashes already cached (their children still
        chain on), entries whose parent is not cached (a partial chain is only
        usable from its root), everything once no clean block is left (cached
        blocks are never evicted for an import). ValueError if an entry's hash
        does not match its parent and tokens."""
        if not self.enable_prefix_caching:
            return []
        entries = [(h, parent, tuple(int(t) for t in tokens)) for h, parent, tokens in blocks]
        for index, (h, parent, tokens) in enumerate(entries):   # all checked before any is named
            if len(tokens) != self.block_size or hash_block_tokens(parent, tokens) != h:
                raise ValueError(
                    f"snapshot block {index}: hash {h:#018x} does not match its parent "
                    f"{parent:#018x} and {len(tokens)} token ids (block_size {self.block_size}); "
                    "the snapshot is corrupt")
        installed: list[tuple[int, int]] = []
        for index, (h, parent, tokens) in enumerate(entries):
            if h in self._cached or (parent != ROOT_HASH and parent not in self._cached):
                continue
            if not self._clean:
                break
            block_id = self._clean.popleft()
            assert self.ref_count[block_id] == 0 and self.block_hash[block_id] is None, block_id
            self._name(block_id, h, parent, tokens)
            self._evictable[block_id] = None
            installed.append((index, block_id))
            if self.record_events:
                self._events.append(BlockStored(
                    block_hashes=[h], parent_block_hash=None if parent == ROOT_HASH else parent,
                    token_ids=list(tokens), block_size=self.block_size))
        for _, block_id in reversed(installed):   # hottest (first) evicted last
            self._evictable.move_to_end(block_id)
        return installed

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def check_invariants(self) -> None:
        """Every block is in exactly one state; cached names point back. (Tests.)"""
        free = set(self._clean) | set(self._evictable)
        assert len(free) == len(self._clean) + len(self._evictable)
        for block_id, (refs, h) in enumerate(zip(self.ref_count, self.block_hash)):
            assert refs >= 0 and (refs == 0) == (block_id in free), block_id
            assert (block_id in self._evictable) == (refs == 0 and h is not None), block_id
            if h is not None:
                assert self._cached[h] == block_id
                parent, tokens = self.block_parent[block_id], self.block_tokens[block_id]
                assert tokens is not None and parent is not None
                assert hash_block_tokens(parent, tokens) == h, block_id
            else:
                assert self.block_tokens[block_id] is None and self.block_hits[block_id] == 0
        assert len(self._cached) == sum(h is not None for h in self.block_hash)


def install_block_hash_salt(jobdir: JobDir) -> bytes:
    """Key this process's block hashes (engines, the router's and gateway's prompt hashers) with the run's
    salt. Call it before any engine, router or gateway is made: replicas, router and gateway of one run must
    hash alike for precise prefix routing, and differently from every other run. Returns the salt."""
    salt = run_salt(jobdir)
    set_block_hash_salt(salt)
    return salt
