"""Routed requests/s of one router process vs a plain zmq.proxy forwarding the same messages.

    python benchmarks/bench_router_throughput.py [--replicas 3072] [--rounds 5] [--seconds 4]
        [--policy prefix_affinity] [--window 256] [--routers 1] [--pure-python] [--chunks 1]
    python benchmarks/bench_router_throughput.py --compare-chunks 1 8 [--rounds 5] [--batched]
    python benchmarks/bench_router_throughput.py --compare-stats 8 [--rounds 5]
    python benchmarks/bench_router_throughput.py --stats-rate 1 8 [--rounds 5] [--seconds 6]

The workload is the served one at the seed's scale:
- 3,072 replica sockets (``--replicas``) in two echo processes; each answers a
  GenerateRequest with one finished TokenChunk (no engine: the figure is the
  forwarding path);
- varied prompts: next turns of conversations (one of 64 shared 512-token
  system prompts + a 512-token conversation start + 128 new tokens), each
  carrying the block hashes the gateway computes (as gateway/app.py does),
  packed as the gateway's router client sends them (protocol.pack_request);
- a warm index: before the clock starts, the router routes and records one
  turn of each of ``--conversations`` conversations (20,000), so most
  requests find a deep cached match among 3,072 replicas;
- recording included: the router records every choice in its index, as it
  does when serving;
- the prefix index and `route` compiled (router/_prefix_index.pyx,
  _affinity_route.pyx) where they were built, as when serving; ``--pure-python``
  measures the pure-Python reference instead (a machine without a C compiler).

Same run, same peers, two phases alternating ``--rounds`` times (at least 5):
1. proxy: `zmq.proxy(ROUTER, DEALER)` in its own process, the same 3,072
   echo sockets behind it (round-robin, identity envelope kept);
2. router: `ZmqRouter` + `Dispatcher` in its own process (decode, policy,
   index record, bookkeeping, re-encode both ways).

A client process keeps ``--window`` requests in flight (pre-encoded, so its
cost is small) and counts answers for ``--seconds`` after one second of
warm-up; it reads the hub process's CPU time (/proc) at the start and end of
that window, so CPU per request excludes start-up and index warming. The
median of the per-round ratios is reported with its spread. On a 2-core
machine the client and echo processes share the cores with the hub: read the
ratio and the CPU per request, not the absolute rate.

``--routers N`` (N > 1) runs N router processes instead of one, each with the
whole fleet registered, the client spreading requests over them (as gateways
do); the figure is their aggregate requests/s and their summed CPU per request.
On two cores N routers cannot add throughput (their echo processes and the
client share the same cores), so compare N at one offered load instead:
``--rate R`` sends R requests/s in all (open loop, the same for every N) and
charges the routers' CPU beyond their idle ticks to the requests; CPU per
request unchanged with N is what lets N routers on N cores scale out.

A streamed answer is many messages, and every replica's stats reach every
router; the default workload has neither. ``--chunks K`` makes each echo
replica answer with K token chunks (K - 1, then the finished one), as a
replica's coalescer sends a stream (router.coalesce_ms / coalesce_tokens);
``--compare-chunks K1 K2`` runs one router at K1 and K2 chunks an answer in
each round and reports the slope, the router's CPU per added chunk (the
simulator's --router-chunk-cost-us). The K chunks of an answer reach the
router back to back here, where a real stream's are spread over its decode;
at load the router's drain loop batches chunks of many streams instead.
With ``--batched`` each round also runs K1 and K2 the way replicas and the gateway send chunks when
serving: an echo replica sends an answer's K - 1 partial chunks as one TokenChunks frame (a replica
sends one frame per pass of its loop with a chunk for each running request: K - 1 stands for that
batch), and the client's requests say batch_replies, so the router sends it TokenChunks too; both
slopes and their ratio are reported, measured side by side.
``--compare-stats HZ`` runs one router serving requests without, then with
every replica sending ReplicaStats HZ times a second in each round, and
reports the router's CPU per stats message while it routes (the simulator's
--router-stats-cost-us). ``--stats-rate HZ [HZ ...]`` sends no requests:
every replica socket sends ReplicaStats HZ times a second
(router.replica_heartbeat is 1 s), and the router's CPU beyond its idle CPU
(measured for 2 s before) per message is reported: an idle router pays more
a message, for waking up for a few at a time.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from array import array

import msgspec
import zmq

from exaserve_hpc.protocol import (
    GenerateRequest, ReplicaHello, ReplicaStats, TokenChunk, TokenChunks, encode, pack_request,
)
from exaserve_hpc.router.affinity import AffinitySettings

BLOCK = 16
ECHO_PROCESSES = 2


class _Gen(msgspec.Struct, tag_field="t", tag="gen"):
    """The one field an echo replica needs: the others are skipped unread."""

    request_id: str


_echo_decoder = msgspec.msgpack.Decoder(_Gen)
_chunks_decoder = msgspec.msgpack.Decoder(TokenChunks)
_CHUNKS_TAG = encode(TokenChunks(chunks=[]))[1:8]  # a map's first key and value: "t": "chunks"


def _tokens(rng: random.Random, n: int) -> list[int]:
    return array("H", rng.randbytes(2 * n)).tolist()


def conversations(seed: int, count: int) -> list[list[int]]:
    """First turns: one of 64 shared 512-token system prompts + 512 tokens of its own."""
    rng = random.Random(seed)
    systems = [_tokens(rng, 512) for _ in range(64)]
    return [rng.choice(systems) + _tokens(rng, 512) for _ in range(count)]


def next_turns(seed: int, count: int, firsts: list[list[int]]) -> list[list[int]]:
    rng = random.Random(seed + 1)
    return [rng.choice(firsts) + _tokens(rng, 128) for _ in range(count)]


def echo_replicas(endpoint: str, ids: list[str], envelope: bool, ready, chunks: int = 1, stats=None,
                  batched: bool = False) -> None:
    """Many replica sockets in one process. envelope: behind zmq.proxy (its identity frame kept).
    chunks: token chunks per answer, the last one finished; batched: the ones before the last in one
    TokenChunks frame. stats: (rate per replica per second, a start
    Event, a shared count of stats sent, alone): once the event is set every socket sends ReplicaStats at that
    rate, beside answering requests (alone: no requests come)."""
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, len(ids) + 64)
    poller = zmq.Poller()
    socks = []
    for rid in ids:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if not envelope:
            sock.setsockopt(zmq.IDENTITY, rid.encode())
        sock.connect(endpoint)
        if not envelope:
            sock.send(encode(ReplicaHello(replica_id=rid, model="echo", pid=0, max_batch_size=4096,
                                          max_seq_len=8192)))
        poller.register(sock, zmq.POLLIN)
        socks.append(sock)
    ready.put(len(socks))
    finished = encode(TokenChunk(request_id="", token_ids=[1, 2, 3, 4], finished=True, finish_reason="length"))
    # the chunks before the last, each as a replica's coalescer flushes them (a few tokens, not finished)
    partial = encode(TokenChunk(request_id="", token_ids=[1, 2, 3, 4]))
    partials = 1 if batched else chunks - 1  # frames before the finished one
    if batched and chunks > 2:  # an empty string (0xa0) only where each chunk's request id goes
        partial = encode(TokenChunks(chunks=[TokenChunk(request_id="", token_ids=[1, 2, 3, 4])] * (chunks - 1)))
    elif chunks == 1:
        partials = 0
    pacer = None if stats is None else StatsPacer(socks, ids, *stats[:3])
    if stats is not None and stats[3]:
        stats[1].wait()
        pacer.start()
        while True:  # no requests come
            pacer.send_due()
            time.sleep(0.002)
    while True:
        if pacer is not None and pacer.started is None and stats[1].is_set():
            pacer.start()
        for sock, _ in poller.poll(None if pacer is None else 2):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                header, envelope_frames = _str_header(_echo_decoder.decode(frames[-1]).request_id), frames[:-1]
                for _ in range(partials):
                    sock.send_multipart(envelope_frames + [partial.replace(b"\xa0", header)])
                sock.send_multipart(envelope_frames + [finished.replace(b"\xa0", header, 1)])
        if pacer is not None and pacer.started is not None:
            pacer.send_due()


class StatsPacer:
    """Every socket sends ReplicaStats `rate` times a second (round-robin, paced), as StatusReporters do;
    `sent_count` (shared with the parent) counts them."""

    def __init__(self, socks: list, ids: list[str], rate: float, go, sent_count):
        self.socks, self.rate, self.sent_count = socks, rate, sent_count
        self.bodies = [encode(ReplicaStats(
            replica_id=rid, queue_depth=3, running=17, kv_used=0.42, latency_ewma_ms=23.5, tokens_generated=123456,
            requests_finished=4321, prefix_hit_tokens=654321, prefix_query_tokens=987654, kv_blocks_cached=2048,
            ttft_ms_p50=85.0, ttft_ms_p99=410.0, tpot_ms_p50=22.0, tpot_ms_p99=41.0)) for rid in ids]
        self.sent, self.started = 0, None

    def start(self) -> None:
        self.started = time.perf_counter()

    def send_due(self) -> None:
        n = len(self.socks)
        due = int(self.rate * n * (time.perf_counter() - self.started))
        while self.sent < due:
            self.socks[self.sent % n].send(self.bodies[self.sent % n])
            self.sent += 1
        self.sent_count.value = self.sent


def _str_header(s: str) -> bytes:
    """MessagePack str of s (request ids are short): spliced into the pre-encoded reply."""
    raw = s.encode()
    return (bytes([0xA0 | len(raw)]) if len(raw) < 32 else b"\xd9" + bytes([len(raw)])) + raw


def client(endpoints: list[str], hub_pids: list[int], args, result, stats_counts=()) -> None:
    hasher = AffinitySettings(block_size=BLOCK).hasher()  # as the gateway does
    turns = next_turns(args.seed, args.distinct, conversations(args.seed, args.conversations))
    hashed = [hasher(t) for t in turns]
    # Pre-encoded with distinct ids: an id comes back around only after `distinct` sends (>> window).
    bodies = [encode(pack_request(GenerateRequest(request_id=f"q{i}", model="echo", prompt_token_ids=t, max_tokens=4,
                                                  prefix_hashes=h, prefix_scheme=hasher.scheme,
                                                  batch_replies=args.batched_now)))
              for i, (t, h) in enumerate(zip(turns, hashed))]
    ctx = zmq.Context()
    socks = []
    for endpoint in endpoints:  # one DEALER per router: requests spread over them as gateways do
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        socks.append(sock)
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    sent = 0

    def send() -> None:
        nonlocal sent
        socks[sent % len(socks)].send(bodies[sent % len(bodies)])
        sent += 1

    def answers(timeout_ms: int, each=None) -> int:
        """Read every answer waiting (after up to timeout_ms for the first); `each` runs per answer."""
        count = 0
        for sock, _ in poller.poll(timeout_ms):
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                # a TokenChunks frame (--batched) counts as the chunks in it; a lone chunk is not decoded
                n = len(_chunks_decoder.decode(frame).chunks) if frame[1:8] == _CHUNKS_TAG else 1
                count += n
                if each is not None:
                    for _ in range(n):
                        each()
        return count

    # With --chunks K every request is answered by K messages: counted as one answer per K (the client
    # does not decode them, so its cost stays small); the closed loop sends one request per K received.
    chunks = args.chunks
    received = 0

    def each_message() -> None:
        nonlocal received
        received += 1
        if received % chunks == 0:
            send()

    def pump(until: float) -> int:
        """Closed loop: each answer sends the next request, so `window` stay in flight."""
        first = received
        while time.perf_counter() < until:
            answers(100, each_message)
        return (received - first) // chunks

    def paced(until: float) -> int:
        """Open loop: `args.rate` requests/s in all, at most `window` outstanding."""
        messages, start, base = 0, time.perf_counter(), sent
        while (now := time.perf_counter()) < until:
            due = base + int(args.rate * (now - start))
            while sent < due and sent - base - messages // chunks < args.window:
                send()
            messages += answers(1)
        return messages // chunks

    # The hubs' CPU while nothing is sent (ticks, status snapshots): subtracted in --rate runs, where
    # it would otherwise be charged to the requests N times over with N routers.
    cpu_idle = sum(cpu_seconds(p) for p in hub_pids)
    time.sleep(1.0)
    idle_per_s = sum(cpu_seconds(p) for p in hub_pids) - cpu_idle
    if args.rate:
        paced(time.perf_counter() + 1.0)  # warm-up, not counted
    else:
        for _ in range(args.window):
            send()
        pump(time.perf_counter() + 1.0)  # warm-up, not counted
    cpu0, stats0 = sum(cpu_seconds(p) for p in hub_pids), sum(c.value for c in stats_counts)
    started = time.perf_counter()
    counted = (paced if args.rate else pump)(started + args.seconds)
    elapsed = time.perf_counter() - started
    cpu = sum(cpu_seconds(p) for p in hub_pids) - cpu0
    if args.rate:
        cpu -= idle_per_s * elapsed
    stats = sum(c.value for c in stats_counts) - stats0
    result.put((counted / elapsed, 1e6 * cpu / counted if counted else 0.0, stats / elapsed))


def run_proxy(endpoints) -> None:
    ctx = zmq.Context()
    f, b = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    fp, bp = f.bind_to_random_port("tcp://127.0.0.1"), b.bind_to_random_port("tcp://127.0.0.1")
    endpoints.put((f"tcp://127.0.0.1:{fp}", f"tcp://127.0.0.1:{bp}"))
    zmq.proxy(f, b)


def run_router(endpoints, ready, args) -> None:
    import logging
    logging.disable(logging.WARNING)  # the client leaving mid-stream at the end is expected
    from exaserve_hpc.router.dispatch import Dispatcher, DispatchSettings
    from exaserve_hpc.router.policies import make_policy
    from exaserve_hpc.router.zmq_router import ZmqRouter
    options = {"settings": AffinitySettings(block_size=BLOCK), "compiled": not args.pure_python} \
        if args.policy == "prefix_affinity" else {}
    policy = make_policy(args.policy, **options)
    dispatcher = Dispatcher(policy, DispatchSettings(replica_expiry=1e9), {"echo"})
    router = ZmqRouter(dispatcher).start()
    endpoints.put((router.frontend_endpoint, router.backend_endpoint))
    while router.call(lambda d: len(d.replicas)).result() < args.replicas:
        time.sleep(0.1)
    if policy.uses_prefix:
        firsts = conversations(args.seed, args.conversations)

        def warm(d):  # on the router thread: one routed, recorded turn per conversation
            pool = d.pools["echo"]
            for prompt in firsts:
                key = d.policy.routing_key(prompt)
                d.policy.commit(d.policy.route(pool, (), key), key)
            return len(d.policy.index)
        router.call(warm).result()
        # A serving router holds no prompts: these 20 million token ids in 20,000 lists were the
        # benchmark's own, and every full garbage collection walked them (~40 us a request, profiled).
        del firsts, warm
    ready.put(os.getpid())
    while True:
        time.sleep(3600)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc; 0.0 where unavailable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def phase(kind: str, args, stats_rate: float = 0.0) -> tuple[float, float, float]:
    """(answers/s, hub CPU microseconds per answer, stats messages/s) over the counted window of one phase.
    stats_rate: every replica also sends ReplicaStats this many times a second (router phases)."""
    endpoints, ready = mp.Queue(), mp.Queue()
    hubs = []
    for _ in range(1 if kind == "proxy" else args.routers):
        target, targs = (run_proxy, (endpoints,)) if kind == "proxy" else (run_router, (endpoints, ready, args))
        hub = mp.Process(target=target, args=targs, daemon=True)
        hub.start()
        hubs.append((hub, endpoints.get(timeout=60)))
    ids = [f"node{i // 8:03d}/gpu{i % 8}" for i in range(args.replicas)]
    peers, echo_ready, go, counts = [], mp.Queue(), mp.Event(), []
    for _, (_, backend) in hubs:  # every router reaches every replica: one socket per (replica, router)
        for k in range(ECHO_PROCESSES):
            stats = None
            if stats_rate and kind == "router":
                counts.append(mp.Value("q", 0, lock=False))
                stats = (stats_rate, go, counts[-1], False)
            p = mp.Process(target=echo_replicas, args=(backend, ids[k::ECHO_PROCESSES], kind == "proxy", echo_ready,
                                                       args.chunks, stats, args.batched_now), daemon=True)
            p.start()
            peers.append(p)
    for _ in peers:
        echo_ready.get(timeout=120)
    if kind == "proxy":
        time.sleep(1.0)  # connections made
    else:
        for _ in hubs:
            ready.get(timeout=300)  # every replica registered, the index warm
    go.set()  # stats (if any) flow from here, through the client's idle second and warm-up
    result = mp.Queue()
    c = mp.Process(target=client, args=([fe for _, (fe, _) in hubs], [h.pid for h, _ in hubs], args, result, counts))
    c.start()
    rate, cpu, stats = result.get(timeout=args.seconds + 300)
    c.join()
    for p in [*peers, *(h for h, _ in hubs)]:
        p.terminate()
        p.join()
    return rate, cpu, stats


def stats_phase(args, rate: float) -> tuple[float, float]:
    """(stats messages/s, router CPU microseconds per stats message): one router with the whole fleet
    registered (index warm as in `phase`), no requests; every replica socket sends ReplicaStats `rate` times a
    second. The router's CPU over 2 s before the stats start (its ticks, status snapshots) is left out."""
    endpoints, ready, echo_ready = mp.Queue(), mp.Queue(), mp.Queue()
    hub = mp.Process(target=run_router, args=(endpoints, ready, args), daemon=True)
    hub.start()
    backend = endpoints.get(timeout=60)[1]
    ids = [f"node{i // 8:03d}/gpu{i % 8}" for i in range(args.replicas)]
    go = mp.Event()
    counts = [mp.Value("q", 0, lock=False) for _ in range(ECHO_PROCESSES)]
    peers = [mp.Process(target=echo_replicas, args=(backend, ids[k::ECHO_PROCESSES], False, echo_ready, 1,
                                                    (rate, go, counts[k], True)), daemon=True)
             for k in range(ECHO_PROCESSES)]
    for p in peers:
        p.start()
    for _ in peers:
        echo_ready.get(timeout=120)
    pid = ready.get(timeout=300)
    time.sleep(1.0)
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    time.sleep(2.0)
    idle_per_s = (cpu_seconds(pid) - cpu0) / (time.perf_counter() - t0)
    go.set()
    time.sleep(1.0)  # warm-up, not counted
    sent0, cpu0, t0 = sum(c.value for c in counts), cpu_seconds(pid), time.perf_counter()
    time.sleep(args.seconds)
    sent, cpu, elapsed = sum(c.value for c in counts) - sent0, cpu_seconds(pid) - cpu0, time.perf_counter() - t0
    for p in [*peers, hub]:
        p.terminate()
        p.join()
    return sent / elapsed, 1e6 * (cpu - idle_per_s * elapsed) / max(1, sent)


