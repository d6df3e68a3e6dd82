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

The router thread's CPU: each router is one thread that takes a request after the one before it
(`RouterThread.take`): a request waits in its router's queue while the thread is busy, then is routed
`cost` seconds after it started, the moment the real thread would have sent it. The cost is the whole
per-request figure of the throughput benchmark (receive, decode, decide, record, send, and the reply's
handling), charged once at the request; replica stats and token chunks cost nothing more here. With
cost 0 a request is routed the moment it arrives (the simulator before routers had a cost).
"""

from __future__ import annotations

from typing import Callable

from ..control_plane_routing import dispatch_settings, router_policy
from ..engine.kv_events import BlockRemoved, BlockStored
from ..router.dispatch import Dispatcher
from ..router.router_group import merge_snapshots

# Router CPU per request: benchmarks/bench_router_throughput.py, prefix affinity with the compiled index and
# decision, 3,072 replica sockets, varied prompts (sent packed, as gateways do), warm index, recording
# included: 46.8 us against 25.7 us for zmq.proxy (median of 7 rounds; README, Benchmarks, 2026-12-01 on the
# 2-core machine; 72 us before prompts were packed). One thread therefore routes at most ~21,400
# requests/s: exa256-mix's peak (~21,800 req/s) offers it 1.02 CPU-seconds a second.
ROUTER_COST_S = 47e-6
PICKS = ("round_robin", "sticky")
_MIX = 0x9E3779B97F4A7C15  # Fibonacci hashing: block ids are spaced by powers of two, `% n` alone would not spread


class RouterThread:
    """One router: its Dispatcher and the single thread that serves its requests one after another."""

    def __init__(self, index: int, dispatcher: Dispatcher, cost: float):
        self.index, self.dispatcher, self.cost = index, dispatcher, cost
        self.gateway = f"sim-gateway-{index}".encode()
        self.free_at = 0.0  # when the thread has served every request it holds
        self.busy_s = 0.0  # CPU-seconds of every request taken
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

    backend_endpoint = "sim://router-backend"
    frontend_endpoint = "sim://router-frontend"

    def __init__(self, site, models: set, clock: Callable[[], float], count: int = 0, cost: float = ROUTER_COST_S,
                 pick: str = "round_robin", seed: int = 0):
        """count: routers (0: the site's router.count); cost: router CPU-seconds per request."""
        count = count or site.router.count
        if count < 1:
            raise ValueError(f"routers must be >= 1 (router.count), got {count}")
        if cost < 0:
            raise ValueError(f"router cost per request must be >= 0 seconds, got {cost}")
        if pick not in PICKS:
            raise ValueError(f"router pick {pick!r} is unknown; choose one of {', '.join(PICKS)}")
        self.threads = []
        for k in range(count):
            policy = router_policy(site)
            for sampler in (policy, getattr(policy, "balance", None)):  # random draws: from the seed
                if hasattr(sampler, "rng"):
                    sampler.rng.seed(seed + 7919 * k)  # router 0: the seed itself, as with one router
            self.threads.append(RouterThread(k, Dispatcher(policy, dispatch_settings(site), models), cost))
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

    @property
    def follows_kv_events(self) -> bool:
        return self.threads[0].dispatcher.follows_kv_events

    def kv_events(self, replica_id: str, log: list, sub: int, block_size: int) -> None:
        """Precise mode: a replica's KV events (its log of workload blocks stored and evicted, each block
        `sub` router blocks of `block_size` tokens, named as the gateway hashes them) reach every router,
        as every router subscribes to every replica's publisher."""
        events = [BlockStored(block_hashes=[b * sub + j for b in blocks for j in range(sub)], parent_block_hash=None,
                              token_ids=[], block_size=block_size) if kind == "stored"
                  else BlockRemoved(block_hashes=[b * sub + j for b in blocks for j in range(sub)])
                  for kind, blocks in log]
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

    def summary(self, start: float, end: float) -> dict:
        """Per router over the arrivals' window [start, end): load (CPU-seconds the requests asked for per
        second; above 1 the thread cannot keep up and its queue grows), utilisation (the share of the window
        the thread was busy), the busiest sample interval's, queue peak (requests held: waiting or in
        service), requests routed and their share, mean and longest wait in the router's queue."""
        total = sum(t.routed for t in self.threads) or 1
        cost, span = self.threads[0].cost, max(1e-9, end - start)
        per = [{"router": t.index, "routed": t.routed, "share": round(t.routed / total, 4),
                "load": round(t.busy_s / span, 4), "utilisation": round(t.busy_until(end) / span, 4),
                "utilisation_peak": round(t.util_peak, 4),
                "queue_peak": t.held_peak, "wait_mean_s": t.wait_s / max(1, t.routed), "wait_max_s": t.wait_max,
                "routed_per_s_peak": round(t.rate_peak, 1),
                # prefix index generations dropped (router.index_blocks // 2 hashes each): how often it forgot
                "index_generations_evicted": getattr(getattr(t.dispatcher.policy, "index", None),
                                                     "evicted_generations", 0)} for t in self.threads]
        return {"count": len(self.threads), "cost_per_request_s": cost, "pick": self.pick_rule,
                "capacity_per_s": round(len(self.threads) / cost, 1) if cost > 0 else None, "per_router": per}
