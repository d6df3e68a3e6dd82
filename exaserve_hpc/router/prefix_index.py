"""Which replicas hold which prompt prefixes: block hashes -> replica ids.

A prompt is cut into fixed-size blocks of token ids and each full block is
named by a chained hash (the block's tokens and its parent's hash), so one
hash names a whole prefix and two prompts that share k blocks share their
first k hashes.

Two ways to fill the index:
- approximate: the router records each routing decision (`record`): "I sent
  these blocks to that replica", so it probably holds them now;
- precise: the replicas' engines publish KV events (blocks stored, blocks
  evicted; `engine/kv_events.py`) and `apply_events` mirrors them. The
  router must then hash exactly as the engine does (`EngineBlockHasher`,
  the engine's block size).

Memory is bounded by ``max_blocks`` hashes and ``max_holders`` replicas per
hash. Eviction is generational (two dicts, the old one dropped whole when
the young one fills), which behaves like LRU at O(1) per touch. A
sequence's blocks are always touched together, so if block i is indexed so
are blocks 0..i-1; `match` relies on that to binary-search the deepest
indexed block instead of walking the prompt.

A replica that leaves is forgotten in O(1): its epoch is bumped and entries
stamped with an older epoch no longer count (they are cleaned up when met).

`PrefixIndex` here is the reference. The router uses `make_index`: the same
index compiled (`_prefix_index.pyx`, one C hash table, built by `pip install`
where a C compiler is found), else this one with a log line saying so.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from array import array
from typing import Container, Optional, Sequence

from exaserve_hpc.engine.block_manager import block_hash_salt
from exaserve_hpc.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

log = logging.getLogger(__name__)
ROOT_HASH = 0x6578617365727665  # same root as engine/block_manager.py


class FastBlockHasher:
    """Chained block hashes for the approximate index: Python's tuple hash.

    Tuples of ints hash the same in every process of one Python version (no
    per-process salt), and this costs about 12 us per 1,024 tokens.
    ``max_blocks`` bounds the work for very long prompts: two prompts that
    agree on their first max_blocks blocks are treated as one prefix.
    ``scheme`` names the function, so hashes computed elsewhere (the
    gateway) are used only by a router that hashes the same way.
    """

    def __init__(self, block_size: int, max_blocks: int = 1024):
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.scheme = f"tuple-py{sys.version_info[0]}.{sys.version_info[1]}-{block_size}x{max_blocks}"

    def blocks(self, prompt_tokens: int) -> int:
        """How many hashes a prompt of this length has."""
        return min(prompt_tokens // self.block_size, self.max_blocks)

    def __call__(self, token_ids: Sequence[int]) -> list[int]:
        b = self.block_size
        tokens = tuple(token_ids[:b * self.max_blocks])
        out, parent = [], ROOT_HASH
        for lo in range(0, len(tokens) - b + 1, b):
            parent = hash((parent, tokens[lo:lo + b]))
            out.append(parent)
        return out


class EngineBlockHasher:
    """The engine's block names (`block_manager.hash_block_tokens`), for precise mode.

    Keyed with the run's salt as the engines are (``salt``: None = this process's, which
    `engine/block_manager.install_block_hash_salt` sets from the run's keys before the router and gateway are
    made). ``scheme`` names the salt by a short tag derived from it (not the salt), so hashes made
    under another run's salt are never taken for ours."""

    def __init__(self, block_size: int, max_blocks: int = 1024, salt: Optional[bytes] = None):
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.salt = block_hash_salt() if salt is None else bytes(salt)
        tag = "" if not self.salt else \
            "k" + hashlib.blake2b(b"exaserve-scheme-tag", digest_size=4, key=self.salt).hexdigest() + "-"
        self.scheme = f"blake2b8-{tag}{block_size}x{max_blocks}"

    blocks = FastBlockHasher.blocks

    def __call__(self, token_ids: Sequence[int]) -> list[int]:
        step = 4 * self.block_size
        data = array("I", token_ids[:self.block_size * self.max_blocks])
        if data.itemsize != 4:  # pragma: no cover - every Linux/macOS CPython has 4-byte "I"
            raise RuntimeError("array('I') is not 4 bytes here; the engine hashes little-endian uint32")
        raw = data.tobytes()
        out, parent, key = [], ROOT_HASH.to_bytes(8, "little"), self.salt
        for lo in range(0, len(raw) - step + 1, step):
            parent = hashlib.blake2b(parent + raw[lo:lo + step], digest_size=8, key=key).digest()
            out.append(int.from_bytes(parent, "little"))
        return out


