# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=False
"""`PrefixAffinity.route` compiled: the same decision, draw for draw, in C arithmetic.

affinity.py's `route` (with `cost` and `PowerOfTwo.sample`) is the reference:
tests/router/test_prefix_index_compiled.py routes the same requests through both and compares every
decision. This exists because `route` was half of the router thread's time per request (tuples,
attribute lookups and calls, not the policy's arithmetic). Same rules, same random stream (the
policy's own `random.Random`), costs in doubles with the reference's operation order, so every
figure is bit for bit the one Python computes. Used only when the candidates are a `ReplicaPool`.
"""

from exaserve_hpc.router.balancing import Decision


cdef struct Costs:
    double base_tokens, pair_tokens, decode_share, queue_tokens, latency_cap, kv_weight


cdef double cost(Costs* s, c, double uncached, double mean_latency, double prompt) except? -1.0:
    """affinity.PrefixAffinity.cost."""
    cdef double own = uncached + s.base_tokens, ahead, result, slow, lat
    cdef double outstanding = c.outstanding, queue_depth = c.queue_depth, running, max_batch
    if s.pair_tokens:
        own += s.pair_tokens * uncached * (prompt - uncached + uncached / 2 if prompt > uncached else uncached / 2)
    running = outstanding if outstanding >= queue_depth else queue_depth
    ahead = c.prefill_tokens
    result = (ahead + own) * (1.0 + s.decode_share * running)
    max_batch = c.max_batch_size
    if running >= max_batch:
        result += s.queue_tokens * (running + 1 - max_batch)
    lat = c.latency_ewma_ms
    if mean_latency > 0 and lat > 0:
        slow = lat / mean_latency
        result *= s.latency_cap if slow > s.latency_cap else (1.0 / s.latency_cap if slow * s.latency_cap < 1.0 else slow)
    return result * (1.0 + s.kv_weight * <double>c.kv_used)


cdef list sample(list items, exclude, Py_ssize_t k, rng):
    """balancing.PowerOfTwo.sample over a pool's members."""
    cdef Py_ssize_t n = len(items), i, tries
    cdef list picked = [], ids = []
    if n == 0:
        return picked
    if k >= n:  # all of them (a small pool compared whole): no draws
        return [c for c in items if c.replica_id not in exclude]
    getrandbits, bits = rng.getrandbits, n.bit_length()
    for tries in range(4 * k + 4):
        i = getrandbits(bits)
        while i >= n:
            i = getrandbits(bits)
        c = items[i]
        rid = c.replica_id
        if rid not in exclude and rid not in ids:
            picked.append(c)
            ids.append(rid)
            if len(picked) >= k:
                return picked
    if len(picked) < n:  # many excluded: scan the rest (rare)
        rest = [c for c in items if c.replica_id not in exclude and c.replica_id not in ids]
        rng.shuffle(rest)
        picked += rest[:k - len(picked)]
    return picked


cdef inline bint better(double cost, Py_ssize_t depth, str rid, double best_cost, Py_ssize_t best_depth,
                        str best_rid):
    """(cost, -depth, rid) < (best_cost, -best_depth, best_rid), as the reference's tuples compare."""
    if cost != best_cost:
        return cost < best_cost
    if depth != best_depth:
        return depth > best_depth
    return rid < best_rid