def spread(values: list[float], fmt: str) -> str:
    return f"median {format(statistics.median(values), fmt)} (range {format(min(values), fmt)}-{format(max(values), fmt)})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=3072)
    parser.add_argument("--conversations", type=int, default=20000, help="conversations in the warm index")
    parser.add_argument("--distinct", type=int, default=8192, help="distinct pre-encoded requests the client cycles")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--policy", default="prefix_affinity")
    parser.add_argument("--rounds", type=int, default=5, help="proxy/router phase pairs, alternating")
    parser.add_argument("--routers", type=int, default=1, help="router processes sharing the fleet")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rate", type=float, default=0.0,
                        help="open loop: send this many requests/s in all (0: closed loop, --window in flight); "
                             "CPU per request then leaves out the hubs' idle CPU, measured for 1 s before")
    parser.add_argument("--pure-python", action="store_true",
                        help="prefix_affinity with the pure-Python index and route (as where the extension is not built)")
    parser.add_argument("--per-router", action="store_true",
                        help="with --rate and --compare-routers: --rate is each router's share (N routers get N x rate), "
                             "so every router works at the same load whatever N")
    parser.add_argument("--compare-routers", type=int, nargs="+", metavar="N",
                        help="instead of the proxy comparison: each round runs these router counts in turn "
                             "(e.g. 1 2 4, best with --rate) and reports each against the first")
    parser.add_argument("--chunks", type=int, default=1,
                        help="token chunks each echo replica answers a request with, the last one finished (default 1)")
    parser.add_argument("--compare-chunks", type=int, nargs=2, metavar=("K1", "K2"),
                        help="instead of the proxy comparison: each round runs one router with K1, then K2 chunks "
                             "an answer (e.g. 1 8) and reports the router's CPU per request and per added chunk")
    parser.add_argument("--batched", action="store_true",
                        help="with --compare-chunks: also run K1 and K2 with chunks batched as when serving (a "
                             "replica's K - 1 partial chunks in one TokenChunks frame, the router's replies to the "
                             "client as TokenChunks) and report both slopes side by side; with --chunks K (the proxy "
                             "comparison): both the proxy and the router forward answers sent that way")
    parser.add_argument("--stats-rate", type=float, nargs="+", metavar="HZ",
                        help="instead of the proxy comparison: no requests; every replica sends ReplicaStats this "
                             "many times a second (several rates: taken in turn each round) and the router's CPU "
                             "per stats message is reported (router.replica_heartbeat 1 s: 1 a second)")
    parser.add_argument("--compare-stats", type=float, metavar="HZ",
                        help="instead of the proxy comparison: each round runs one router serving requests without, "
                             "then with every replica sending ReplicaStats HZ times a second, and reports the "
                             "router's CPU per stats message while it routes")
    args = parser.parse_args(argv)
    args.batched_now = False  # the phase being run sends chunks batched (--batched)
    if args.chunks < 1 or (args.compare_chunks and min(args.compare_chunks) < 1):
        parser.error("--chunks and --compare-chunks take 1 or more chunks an answer")
    policy = f"{args.policy}, pure Python" if args.pure_python else args.policy
    if args.compare_routers:
        return compare_routers(args, policy)
    if args.compare_chunks:
        return compare_chunks(args, policy)
    if args.stats_rate:
        return stats_costs(args, policy)
    if args.compare_stats:
        return compare_stats(args, policy)
    label = f"{args.routers} x ZmqRouter ({policy})" if args.routers > 1 else f"ZmqRouter ({policy})"
    args.batched_now = args.batched  # --chunks K --batched: the proxy and the router forward the same frames
    ratios, cpu_ratios, proxy_cpus, router_cpus, rates = [], [], [], [], []
    for i in range(args.rounds):
        proxy, proxy_cpu, _ = phase("proxy", args)
        router, router_cpu, _ = phase("router", args)
        ratios.append(router / proxy)
        cpu_ratios.append(router_cpu / proxy_cpu if proxy_cpu else float("inf"))
        proxy_cpus.append(proxy_cpu)
        router_cpus.append(router_cpu)
        rates.append(router)
        print(f"round {i + 1}: zmq.proxy {proxy:8.0f} req/s ({proxy_cpu:5.1f} us CPU each)   "
              f"{label} {router:8.0f} req/s ({router_cpu:5.1f} us CPU each)   = {router / proxy:.0%}, "
              f"CPU {cpu_ratios[-1]:.1f}x", flush=True)
    median, cpu_median = statistics.median(ratios), statistics.median(cpu_ratios)
    print(f"{args.replicas} replicas, {args.conversations} conversations in the warm index, {args.rounds} rounds, "
          f"{args.chunks} chunk(s) an answer" + (" (sent batched, as serving replicas send them)" if args.batched else ""))
    print(f"{label}: {spread(rates, '.0f')} req/s; CPU per request {spread(router_cpus, '.1f')} us, "
          f"proxy {spread(proxy_cpus, '.1f')} us")
    print(f"requests/s vs the proxy: {spread([100 * r for r in ratios], '.0f')} %  "
          f"(target >= 70%: {'met' if median >= 0.7 else 'NOT met'})")
    print(f"CPU per request vs the proxy: {spread(cpu_ratios, '.1f')} x  "
          f"(target <= 3x: {'met' if cpu_median <= 3 else 'NOT met'})")
    return 0