class PrefixIndex:
    def __init__(self, max_blocks: int = 1_000_000, max_holders: int = 16):
        if max_blocks < 2:
            raise ValueError(f"max_blocks must be >= 2, got {max_blocks}")
        self.max_blocks = max_blocks
        self.max_holders = max_holders
        self._young: dict[int, dict[str, int]] = {}  # block hash -> {replica id: epoch}, newest last
        self._old: dict[int, dict[str, int]] = {}
        self._epoch: dict[str, int] = {}
        self.evicted_generations = 0

    # ---------------------------------------------------------------- filling

    def record(self, replica_id: str, hashes: Sequence[int], held: int = 0) -> None:
        """Approximate mode: the router sent these blocks to this replica.

        ``held``: leading blocks `match` found this replica holding. Those
        already in the young generation are not written again: a prefix's
        blocks are touched together, and block i whenever any block after it
        is, so the young ones are leading blocks, found by binary search (the
        old ones move to the young generation, which keeps them from eviction).
        """
        start = 0
        if held:
            young, epoch = self._young, self._epoch.get(replica_id)
            hi = held  # invariant: blocks < start are young with this holder, blocks >= hi are not
            while start < hi:
                mid = (start + hi + 1) >> 1
                holders = young.get(hashes[mid - 1])
                if holders is not None and holders.get(replica_id, -1) == epoch:
                    start = mid
                else:
                    hi = mid - 1
        self._add(replica_id, hashes[start:] if start else hashes)

    def apply_events(self, replica_id: str, events: Sequence[object]) -> None:
        """Precise mode: mirror one replica's KV events (engine/kv_events.py)."""
        for event in events:
            if isinstance(event, BlockStored):
                self._add(replica_id, event.block_hashes)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    holders = self._young.get(h) or self._old.get(h)
                    if holders is not None:
                        holders.pop(replica_id, None)
            elif isinstance(event, AllBlocksCleared):
                self.forget(replica_id)

    def forget(self, replica_id: str) -> None:
        """The replica left or lost its cache: none of its entries count any more."""
        self._epoch[replica_id] = self._epoch.get(replica_id, 0) + 1

    def _add(self, replica_id: str, hashes: Sequence[int]) -> None:
        epoch = self._epoch.setdefault(replica_id, 0)
        young, old, cap = self._young, self._old, self.max_holders
        for h in hashes:
            holders = young.get(h)
            if holders is None:
                holders = old.pop(h, None)
                if holders is None:  # a block nobody holds yet: the common case past a shared prefix
                    young[h] = {replica_id: epoch}
                    continue
                young[h] = holders
            holders.pop(replica_id, None)
            holders[replica_id] = epoch  # newest holder last
            if len(holders) > cap:
                del holders[next(iter(holders))]
        if len(young) >= self.max_blocks // 2:
            self._old, self._young = young, {}
            self.evicted_generations += 1

    # ---------------------------------------------------------------- lookup

    def _holders(self, h: int) -> Optional[dict[str, int]]:
        holders = self._young.get(h)
        return holders if holders is not None else self._old.get(h)

    def deepest(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks indexed for any replica (binary search)."""
        young, old = self._young, self._old
        lo, hi = 0, len(hashes)  # invariant: blocks < lo indexed, blocks >= hi not
        while lo < hi:
            mid = (lo + hi + 1) >> 1
            h = hashes[mid - 1]
            if young.get(h) or old.get(h):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def match(self, hashes: Sequence[int], allowed: Optional[Container[str]] = None,
              exclude: Container[str] = (), limit: int = 4, scan: int = 8) -> list[tuple[str, int]]:
        """Up to ``limit`` replicas in ``allowed`` (None: any) and not in ``exclude`` with the longest
        cached prefix, as (replica, blocks), deepest first.

        Looks at the deepest indexed block, then a few shallower levels
        (the next one, then halving three times), newest holders first and at most ``scan``
        holders per level: bounded work however many replicas share a prefix.
        """
        depth = self.deepest(hashes)
        if depth == 0:
            return []
        young, old, epochs = self._young, self._old, self._epoch
        found: dict[str, int] = {}
        level, step, halvings = depth, 1, 3
        while level >= 1 and len(found) < limit:
            h = hashes[level - 1]
            holders = young.get(h) or old.get(h)
            if holders:
                stale = None
                seen = 0
                for replica_id, epoch in reversed(holders.items()):
                    if seen >= scan:
                        break
                    seen += 1
                    if replica_id in found:
                        continue
                    if epochs.get(replica_id) != epoch:
                        stale = stale or []
                        stale.append(replica_id)
                    elif replica_id not in exclude and (allowed is None or replica_id in allowed):
                        found[replica_id] = level
                        if len(found) >= limit:
                            break
                if stale:
                    for replica_id in stale:
                        del holders[replica_id]
            if depth - level >= 1:  # after the deepest two levels, halve (at most `halvings` times)
                if halvings == 0:
                    break
                halvings -= 1
                step = level - level // 2
            level -= step
        return [(r, lvl if lvl >= depth - 1 else self._depth_of(r, hashes, lvl, depth)) for r, lvl in found.items()]

    def held(self, replica_id: str, hashes: Sequence[int], deepest: int) -> int:
        """Leading blocks of ``hashes`` (at most ``deepest``) this replica holds: one lookup when it
        lacks even the first block, else a binary search (a replica's entries are prefix-closed)."""
        epoch = self._epoch.get(replica_id)
        if epoch is None or deepest < 1:
            return 0
        holders = self._young.get(hashes[0]) or self._old.get(hashes[0])
        if not holders or holders.get(replica_id) != epoch:
            return 0
        return self._depth_of(replica_id, hashes, 1, deepest)

    def _depth_of(self, replica_id: str, hashes: Sequence[int], lo: int, hi: int) -> int:
        """Deepest level in [lo, hi] where replica_id holds the block, knowing it holds level lo."""
        epoch = self._epoch.get(replica_id)
        young, old = self._young, self._old
        while lo < hi:
            mid = (lo + hi + 1) // 2
            h = hashes[mid - 1]
            holders = young.get(h) or old.get(h)
            if holders and holders.get(replica_id) == epoch:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def holders(self, h: int) -> list[str]:
        """Current holders of one block (tests, status)."""
        holders = self._holders(h) or {}
        return [r for r, e in holders.items() if self._epoch.get(r) == e]

    def __len__(self) -> int:
        return len(self._young) + len(self._old)



try:
    from exaserve_hpc.router._prefix_index import PrefixIndex as CompiledPrefixIndex
    COMPILED_MISSING = ""
except ImportError as exc:  # not built here (no C compiler at install time): the reference serves
    CompiledPrefixIndex = None
    COMPILED_MISSING = str(exc)
_fallback_logged = False


def make_index(max_blocks: int = 1_000_000, max_holders: int = 16, compiled: bool = True):
    """The router's prefix index: the compiled one when it was built (same behaviour, a fraction of
    the router thread's time), else `PrefixIndex`. ``compiled=False``: the reference, for comparisons."""
    global _fallback_logged
    if compiled and CompiledPrefixIndex is not None:
        return CompiledPrefixIndex(max_blocks=max_blocks, max_holders=max_holders)
    if compiled and not _fallback_logged:
        _fallback_logged = True
        log.warning("the compiled prefix index is not built (%s): using the pure-Python one, which costs the "
                    "router several times more per request; reinstall with a C compiler and the Python "
                    "headers (pip install -e .) to build it", COMPILED_MISSING)
    return PrefixIndex(max_blocks=max_blocks, max_holders=max_holders)
