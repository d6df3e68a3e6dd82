"""The compiled prefix index (_prefix_index.pyx) and route (_affinity_route.pyx) against the pure-Python
reference: the same operations through both, every result compared; and the fallback when they are absent."""

from __future__ import annotations

import logging
import os
import random
from array import array

import pytest

from exaserve_hpc.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from exaserve_hpc.router import prefix_index
from exaserve_hpc.router.affinity import AffinitySettings, PrefixAffinity, compiled_route
from exaserve_hpc.router.balancing import ReplicaLoad, ReplicaPool, WeightSettings, shift_prefilling
from exaserve_hpc.router.prefix_index import CompiledPrefixIndex, PrefixIndex, make_index

needs_compiled = pytest.mark.skipif(CompiledPrefixIndex is None, reason=f"extension not built: "
                                    f"{prefix_index.COMPILED_MISSING}")


def test_the_extension_is_built_where_the_suite_is_ci():
    """tests/run.sh installs gcc and the Python headers, so `pip install -e .` builds it: under CI=true a
    missing build fails here instead of every comparison below skipping quietly."""
    if CompiledPrefixIndex is None or compiled_route is None:
        message = f"the router's compiled hot path is not built: {prefix_index.COMPILED_MISSING or 'no route'}"
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
            pytest.fail(message)
        pytest.skip(message)


def _check_same(ops: int, seed: int, max_blocks: int, max_holders: int, signed: bool) -> dict:
    """Random records, KV events, forgets and lookups on both indexes; returns how often each op ran."""
    rng = random.Random(seed)
    ref, fast = PrefixIndex(max_blocks, max_holders), CompiledPrefixIndex(max_blocks, max_holders)
    lo, hi = (-2**63, 2**63 - 1) if signed else (0, 2**64 - 1)
    # Prompts sharing prefixes: a few roots, branches below them; some hashes are small (collide in a
    # badly mixed table) and some at the 64-bit edges.
    roots = [[rng.randint(lo, hi) for _ in range(rng.randint(1, 12))] for _ in range(12)] + [[hi, lo, 0, 1, 2]]
    prompts = [r + [rng.randint(lo, hi) for _ in range(rng.randint(0, 10))] for r in roots for _ in range(6)]
    replicas = [f"r{i}" for i in range(24)]
    counts: dict[str, int] = {}
    for _ in range(ops):
        op = rng.choices(["record", "held_record", "stored", "removed", "cleared", "forget", "match", "held"],
                         [30, 20, 6, 6, 1, 2, 25, 10])[0]
        counts[op] = counts.get(op, 0) + 1
        r, p = rng.choice(replicas), rng.choice(prompts)
        # Half the time the compiled index gets the hashes as a packed request's array (its buffer read
        # directly), the reference a list.
        fp = array("q" if signed else "Q", p) if rng.random() < 0.5 else p
        if op == "record":
            ref.record(r, p)
            fast.record(r, fp)
        elif op == "held_record":  # as the policy does: the depth match found, then record
            limit = rng.randint(1, 6)
            got = [ref.match(p, limit=limit), fast.match(fp, limit=limit)]
            assert got[0] == got[1]
            held = dict(got[0]).get(r, 0)
            ref.record(r, p, held)
            fast.record(r, fp, held)
        elif op in ("stored", "removed", "cleared"):
            k = rng.randint(0, len(p))
            event = (BlockStored(block_hashes=p[:k], parent_block_hash=None, token_ids=[], block_size=16)
                     if op == "stored" else BlockRemoved(block_hashes=p[k:]) if op == "removed"
                     else AllBlocksCleared())
            for index in (ref, fast):
                index.apply_events(r, [event])
        elif op == "forget":
            for index in (ref, fast):
                index.forget(r)
        elif op == "match":
            allowed = set(rng.sample(replicas, 12)) if rng.random() < 0.3 else None
            exclude = set(rng.sample(replicas, 4)) if rng.random() < 0.5 else ()
            limit, scan = rng.randint(1, 6), rng.randint(1, 10)
            assert ref.match(p, allowed, exclude, limit, scan) == fast.match(fp, allowed, exclude, limit, scan)
        else:
            deepest = ref.deepest(p)
            assert deepest == fast.deepest(fp)
            assert ref.held(r, p, deepest) == fast.held(r, fp, deepest)
        assert len(ref) == len(fast)
        assert ref.evicted_generations == fast.evicted_generations
    for p in prompts:  # the whole state, block by block
        for h in p:
            assert ref.holders(h) == fast.holders(h)
    return counts


@needs_compiled
@pytest.mark.parametrize("seed", range(4))
def test_compiled_index_gives_the_references_results(seed):
    counts = _check_same(4000, seed, max_blocks=1_000_000, max_holders=16, signed=seed % 2 == 0)
    assert min(counts.values()) > 10  # every operation ran


@needs_compiled
@pytest.mark.parametrize("seed", range(4))
def test_compiled_index_evicts_and_caps_holders_as_the_reference_does(seed):
    # Small bounds: generations rotate every few records and blocks hit the holder cap.
    _check_same(4000, seed, max_blocks=[8, 40, 200, 2][seed], max_holders=[3, 1, 5, 16][seed], signed=True)