def route(policy, pool, exclude, key):
    """affinity.PrefixAffinity.route for a `ReplicaPool` of candidates."""
    cdef Costs k
    s, w = policy.settings, policy.settings.weights
    k.base_tokens, k.pair_tokens = s.base_tokens, s.pair_tokens
    k.decode_share, k.queue_tokens = s.decode_share, s.queue_tokens
    k.latency_cap, k.kv_weight = w.latency_cap, w.kv_weight
    cdef Py_ssize_t min_match = s.min_match_blocks, depth, deepest = 0, best_depth = 0, size
    cdef Py_ssize_t load, in_depth = 0, low_depth = 0, low_load = 0
    cdef double prompt, mean, c_cost, best_cost = 0.0, bound = 0.0, factor = s.max_load_factor
    cdef double in_cost = 0.0, low_cost = 0.0
    cdef bint have_best = False, have_in = False, have_low = False
    cdef list matches = [], drawn, members = pool.members
    cdef dict pos = pool._pos  # the pool's own id -> member index: `in` and lookups without its Python methods
    index = policy.index
    hashes = None
    if key is not None and key.block_hashes:
        hashes = key.block_hashes
        matches = index.match(hashes, pos, exclude, s.matches)
        if min_match > 1:
            matches = [(r, d) for r, d in matches if d >= min_match]
    rng = policy.balance.rng
    drawn = sample(members, exclude, len(members) if len(members) <= s.compare_all_up_to else w.samples, rng)
    if not matches and not drawn:
        return Decision(None, reason="none")
    prompt = key.prompt_tokens if key is not None else 0
    size = key.block_size if key is not None else s.block_size
    mean = pool.latency_sum_ms / len(members) if members else 0.0
    if factor:  # affinity._load_bound: members is not empty here (a match or a draw came from it)
        bound = factor * <double>(<Py_ssize_t>pool.prefilling_sum + 1) / <double>len(members)
        if not bound > 1.0:
            bound = 1.0
    # Under a bound, besides the cheapest: the cheapest within it (in_*) and the least loaded (low_*).
    best, best_rid, in_rid, low_rid = None, "", "", ""
    matched = ()
    if matches:
        matched = set()
        for r, d in matches:
            depth = d
            matched.add(r)
            if depth > deepest:
                deepest = depth
            c = members[<Py_ssize_t>pos[r]]
            c_cost = cost(&k, c, prompt - depth * size if prompt > depth * size else 0, mean, prompt)
            if not have_best or better(c_cost, depth, r, best_cost, best_depth, best_rid):
                best, best_rid, best_cost, best_depth, have_best = c, r, c_cost, depth, True
            if bound:
                load = c.prefilling
                if <double>(load + 1) <= bound:
                    if not have_in or better(c_cost, depth, r, in_cost, in_depth, in_rid):
                        in_rid, in_cost, in_depth, have_in = r, c_cost, depth, True
                if not have_low or load < low_load or (load == low_load and better(c_cost, depth, r, low_cost,
                                                                                   low_depth, low_rid)):
                    low_rid, low_cost, low_depth, low_load, have_low = r, c_cost, depth, load, True
    for c in drawn:
        r = c.replica_id
        if r in matched:
            continue
        depth = 0
        if deepest:  # a drawn replica may hold the prefix too (matches are only its newest holders)
            depth = index.held(r, hashes, deepest)
            if depth < min_match:
                depth = 0
        c_cost = cost(&k, c, prompt - depth * size if depth else prompt, mean, prompt)
        if not have_best or better(c_cost, depth, r, best_cost, best_depth, best_rid):
            best, best_rid, best_cost, best_depth, have_best = c, r, c_cost, depth, True
        if bound:
            load = c.prefilling
            if <double>(load + 1) <= bound:
                if not have_in or better(c_cost, depth, r, in_cost, in_depth, in_rid):
                    in_rid, in_cost, in_depth, have_in = r, c_cost, depth, True
            if not have_low or load < low_load or (load == low_load and better(c_cost, depth, r, low_cost,
                                                                               low_depth, low_rid)):
                low_rid, low_cost, low_depth, low_load, have_low = r, c_cost, depth, load, True
    reason = "affinity" if best_depth else ("spill" if matches else "balance")
    if bound and <double>(<Py_ssize_t>best.prefilling + 1) > bound:
        # The cheapest would go past the bound: the cheapest within it, else the least loaded (never none).
        if have_in:
            best_rid, best_depth = in_rid, in_depth
        else:
            best_rid, best_depth = low_rid, low_depth
        reason = "bounded"
    elif reason == "balance" and len(drawn) > 1 and rng.random() < w.explore:
        # The probe share: the costliest drawn within the bound (ties: the greatest id; the first such, as
        # max() keeps).
        have_best = False
        for c in drawn:
            r = c.replica_id
            if bound and <double>(<Py_ssize_t>c.prefilling + 1) > bound:
                continue
            c_cost = cost(&k, c, prompt, mean, prompt)
            if not have_best or c_cost > best_cost or (c_cost == best_cost and r > best_rid):
                best, best_rid, best_cost, have_best = c, r, c_cost, True
    return Decision(best_rid, best_depth, reason)
