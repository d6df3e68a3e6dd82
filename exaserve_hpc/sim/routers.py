"""The routers of a simulation: `router.count` real Dispatchers sharing the fleet, each behind one thread.

As the running system shares the fleet between routers (router/router_group.py, agent/router_links.py):
- every replica's hello, stats and bye reach every router (`broadcast`); the controller's loss and drain
  news reach every router, and it reads their snapshots added up (`router_group.merge_snapshots`, the
  group's own code);
- a request goes to one router, the one behind the gateway the client used (`pick`), and the replica's
  answers go back to that router only (`answer`; RouterLinks keeps the same origin per request id);
- the prefix index: with `prefix_mode: approximate` each router records its own choices only (a router's
  Dispatcher commits what it routed), so a prefix routed by router 0 is unknown to router 1; with
  `precise` every router is fed every replica's KV events (`kv_events`).
Gateways: a client or the centre's load balancer chooses a gateway, the gateway hands the request to its
own router. `round_robin` stands for a balancer spreading requests evenly (the worst case for
approximate affinity: a conversation's turns land on different routers); `sticky` keeps all requests of
one prefix (a system prompt's group, a conversation's first block) on one router, as a client that keeps
its connection to one gateway does.

The router thread's CPU: each router is one thread that takes its work one piece after another
(`RouterThread`, a FIFO server), and three kinds of work cost it CPU, each as measured by
benchmarks/bench_router_throughput.py:
- a request (`cost`, --router-cost-us): receive, decode, decide, record, send, and the handling of one
  answer chunk (the benchmark's replicas answer with one finished chunk); it waits in its router's queue
  while the thread is busy and is routed `cost` seconds after it started, when the real thread would send it;
- each further token chunk of its answer (`chunk_cost`, --router-chunk-cost-us; the benchmark's
  --compare-chunks slope): the simulated replicas report a stream in a few messages (the first token,
  progress every few seconds, the finish), far fewer than a real replica's coalescer (agent/replica_main.py
  ChunkCoalescer) sends, so a stream is charged the chunks that one would send for its output under
  router.coalesce_ms / coalesce_tokens at the replica's step time (`chunks_for`). They are charged when its
  first token reaches the router, queued behind it: the same CPU as over the decode (seconds), and spread
  as the requests are, where charging each simulated report would lump the chunks of every stream at the
  replicas' (synchronised) progress reports. Every answer that finds its thread busy waits behind the work
  queued before it (TTFT includes that wait); one that finds it idle is passed on at once;
- each ReplicaStats message (`stats_cost`, --router-stats-cost-us; the benchmark's --compare-stats): every
  replica's stats reach every router each router.replica_heartbeat; their CPU is charged to each thread in
  STATS_SLICES slices over the heartbeat (real replicas' reports are spread over it, the simulated ones
  come together).
KV events (precise mode) and the dispatchers' ticks cost nothing here. With every cost 0 a request is
routed and answered the moment it arrives (the simulator before routers had a cost).
"""

from __future__ import annotations

import math
from typing import Callable

from exaserve_hpc.app.routing import dispatch_settings, router_policy
from exaserve_hpc.engine.kv_events import BlockRemoved, BlockStored
from exaserve_hpc.protocol import GenerateRequest
from exaserve_hpc.router.dispatch import Dispatcher
from exaserve_hpc.router.router_group import merge_snapshots