@needs_compiled
def test_compiled_index_grows_and_rebuilds_its_table_under_churn():
    rng = random.Random(7)
    ref, fast = PrefixIndex(50_000), CompiledPrefixIndex(50_000)
    for i in range(20_000):  # ~200k blocks: the table doubles, rotations leave gone entries to reuse
        hashes = [rng.getrandbits(64) for _ in range(10)]
        for index in (ref, fast):
            index.record(f"r{i % 100}", hashes)
        if i % 997 == 0:
            assert ref.match(hashes) == fast.match(hashes) == [(f"r{i % 100}", 10)]
    assert len(ref) == len(fast) and ref.evicted_generations == fast.evicted_generations > 5


@needs_compiled
def test_compiled_index_refuses_hashes_beyond_64_bits():
    with pytest.raises(OverflowError):
        CompiledPrefixIndex().record("r1", [2**64])


def test_policy_uses_the_compiled_index_when_built_and_falls_back_with_a_log_line(monkeypatch, caplog):
    policy = PrefixAffinity(AffinitySettings(block_size=4))
    assert type(policy.index) is (CompiledPrefixIndex or PrefixIndex)
    monkeypatch.setattr(prefix_index, "CompiledPrefixIndex", None)
    monkeypatch.setattr(prefix_index, "_fallback_logged", False)
    caplog.clear()  # where the extension is not built, the first policy above logged it already
    with caplog.at_level(logging.WARNING, logger=prefix_index.__name__):
        policy = PrefixAffinity(AffinitySettings(block_size=4))
        PrefixAffinity(AffinitySettings(block_size=4))
    assert type(policy.index) is PrefixIndex
    assert sum("pure-Python" in r.getMessage() for r in caplog.records) == 1  # once, not per policy
    key = policy.routing_key(list(range(12)))
    policy.index.record("r1", key.block_hashes)
    assert policy.index.match(key.block_hashes) == [("r1", 3)]
    assert type(make_index(compiled=False)) is PrefixIndex


def _pool(rng: random.Random, n: int) -> ReplicaPool:
    pool = ReplicaPool()
    for i in range(n):
        load = ReplicaLoad(f"r{i:03d}", "m", outstanding=rng.randrange(0, 12), max_batch_size=rng.choice([4, 8, 64]),
                           queue_depth=rng.randrange(0, 12), kv_used=rng.choice([0.0, rng.random()]),
                           prefill_tokens=rng.choice([0, rng.randrange(0, 20_000)]), prefilling=rng.randrange(0, 6))
        pool.add(load)
        pool.set_latency(load, rng.choice([0.0, rng.uniform(5, 50)]))
    return pool


@needs_compiled
@pytest.mark.parametrize("variant", [
    {},  # the served defaults
    {"pair_tokens": 0.002, "min_match_blocks": 3, "base_tokens": 0},  # attention term, a minimum match
    {"matches": 1, "weights": WeightSettings(samples=2, explore=0.5, latency_cap=2.0)},  # the probe share
    {"max_load_factor": 1.0},  # a tight load bound: often no candidate within it (the least loaded)
    {"max_load_factor": 1.5, "weights": WeightSettings(samples=3, explore=0.5)},  # the probe share within it
    {"compare_all_up_to": 64, "weights": WeightSettings(samples=4, explore=0.5)},  # the pool of 40 compared whole
])
def test_compiled_route_makes_the_references_decisions(variant):
    rng = random.Random(len(variant))
    settings = AffinitySettings(block_size=4, index_blocks=400, **variant)  # small: generations rotate
    fast, ref = PrefixAffinity(settings, seed=3), PrefixAffinity(settings, seed=3, compiled=False)
    assert fast._compiled_route is not None and ref._compiled_route is None
    pool = _pool(rng, 40)
    systems = [[rng.randrange(1000) for _ in range(rng.choice([0, 8, 40]))] for _ in range(5)]
    reasons = set()
    for i in range(3000):
        tokens = rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randrange(0, 30))]
        key = fast.routing_key(tokens) if rng.random() < 0.95 else None
        exclude = set(rng.sample([c.replica_id for c in pool], rng.choice([0, 0, 3, 39, 40])))
        got = [p.route(pool, exclude, key) for p in (fast, ref)]
        assert got[0] == got[1], i
        reasons.add(got[0].reason)
        for p in (fast, ref):
            p.commit(got[0], key)
        load = rng.choice(pool.members)  # loads move between decisions
        load.outstanding, load.prefill_tokens = rng.randrange(0, 12), rng.randrange(0, 5000)
        shift_prefilling(load, [pool], rng.randrange(-3, 4))
        if rng.random() < 0.01:
            gone = rng.choice(pool.members).replica_id
            for p in (fast, ref):
                p.forget(gone)
    assert {"affinity", "balance", "none"} <= reasons
    assert ("bounded" in reasons) == bool(settings.max_load_factor)
    assert pool.prefilling_sum == sum(c.prefilling for c in pool)  # the running sum the bound reads