def compare_routers(args, policy: str) -> int:
    counts = args.compare_routers
    rates: dict[int, list[float]] = {n: [] for n in counts}
    cpus: dict[int, list[float]] = {n: [] for n in counts}
    each = args.rate
    for i in range(args.rounds):
        line = []
        for n in counts:
            args.routers = n
            args.rate = each * n if args.per_router else each
            rate, cpu, _ = phase("router", args)
            rates[n].append(rate)
            cpus[n].append(cpu)
            line.append(f"{n} router(s) {rate:7.0f} req/s, {cpu:5.1f} us CPU each")
        print(f"round {i + 1}: " + "   ".join(line), flush=True)
    load = (f"open loop at {each:.0f} req/s" + (" per router" if args.per_router else " in all")) if each \
        else f"closed loop, {args.window} in flight"
    print(f"{args.replicas} replicas, ZmqRouter ({policy}), {load}, {args.rounds} rounds")
    first = counts[0]
    for n in counts:
        rate_x = [r / r0 for r, r0 in zip(rates[n], rates[first])]
        cpu_x = [c / c0 for c, c0 in zip(cpus[n], cpus[first])]
        print(f"{n} router(s): {spread(rates[n], '.0f')} req/s ({spread(rate_x, '.2f')}x {first}'s); "
              f"CPU per request {spread(cpus[n], '.1f')} us ({spread(cpu_x, '.2f')}x {first}'s)")
    return 0


