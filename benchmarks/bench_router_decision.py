"""Routing decision time with 3,072 registered replicas and a warm prefix index.

    python benchmarks/bench_router_decision.py [--replicas 3072] [--requests 20000] [--pure-python]

One model served by every replica (the worst case: all of them are
candidates). The index is warmed with one turn of each of 30,000
conversations (one of 64 shared 512-token system prompts + a 512-token
conversation start); measured requests are next turns of random
conversations (the previous prompt + 128 new tokens), so most find a deep
cached match. Replica loads are random and change between decisions.

Reported (median / p99, microseconds):
- decision: `PrefixAffinity.route` given the prompt's block hashes (index
  lookup, candidate costs, power-of-two draw);
- index update: `PrefixAffinity.commit` (recording the choice; the
  dispatcher does it once the request is on its way);
- hashing: the prompt's chained block hashes (16-token blocks, 1,152
  tokens). The gateway processes do this (gateway/app.py sends
  prefix_hashes with each request), so it is off the router's thread;
- dispatcher: `Dispatcher.on_request` end to end (decision, bookkeeping, the
  outgoing message), for the request then its last chunk: with the
  gateway's hashes (the served path), and hashing in the router (a native
  client that sends none);
- the same decision with the power-of-two policy alone;
- the router thread's own steps per request, through real ZeroMQ sockets
  (inproc) and the real `ZmqRouter` code: receive (identity + payload frames),
  decode, decide (`route`), record (`commit`), the rest of the dispatcher's
  bookkeeping, send to the replica; then the finish: receive the replica's
  last chunk, decode, dispatcher, encode and send to the gateway.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import zmq

from exaserve_hpc.protocol import GenerateRequest, ReplicaHello, TokenChunk, encode
from exaserve_hpc.router.affinity import AffinitySettings, PrefixAffinity
from exaserve_hpc.router.balancing import PowerOfTwo
from exaserve_hpc.router.dispatch import Dispatcher, DispatchSettings

BLOCK = 16


def percentiles(samples_ns: list[int]) -> str:
    s = sorted(samples_ns)
    return f"median {s[len(s) // 2] / 1000:6.1f} us   p99 {s[int(0.99 * (len(s) - 1))] / 1000:6.1f} us"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=3072)
    parser.add_argument("--conversations", type=int, default=30000)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--pure-python", action="store_true",
                        help="the pure-Python prefix index and route (the reference) even where the compiled ones are built")
    args = parser.parse_args(argv)
    rng = random.Random(1)
    policy = PrefixAffinity(AffinitySettings(block_size=BLOCK), seed=1, compiled=not args.pure_python)
    d = Dispatcher(policy, DispatchSettings(), {"m"})
    for i in range(args.replicas):
        rid = f"node{i // 8:03d}/gpu{i % 8}"
        d.on_replica_message(rid, ReplicaHello(replica_id=rid, model="m", pid=i, max_batch_size=64,
                                               max_seq_len=8192), 0.0)
    pool = d.pools["m"]
    for load in pool:
        load.outstanding = rng.randrange(0, 48)
        load.latency_ewma_ms = rng.uniform(8, 30)
        pool.set_latency(load, load.latency_ewma_ms)
    systems = [[rng.randrange(50000) for _ in range(512)] for _ in range(64)]
    prompts = [rng.choice(systems) + [rng.randrange(50000) for _ in range(512)] for _ in range(args.conversations)]
    started = time.perf_counter()
    for p in prompts:
        key = policy.routing_key(p)
        policy.commit(policy.route(pool, frozenset(), key), key)
    print(f"{args.replicas} replicas; {type(policy.index).__module__} index, "
          f"{'compiled' if policy._compiled_route else 'pure-Python'} route; index warmed with {len(prompts)} conversations "
          f"({len(policy.index)} blocks indexed) in {time.perf_counter() - started:.1f}s")

    turns = [rng.choice(prompts) + [rng.randrange(50000) for _ in range(128)] for _ in range(args.requests)]
    keys = [policy.routing_key(t) for t in turns]
    loads = list(pool)
    decide, commit, hashing, reasons = [], [], [], {}
    for t, key in zip(turns, keys):
        for _ in range(4):  # loads move between decisions
            rng.choice(loads).outstanding = rng.randrange(0, 48)
        t0 = time.perf_counter_ns()
        decision = policy.route(pool, frozenset(), key)
        t1 = time.perf_counter_ns()
        policy.commit(decision, key)
        t2 = time.perf_counter_ns()
        policy.routing_key(t)
        t3 = time.perf_counter_ns()
        decide.append(t1 - t0)
        commit.append(t2 - t1)
        hashing.append(t3 - t2)
        reasons[decision.reason] = reasons.get(decision.reason, 0) + 1
    print(f"decision (given block hashes): {percentiles(decide)}   branches {reasons}")
    print(f"index update after sending:    {percentiles(commit)}")
    print(f"hashing a {len(turns[0])}-token prompt:   {percentiles(hashing)}   (in the gateway)")

    scheme = policy.hasher.scheme
    for label, hashed in (("with the gateway's hashes", True), ("hashing in the router", False)):
        dispatch = []
        for i, (t, key) in enumerate(zip(turns, keys)):
            request = GenerateRequest(request_id=f"q{i}-{hashed}", model="m", prompt_token_ids=t, max_tokens=16,
                                      prefix_hashes=key.block_hashes if hashed else [],
                                      prefix_scheme=scheme if hashed else "")
            t0 = time.perf_counter_ns()
            [out] = d.on_request(b"gw", request, 1.0)
            d.on_replica_message(out.peer.decode(), TokenChunk(request_id=request.request_id, token_ids=[1],
                                                               finished=True), 1.0)
            dispatch.append(time.perf_counter_ns() - t0)
        print(f"dispatcher request + finish, {label}: {percentiles(dispatch)}")

    p2c = PowerOfTwo(seed=2)
    plain = []
    for _ in range(args.requests):
        t0 = time.perf_counter_ns()
        p2c.choose(pool, frozenset())
        plain.append(time.perf_counter_ns() - t0)
    print(f"power-of-two decision alone:   {percentiles(plain)}")
    # New turns (not yet recorded), so recording costs what it does when serving.
    fresh = [rng.choice(prompts) + [rng.randrange(50000) for _ in range(128)] for _ in range(min(args.requests, 5000))]
    breakdown(d, policy, fresh, [policy.routing_key(t) for t in fresh])
    median_us = statistics.median(decide) / 1000
    print(f"target: decision median <= 20 us: {'met' if median_us <= 20 else 'NOT met'} ({median_us:.1f} us)")
    return 0


class _Timed:
    """The policy with its route and commit timed (the dispatcher calls them as it always does)."""

    def __init__(self, policy):
        self.policy, self.route_ns, self.commit_ns = policy, 0, 0
        self.uses_prefix, self.routing_key = policy.uses_prefix, policy.routing_key

    def route(self, *args):
        t0 = time.perf_counter_ns()
        decision = self.policy.route(*args)
        self.route_ns = time.perf_counter_ns() - t0
        return decision

    def commit(self, *args):
        t0 = time.perf_counter_ns()
        self.policy.commit(*args)
        self.commit_ns = time.perf_counter_ns() - t0


def breakdown(d: Dispatcher, policy: PrefixAffinity, turns: list[list[int]], keys) -> None:
    """Per-request steps of the router thread, each timed around the real code."""
    from exaserve_hpc.router import zmq_router as zr
    ctx = zmq.Context()
    router = zr.ZmqRouter(d, context=ctx)  # not started: its methods run here, on this thread
    gateway = ctx.socket(zmq.DEALER)
    gateway.connect(router.frontend_endpoint)
    timed = _Timed(policy)
    d.policy = timed
    steps = {name: [] for name in ("receive", "decode", "decide", "record", "bookkeeping", "send",
                                   "finish: receive", "finish: decode", "finish: dispatcher", "finish: send")}
    scheme = policy.hasher.scheme
    n = min(len(turns), 5000)
    frames = [encode(GenerateRequest(request_id=f"b{i}", model="m", prompt_token_ids=t, max_tokens=16,
                                     prefix_hashes=k.block_hashes, prefix_scheme=scheme))
              for i, (t, k) in enumerate(zip(turns[:n], keys[:n]))]
    chunk = encode(TokenChunk(request_id="", token_ids=[1], finished=True))
    sockets = {}  # replica id -> DEALER, connected on first use (3,072 would be many inproc pipes)
    clock = time.perf_counter_ns
    for i, frame in enumerate(frames):
        gateway.send(frame)
        router.frontend.poll(1000)
        t0 = clock()
        peer = zr._recv_frame(router.frontend, zr._NOBLOCK)
        payload = zr._recv_frame(router.frontend, zr._NOBLOCK, False).buffer
        t1 = clock()
        message = zr._frontend_decoder.decode(payload)
        t2 = clock()
        out = d.on_request(peer, message, 1.0, payload)
        t3 = clock()
        [o] = out
        rid = o.peer.decode()
        sock = sockets.get(rid)
        if sock is None:
            sock = sockets[rid] = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, o.peer)
            sock.connect(router.backend_endpoint)
            sock.send(encode(ReplicaHello(replica_id=rid, model="m", pid=0, max_batch_size=64, max_seq_len=8192)))
            router.backend.poll(1000)
            zr._recv_frame(router.backend, 0), zr._recv_frame(router.backend, 0)  # its hello: already registered
        t4 = clock()
        router._send(out)
        t5 = clock()
        sock.recv()
        sock.send(chunk.replace(b"\xa0", bytes([0xA0 | len(f"b{i}")]) + f"b{i}".encode(), 1))
        router.backend.poll(1000)
        t6 = clock()
        peer = zr._recv_frame(router.backend, zr._NOBLOCK)
        reply = zr._recv_frame(router.backend, zr._NOBLOCK, False).buffer
        t7 = clock()
        message = zr._backend_decode(reply)
        t8 = clock()
        back = d.on_replica_message(rid, message, 1.0)
        t9 = clock()
        router._send(back)
        t10 = clock()
        gateway.recv()
        for name, ns in zip(steps, (t1 - t0, t2 - t1, timed.route_ns, timed.commit_ns,
                                    t3 - t2 - timed.route_ns - timed.commit_ns, t5 - t4,
                                    t7 - t6, t8 - t7, t9 - t8, t10 - t9)):
            steps[name].append(ns)
    d.policy = policy
    total = sum(statistics.median(v) for v in steps.values())
    print(f"router thread per request ({n} requests, real sockets, medians; sum {total / 1000:.1f} us):")
    for name, values in steps.items():
        print(f"  {name:20s} {percentiles(values)}")
    for sock in sockets.values():
        sock.close(linger=0)
    gateway.close(linger=0)
    router.stop()
    ctx.term()


if __name__ == "__main__":
    sys.exit(main())