# Router CPU per request: benchmarks/bench_router_throughput.py, prefix affinity with the compiled index and
# decision, 3,072 replica sockets, varied prompts (sent packed, as gateways do), warm index, recording
# included: 46.8 us against 25.7 us for zmq.proxy (median of 7 rounds; docs/benchmarks.md, 2026-12-01 on the
# 2-core machine; 72 us before prompts were packed), each answered by one chunk. Alone it would let one
# thread route ~21,400 requests/s; with a stream's chunks (~40 more a request on exa256-mix, below, sent
# batched) a request costs ~147 us and a thread routes ~6,800 a second, less what the stats take.
ROUTER_COST_S = 47e-6
# Router CPU per token chunk beyond a request's first, sent batched as replicas and gateways send them
# (protocol.TokenChunks: a replica's pass of its loop in one frame, the router's burst to a gateway in one):
# the slope between answers of 1 and 9 chunks, the 8 before the last in one frame, 5 alternating rounds:
# 2.5 us (rounds 1.1-2.7; 45.0 us a request at 1 chunk, 65.0 at 9). One chunk a frame, in the same rounds:
# 5.6 us (5.0-6.5); batched / one a frame per round 0.41 (0.23-0.49). benchmarks/bench_router_throughput.py
# --compare-chunks 1 9 --batched, 3,072 replicas, 2026-12-01, 2-core machine otherwise idle (the day before,
# the other core busy, one chunk a frame measured 7.6 us). A replica's frame holds a chunk for each request it
# streams at once: fewer than 8, each costs more; more, less. Token chunks are what a streamed answer is
# mostly made of.
CHUNK_COST_S = 2.5e-6
# Router CPU per ReplicaStats message while the router routes (what a router near saturation pays): one
# router serving requests without, then with every replica sending stats 8 times a second (24,600 a second),
# 5 alternating rounds: 12.4 us beyond the requests' CPU (rounds 8.9-13.5), same day and machine
# (benchmarks/bench_router_throughput.py --compare-stats 8). An otherwise idle router pays more, 31.5 us
# at 1 a second a replica (--stats-rate 1: 5 rounds 30.4-38.0), for waking for a few at a time, with CPU to
# spare; the decode + Dispatcher.on_replica_message alone take ~1.9 us in-process, the rest is the sockets.
STATS_COST_S = 12.4e-6
STATS_SLICES = 10  # a heartbeat's stats CPU in this many slices, spread over it
PICKS = ("round_robin", "sticky")
_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing: block ids are spaced by powers of two, `% n` alone would not spread


def kv_events_of(log: list, sub: int, block_size: int) -> list:
    """A simulated replica's log of workload blocks stored and evicted (`SimReplica.kv_log`) as the engine KV
    events a router follows: each block `sub` router blocks of `block_size` tokens, named as gateways hash
    them (Simulation._arrive)."""
    return [BlockStored(block_hashes=[b * sub + j for b in blocks for j in range(sub)], parent_block_hash=None,
                        token_ids=[], block_size=block_size) if kind == "stored"
            else BlockRemoved(block_hashes=[b * sub + j for b in blocks for j in range(sub)])
            for kind, blocks in log]