def compare_chunks(args, policy: str) -> int:
    """One router, answers of K1 then K2 chunks in each round: the marginal CPU of a chunk is the slope.
    With --batched, the same again with chunks sent batched (replica and gateway), in the same round."""
    k1, k2 = args.compare_chunks
    modes = ("a chunk a frame", "batched") if args.batched else ("a chunk a frame",)
    rates = {(m, k): [] for m in modes for k in (k1, k2)}
    cpus = {(m, k): [] for m in modes for k in (k1, k2)}
    for i in range(args.rounds):
        line = []
        for mode in modes:
            args.batched_now = mode == "batched"
            for k in (k1, k2):
                args.chunks = k
                rate, cpu, _ = phase("router", args)
                rates[mode, k].append(rate)
                cpus[mode, k].append(cpu)
            slope = (cpus[mode, k2][-1] - cpus[mode, k1][-1]) / (k2 - k1)
            line.append(f"{mode}: {k1} chunk(s) {cpus[mode, k1][-1]:5.1f} us, {k2} chunks {cpus[mode, k2][-1]:5.1f} us"
                        f" -> {slope:.1f} us a chunk")
        print(f"round {i + 1}: " + "   ".join(line), flush=True)
    args.batched_now = False
    print(f"{args.replicas} replicas, ZmqRouter ({policy}), closed loop, {args.window} requests in flight, "
          f"{args.rounds} rounds")
    slopes = {}
    for mode in modes:
        for k in (k1, k2):
            print(f"{mode}, {k} chunk(s) an answer: {spread(rates[mode, k], '.0f')} req/s; router CPU per request "
                  f"{spread(cpus[mode, k], '.1f')} us, per chunk {spread([c / k for c in cpus[mode, k]], '.1f')} us")
        slopes[mode] = [(c2 - c1) / (k2 - k1) for c1, c2 in zip(cpus[mode, k1], cpus[mode, k2])]
        print(f"{mode}: marginal router CPU per chunk (slope {k1} -> {k2} chunks, per round): "
              f"{spread(slopes[mode], '.1f')} us")
    if args.batched:
        ratios = [b / a for a, b in zip(slopes["a chunk a frame"], slopes["batched"]) if a > 0]
        print(f"batched / a chunk a frame, per chunk, per round: {spread(ratios, '.2f')}")
    return 0


