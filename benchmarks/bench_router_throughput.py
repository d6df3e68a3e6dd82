"""Routed requests/s of one router process vs a plain zmq.proxy forwarding the same messages.

    python benchmarks/bench_router_throughput.py [--replicas 2] [--seconds 5] [--window 256] [--policy prefix_affinity] [--rounds 3]

Same run, same peers, two phases:
1. proxy: `zmq.proxy(ROUTER, DEALER)` in its own process; echo workers
   behind it answer each GenerateRequest with one finished TokenChunk;
2. router: `ZmqRouter` + `Dispatcher` in its own process (decode, policy,
   bookkeeping, re-encode both ways); echo replicas say hello and answer the
   same way. With prefix_affinity the client sends the prompt's block hashes,
as the gateway does (both phases carry the same bytes).

A client process keeps ``window`` requests in flight and counts answers for
``seconds``. The two phases alternate ``rounds`` times and the median ratio is
reported (a shared machine's load drifts between phases); so is the hub
process's CPU time per answered request (from /proc), which drifts less. Echo peers are minimal (no engine) so the figure is the
forwarding path. On a small machine the client and the echo peers share the
cores with the router: the ratio is what to read, not the absolute rate.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

import zmq

from exaserve_hpc.protocol import GenerateRequest, ReplicaHello, TokenChunk, decode, encode
from exaserve_hpc.router.affinity import AffinitySettings

PROMPT = list(range(1000, 1064))


def echo_replica(endpoint: str, replica_id: str, envelope: bool) -> None:
    """Answer every request with one finished chunk. envelope: behind zmq.proxy (identity frame kept)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if not envelope:
        sock.setsockopt(zmq.IDENTITY, replica_id.encode())
    sock.connect(endpoint)
    if not envelope:
        sock.send(encode(ReplicaHello(replica_id=replica_id, model="echo", pid=0, max_batch_size=4096,
                                      max_seq_len=8192)))
    while True:
        frames = sock.recv_multipart()
        message = decode(frames[-1])
        if not isinstance(message, GenerateRequest):
            continue
        reply = encode(TokenChunk(request_id=message.request_id, token_ids=message.prompt_token_ids[:4],
                                  finished=True, finish_reason="length"))
        sock.send_multipart(frames[:-1] + [reply])


def client(endpoint: str, seconds: float, window: int, result, policy: str) -> None:
    ctx = zmq.Context()
    hasher = AffinitySettings().hasher() if policy == "prefix_affinity" else None  # as the gateway does
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sent = 0

    def send() -> None:
        nonlocal sent
        sock.send(encode(GenerateRequest(request_id=f"q{sent}", model="echo", prompt_token_ids=PROMPT,
                                         max_tokens=4, prefix_hashes=hasher(PROMPT) if hasher else [],
                                         prefix_scheme=hasher.scheme if hasher else "")))
        sent += 1

    for _ in range(window):
        send()
    warm_until = time.perf_counter() + 1.0  # first second: warm-up, not counted
    while time.perf_counter() < warm_until:
        if sock.poll(100):
            decode(sock.recv())
            send()
    started, counted = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        if sock.poll(100):
            decode(sock.recv())
            counted += 1
            send()
    result.value = counted / (time.perf_counter() - started)


def run_proxy(endpoints) -> None:
    ctx = zmq.Context()
    f, b = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    fp, bp = f.bind_to_random_port("tcp://127.0.0.1"), b.bind_to_random_port("tcp://127.0.0.1")
    endpoints.put((f"tcp://127.0.0.1:{fp}", f"tcp://127.0.0.1:{bp}"))
    zmq.proxy(f, b)


def run_router(endpoints, policy: str) -> None:
    import logging
    logging.disable(logging.WARNING)  # the client leaving mid-stream at the end is expected
    from exaserve_hpc.router.policies import make_policy
    from exaserve_hpc.router.dispatch import Dispatcher, DispatchSettings
    from exaserve_hpc.router.zmq_router import ZmqRouter
    dispatcher = Dispatcher(make_policy(policy), DispatchSettings(replica_expiry=1e9), {"echo"})
    router = ZmqRouter(dispatcher).start()
    endpoints.put((router.frontend_endpoint, router.backend_endpoint))
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


def phase(kind: str, args) -> tuple[float, float]:
    """(answers/s, hub CPU microseconds per answer incl. warm-up) of one phase."""
    endpoints = mp.Queue()
    hub = mp.Process(target=run_proxy if kind == "proxy" else run_router,
                     args=(endpoints,) if kind == "proxy" else (endpoints, args.policy), daemon=True)
    hub.start()
    fe, be = endpoints.get(timeout=30)
    peers = [mp.Process(target=echo_replica, args=(be, f"echo/r{i}", kind == "proxy"), daemon=True)
             for i in range(args.replicas)]
    for p in peers:
        p.start()
    time.sleep(1.0)  # hellos registered
    result = mp.Value("d", 0.0)
    c = mp.Process(target=client, args=(fe, args.seconds, args.window, result, args.policy))
    cpu0 = cpu_seconds(hub.pid)
    c.start()
    c.join()
    cpu = cpu_seconds(hub.pid) - cpu0
    for p in [*peers, hub]:
        p.terminate()
        p.join()
    answered = result.value * (args.seconds + 1.0)  # the warm-up second answers at about the same rate
    return result.value, 1e6 * cpu / answered if answered else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--policy", default="prefix_affinity")
    parser.add_argument("--rounds", type=int, default=3, help="proxy/router phase pairs; the median ratio counts")
    args = parser.parse_args(argv)
    ratios = []
    for i in range(args.rounds):
        proxy, proxy_cpu = phase("proxy", args)
        router, router_cpu = phase("router", args)
        ratios.append(router / proxy)
        print(f"round {i + 1}: zmq.proxy {proxy:9.0f} requests/s ({proxy_cpu:5.1f} us CPU each)   "
              f"ZmqRouter ({args.policy}) {router:9.0f} requests/s ({router_cpu:5.1f} us CPU each)   "
              f"= {router / proxy:.0%}")
    median = statistics.median(ratios)
    print(f"median over {args.rounds} round(s): ZmqRouter ({args.policy}) = {median:.0%} of the proxy "
          f"(target >= 50%: {'met' if median >= 0.5 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
