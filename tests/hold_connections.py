"""Another local process holding idle HTTP connections to a gateway (tests/test_serve_http_limits.py).

    python tests/hold_connections.py PORT COUNT SECONDS [--slow N] [--rate R] [--reopen R2]

Opens COUNT connections to 127.0.0.1:PORT (at most R new ones a second, default 2000) and holds them
SECONDS: idle ones send nothing; N of them (--slow) send a request's first header line and then one
byte every 0.5 s, never finishing the headers. A connection the server closes is opened again at most
R2 a second (--reopen, default 0: held ones are not replaced). At the end prints one JSON line: opened,
peak_held (connections open at once, from this side), closed_by_server, slow_lifetimes ([count, shortest,
longest] seconds slow connections lived before the server closed them; idle_lifetimes: the others'), refused (503s read), errors.
Only 127.0.0.1; bounded by COUNT and SECONDS.
"""

from __future__ import annotations

import argparse
import errno
import json
import resource
import selectors
import socket
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("count", type=int)
    parser.add_argument("seconds", type=float)
    parser.add_argument("--slow", type=int, default=0)
    parser.add_argument("--rate", type=float, default=2000.0)
    parser.add_argument("--reopen", type=float, default=0.0)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    count = min(args.count, hard - 64)

    selector = selectors.DefaultSelector()
    live: dict[socket.socket, dict] = {}
    stats = {"wanted": args.count, "count": count, "opened": 0, "peak_held": 0, "closed_by_server": 0,
             "slow_lifetimes": [], "idle_lifetimes": [], "refused": 0, "errors": 0}
    slow_wanted = min(args.slow, count)
    start = time.monotonic()
    end = start + args.seconds
    budget, reopen_budget, last = 0.0, 0.0, start
    next_trickle = start

    def open_one(slow: bool) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        code = sock.connect_ex(("127.0.0.1", args.port))
        if code not in (0, errno.EINPROGRESS):
            stats["errors"] += 1
            sock.close()
            return
        live[sock] = {"slow": slow, "at": time.monotonic(), "sent": False}
        selector.register(sock, selectors.EVENT_READ)
        stats["opened"] += 1

    def close(sock: socket.socket, by_server: bool) -> None:
        info = live.pop(sock)
        selector.unregister(sock)
        sock.close()
        if by_server:
            stats["closed_by_server"] += 1
            stats["slow_lifetimes" if info["slow"] else "idle_lifetimes"].append(round(time.monotonic() - info["at"], 2))

    while time.monotonic() < end:
        now = time.monotonic()
        budget = min(budget + (now - last) * args.rate, args.rate)
        reopen_budget = min(reopen_budget + (now - last) * args.reopen, max(1.0, args.reopen))
        last = now
        slow_live = sum(1 for i in live.values() if i["slow"])
        while len(live) < count and budget >= 1 and (stats["opened"] < count or reopen_budget >= 1):
            if stats["opened"] >= count:
                reopen_budget -= 1
            open_one(slow_live < slow_wanted)
            slow_live += 1
            budget -= 1
        stats["peak_held"] = max(stats["peak_held"], len(live))
        for key, _ in selector.select(timeout=0.05):
            sock = key.fileobj
            try:
                data = sock.recv(65536)
            except (ConnectionResetError, ConnectionRefusedError, OSError):
                data = b""
            if data.startswith(b"HTTP/1.1 503"):
                stats["refused"] += 1
            if not data:
                close(sock, True)
        if now >= next_trickle:  # slow senders: a header line, then a byte each 0.5 s, never the end
            next_trickle = now + 0.5
            for sock, info in list(live.items()):
                if not info["slow"]:
                    continue
                try:
                    sock.send(b"X" if info["sent"] else b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                    info["sent"] = True
                except BlockingIOError:
                    pass
                except OSError as exc:
                    if exc.errno != errno.ENOTCONN:  # not connected yet: next time
                        close(sock, True)
    for sock in list(live):
        close(sock, False)
    for kind in ("slow_lifetimes", "idle_lifetimes"):  # [count, shortest, longest]: a pipe holds 64 KiB
        times = stats[kind]
        stats[kind] = [len(times), min(times, default=0.0), max(times, default=0.0)]
    print(json.dumps(stats), flush=True)


if __name__ == "__main__":
    main()