def compare_stats(args, policy: str) -> int:
    """One router serving requests (closed loop), without then with every replica sending stats at
    --compare-stats HZ in each round: the router's CPU per stats message while it is busy with requests
    (its CPU beyond what the requests cost in the round without stats, per stats message)."""
    hz = args.compare_stats
    marginal, rows = [], []
    for i in range(args.rounds):
        rate0, cpu0, _ = phase("router", args)
        rate1, cpu1, stats = phase("router", args, hz)
        marginal.append((cpu1 - cpu0) * rate1 / stats if stats else float("nan"))
        rows.append((rate0, cpu0, rate1, cpu1, stats))
        print(f"round {i + 1}: no stats {rate0:7.0f} req/s, {cpu0:5.1f} us CPU a request   stats {hz:g}/s a replica "
              f"({stats:6.0f}/s) {rate1:7.0f} req/s, {cpu1:5.1f} us CPU a request   -> {marginal[-1]:.1f} us a stats "
              "message", flush=True)
    print(f"{args.replicas} replicas, ZmqRouter ({policy}), closed loop, {args.window} requests in flight, "
          f"{args.rounds} rounds")
    print(f"CPU per request without stats {spread([r[1] for r in rows], '.1f')} us, with "
          f"{spread([r[3] for r in rows], '.1f')} us; router CPU per stats message while routing: "
          f"{spread(marginal, '.1f')} us")
    return 0


def stats_costs(args, policy: str) -> int:
    """Router CPU per ReplicaStats message at each --stats-rate, rounds alternating over the rates."""
    rates = args.stats_rate
    per: dict[float, list[float]] = {r: [] for r in rates}
    flows: dict[float, list[float]] = {r: [] for r in rates}
    for i in range(args.rounds):
        line = []
        for r in rates:
            flow, cpu = stats_phase(args, r)
            per[r].append(cpu)
            flows[r].append(flow)
            line.append(f"{r:g}/s a replica: {flow:7.0f} stats/s, {cpu:5.1f} us CPU each")
        print(f"round {i + 1}: " + "   ".join(line), flush=True)
    print(f"{args.replicas} replicas, ZmqRouter ({policy}), no requests, {args.rounds} rounds")
    for r in rates:
        print(f"stats {r:g}/s a replica ({spread(flows[r], '.0f')} messages/s): router CPU per stats message "
              f"{spread(per[r], '.1f')} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