def simulated_request(request_id: str, k: int, model: str, prompt: int, max_tokens: int, blocks: tuple,
                      block_tokens: int, hasher) -> GenerateRequest:
    """The request a gateway hands its router for a workload request (the k-th): with the prompt's block
    hashes in the router's scheme when its policy hashes prompts (``hasher``, else None). Workload block b
    of `block_tokens` is router blocks b x sub .. b x sub + sub - 1; past the workload's blocks the prompt's
    own tail, hashes no other request has."""
    hashes, scheme = [], ""
    if hasher is not None:
        count = hasher.blocks(prompt)
        sub = max(1, block_tokens // hasher.block_size)
        hashes = [h * sub + j for h in blocks for j in range(sub)][:count]
        hashes += [-(k << 12) - j for j in range(count - len(hashes))]
        scheme = hasher.scheme
    return GenerateRequest(request_id=request_id, model=model, prompt_token_ids=[0] * prompt,
                           max_tokens=max_tokens, prefix_hashes=hashes, prefix_scheme=scheme)


def chunks_for(tokens: int, step_ms: float, coalesce_ms: float, coalesce_tokens: int) -> int:
    """Token chunks a replica's coalescer sends for `tokens` decoded one a step of `step_ms` after its first
    chunk: a chunk goes at coalesce_tokens tokens, or at the first token coalesce_ms after the chunk's first
    (ChunkCoalescer.add / due, both on the step's start time), so it holds 1 + ceil(coalesce_ms / step_ms)."""
    if tokens <= 0:
        return 0
    per = coalesce_tokens if step_ms <= 0 else min(coalesce_tokens, 1 + math.ceil(coalesce_ms / step_ms))
    return -(-tokens // max(1, per))


class RouterThread:
    """One router: its Dispatcher and the single thread that serves its requests one after another."""

    def __init__(self, index: int, dispatcher: Dispatcher, cost: float, chunk_cost: float = 0.0,
                 stats_cost: float = 0.0):
        self.index, self.dispatcher, self.cost = index, dispatcher, cost
        self.chunk_cost, self.stats_cost = chunk_cost, stats_cost
        self.gateway = f"sim-gateway-{index}".encode()
        self.free_at = 0.0  # when the thread has served every request it holds
        self.busy_s = 0.0  # CPU-seconds of all work taken (requests, chunks, stats)
        self.chunks = self.stats = 0  # chunks charged (beyond each request's first), stats messages
        self.chunk_s = self.stats_s = 0.0  # their CPU-seconds (in busy_s too)
        self.marks: dict = {}  # "start" / "end" of the arrivals' window: (busy_s, busy_until, stats_s) then
        self.held = self.held_peak = 0  # requests taken, not yet routed (in service or waiting)
        self.routed = 0
        self.wait_s = self.wait_max = 0.0  # time requests spent queued behind others
        self.busy_sampled = 0.0
        self.util_peak = 0.0  # busiest sample interval
        self.routed_sampled = 0
        self.rate_peak = 0.0  # most requests routed per second over a sample interval

    def take(self, now: float) -> float:
        """A request arrives: when the thread will have routed it (FIFO, one at a time)."""
        start = self.free_at if self.free_at > now else now
        wait = start - now
        self.wait_s += wait
        if wait > self.wait_max:
            self.wait_max = wait
        self.free_at = start + self.cost
        self.busy_s += self.cost
        self.held += 1
        if self.held > self.held_peak:
            self.held_peak = self.held
        return self.free_at

    def answer(self, now: float, chunks: int = 0) -> float:
        """A replica's answer arrives: when the thread has handled it (FIFO behind what it holds; one that
        finds the thread idle is handed on at `now`, its few us not worth an event; with free routers every
        answer is). `chunks`: with a stream's first answer, the chunks a replica will send after it, whose CPU
        is queued behind it now (see the module's docstring)."""
        self.chunks += chunks
        if self.cost <= 0 and self.chunk_cost <= 0:
            return now
        work = chunks * self.chunk_cost
        self.chunk_s += work
        self.busy_s += work
        handled = self.free_at if self.free_at > now else now
        self.free_at = handled + work
        return handled

    def stats_burst(self, now: float, messages: int) -> None:
        """`messages` ReplicaStats reach the thread at `now`: their CPU, queued before later work."""
        self.stats += messages
        if self.stats_cost <= 0:
            return
        work = messages * self.stats_cost
        self.stats_s += work
        self.busy_s += work
        self.free_at = (self.free_at if self.free_at > now else now) + work

    def busy_until(self, t: float) -> float:
        """CPU-seconds spent up to t: a FIFO thread is busy without a break from t to free_at."""
        return self.busy_s - (self.free_at - t if self.free_at > t else 0.0)

    def sample(self, now: float, interval: float) -> None:
        busy = self.busy_until(now)
        self.util_peak = max(self.util_peak, (busy - self.busy_sampled) / interval)
        self.rate_peak = max(self.rate_peak, (self.routed - self.routed_sampled) / interval)
        self.busy_sampled, self.routed_sampled = busy, self.routed


class SimRouters:
    """What the controller holds as its router (a RouterGroup's five things), over `count` RouterThreads;
    whatever a dispatcher answers the controller's news with is queued in `out` for the simulation."""

    backend_endpoint = "sim://router-backend"  # RouterPort (router/port.py), as the controller sees it
    frontend_endpoint = "sim://router-frontend"
    backend_endpoints = [backend_endpoint]  # one backend as far as replicas are told (the simulator delivers)

    def routing(self) -> bool:
        return True

    def __init__(self, site, models: set, clock: Callable[[], float], count: int = 0, cost: float = ROUTER_COST_S,
                 pick: str = "round_robin", seed: int = 0, chunk_cost: float = CHUNK_COST_S,
                 stats_cost: float = STATS_COST_S):
        """count: routers (0: the site's router.count); cost: router CPU-seconds per request; chunk_cost: per
        token chunk beyond a request's first; stats_cost: per ReplicaStats message."""
        count = count or site.router.count
        if count < 1:
            raise ValueError(f"routers must be >= 1 (router.count), got {count}")
        for name, value in (("request", cost), ("chunk", chunk_cost), ("stats message", stats_cost)):
            if not value >= 0:
                raise ValueError(f"router cost per {name} must be >= 0 seconds, got {value}")
        self.coalesce = (site.router.coalesce_ms, site.router.coalesce_tokens)
        if pick not in PICKS:
            raise ValueError(f"router pick {pick!r} is unknown; choose one of {', '.join(PICKS)}")
        self.threads = []
        for k in range(count):
            policy = router_policy(site)
            for sampler in (policy, getattr(policy, "balance", None)):  # random draws: from the seed
                if hasattr(sampler, "rng"):
                    sampler.rng.seed(seed + 7919 * k)  # router 0: the seed itself, as with one router
            self.threads.append(RouterThread(k, Dispatcher(policy, dispatch_settings(site), models), cost,
                                             chunk_cost, stats_cost))
        self.pick_rule, self.clock, self.out = pick, clock, []
        self._next = 0
        self._snapshot: tuple[float, dict] = (-1.0, {})

    # ---------------------------------------------------------------- gateways

    def pick(self, blocks: tuple) -> RouterThread:
        """The router behind the gateway this request came through."""
        n = len(self.threads)
        if n == 1:
            return self.threads[0]
        if self.pick_rule == "sticky" and blocks:
            return self.threads[(((blocks[0] * _MIX) & 0xFFFFFFFFFFFFFFFF) >> 32) % n]
        self._next = (self._next + 1) % n
        return self.threads[self._next]

    # ---------------------------------------------------------------- replicas

    def broadcast(self, replica_id: str, message, now: float) -> list:
        """A hello, stats or bye: every router hears it (RouterLinks.broadcast)."""
        out = []
        for t in self.threads:
            out += t.dispatcher.on_replica_message(replica_id, message, now)
        return out

    def stats_reached(self, now: float, messages: int) -> None:
        """`messages` replicas' stats reached every router (`broadcast`): each thread's CPU for them."""
        for t in self.threads:
            t.stats_burst(now, messages)

    def chunks(self, tokens: int, step_ms: float) -> int:
        """Chunks a real replica sends for `tokens` streamed at `step_ms` a step, under the site's coalescing."""
        return chunks_for(tokens, step_ms, *self.coalesce)

    @property
    def follows_kv_events(self) -> bool:
        return self.threads[0].dispatcher.follows_kv_events

    def kv_events(self, replica_id: str, log: list, sub: int, block_size: int) -> None:
        """Precise mode: a replica's KV events (its log of workload blocks stored and evicted, each block
        `sub` router blocks of `block_size` tokens, named as the gateway hashes them) reach every router,
        as every router subscribes to every replica's publisher."""
        events = kv_events_of(log, sub, block_size)
        log.clear()
        for t in self.threads:
            t.dispatcher.on_kv_events(replica_id, events)

    def tick(self, now: float) -> list:
        out = []
        for t in self.threads:
            out += t.dispatcher.tick(now)
        return out

    # ---------------------------------------------------------------- the controller's router

    def snapshot(self) -> dict:
        now = self.clock()
        if self._snapshot[0] != now:  # the controller reads it more than once per tick
            snaps = [t.dispatcher.snapshot() for t in self.threads]
            self._snapshot = (now, snaps[0] if len(snaps) == 1 else merge_snapshots(snaps))
        return self._snapshot[1]

    def replica_lost(self, replica_id: str, why: str) -> None:
        for t in self.threads:
            self.out += t.dispatcher.replica_lost(replica_id, why, self.clock())

    def drain(self, replica_id: str) -> None:
        for t in self.threads:
            self.out += t.dispatcher.drain(replica_id)

    # ---------------------------------------------------------------- figures

    def pending(self) -> int:
        return sum(len(t.dispatcher.pending) + t.held for t in self.threads)

    def inflight(self) -> int:
        return sum(len(t.dispatcher.inflight) for t in self.threads)

    def counters(self) -> dict:
        total: dict = {}
        for t in self.threads:
            for k, v in t.dispatcher.counters.items():
                total[k] = total.get(k, 0) + v
        return total

    def sample(self, now: float, interval: float) -> None:
        for t in self.threads:
            t.sample(now, interval)

    def mark(self, now: float, name: str) -> None:
        """The arrivals' window opens ("start") or closes ("end"): what each thread had taken and spent."""
        for t in self.threads:
            t.marks[name] = (t.busy_s, t.busy_until(now), t.stats_s)
            if name == "start":  # sample intervals count from here: the stats before are no interval's
                t.busy_sampled, t.routed_sampled = t.busy_until(now), t.routed

    def summary(self, start: float, end: float) -> dict:
        """Per router over the arrivals' window [start, end): load (CPU-seconds of work taken per second:
        requests, their chunks, stats; above 1 the thread cannot keep up and its queue grows), utilisation
        (the share of the window the thread was busy), the busiest sample interval's, queue peak (requests
        held: waiting or in service), requests routed and their share, mean and longest wait in the
        router's queue, chunks and stats handled (whole run) and their CPU. Together: the mean CPU a request
        costs with its chunks, the share of a thread the stats take, and what the routers can sustain."""
        total = sum(t.routed for t in self.threads) or 1
        first, span = self.threads[0], max(1e-9, end - start)
        cost = first.cost
        none = (0.0, 0.0, 0.0)

        def window(t: RouterThread, k: int) -> float:  # marks absent (a run cut short): from 0 / up to now
            return t.marks.get("end", (t.busy_s, t.busy_until(end), t.stats_s))[k] - t.marks.get("start", none)[k]

        # Chunks come until a request ends (after the window, for the last ones): counted per request taken
        # (accepted: with free routers a request is dispatched without being `routed` by a thread).
        accepted = sum(t.dispatcher.counters.get("accepted", 0) for t in self.threads) or total
        chunks_per_request = sum(t.chunks for t in self.threads) / accepted
        per_request = cost + chunks_per_request * first.chunk_cost
        stats_share = max(window(t, 2) for t in self.threads) / span  # of each thread's time
        per = [{"router": t.index, "routed": t.routed, "share": round(t.routed / total, 4),
                "load": round(window(t, 0) / span, 4), "utilisation": round(window(t, 1) / span, 4),
                "chunks": t.chunks, "chunk_cpu_s": round(t.chunk_s, 3), "stats": t.stats,
                "stats_cpu_s": round(t.stats_s, 3),
                "utilisation_peak": round(t.util_peak, 4),
                "queue_peak": t.held_peak, "wait_mean_s": t.wait_s / max(1, t.routed), "wait_max_s": t.wait_max,
                "routed_per_s_peak": round(t.rate_peak, 1),
                # prefix index generations dropped (router.index_blocks // 2 hashes each): how often it forgot
                "index_generations_evicted": getattr(getattr(t.dispatcher.policy, "index", None),
                                                     "evicted_generations", 0)} for t in self.threads]
        return {"count": len(self.threads), "cost_per_request_s": cost, "chunk_cost_s": first.chunk_cost,
                "stats_cost_s": first.stats_cost, "pick": self.pick_rule,
                "chunks_per_request": round(chunks_per_request, 2), "cpu_per_request_s": per_request,
                "stats_share": round(stats_share, 4),
                "capacity_per_s": round(len(self.threads) * max(0.0, 1 - stats_share) / per_request, 1)
                if per_request > 0 else None, "per_router": per}
