"""Overload benchmark: thousands of concurrent streams against `exaserve serve` with echo replicas, loopback only.

Starts `exaserve serve` (echo replicas: no model, the serving path's own figures; heartbeat 1 s x 3 as on a
busy login node), opens --streams concurrent streaming completions of --max-tokens tokens at once and
reports how each ended:

  200 complete    the stream ended with its finish_reason and data: [DONE]
  200 cut         a 200 whose stream stopped early (an error event, or the connection closed before [DONE])
  429 + Retry-After, 429 without it, 503 (+ Retry-After), other statuses, connection errors, timeouts

then whether the server is healthy after (/health 200 and a fresh request answered), and the node-lost
events the controller logged during the run (false node losses: this machine's only node never stops).

With --abandon N it then opens N streams of --abandon-tokens tokens on a second model paced like a GPU
(engine timing), closes each after its first event (a client that went away), and reports how many tokens
the replicas generated for them: with prompt aborts a small fraction of N x abandon-tokens.

    .venv/bin/python benchmarks/bench_overload.py [--streams 2000] [--max-tokens 256] [--abandon 500]

Every stream has a deadline (--timeout), and the whole run is bounded by them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import yaml

PROMPT = "The quick brown fox jumps over the lazy dog. " * 2


def start_server(tmp: Path, replicas: int, max_queued: int) -> tuple[subprocess.Popen, str, list[str]]:
    site = {
        "site": "bench-overload",
        "cluster": {"nodes": 1, "nodelist": "localhost"},
        "heartbeat": {"interval": "1s", "misses": 3},
        "gateway": {"max_queued_requests": max_queued},
        "run_dir": str(tmp / "run"),
        "models": [{"model_name": "echo", "engine": "echo", "replicas": replicas, "min_replicas": replicas,
                    "max_seq_len": 4096},
                   # paced like a GPU (the timing model), for the abandoned streams: echo finishes a
                   # 512-token stream in milliseconds, before any client could hang up
                   {"model_name": "paced", "engine": "timing", "replicas": 1, "min_replicas": 1,
                    "max_seq_len": 4096, "max_batch_size": 256}],
    }
    path = tmp / "site.yaml"
    path.write_text(yaml.safe_dump(site))
    process = subprocess.Popen([sys.executable, "-m", "exaserve_hpc.cli", "serve", "--site", str(path), "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    url: list[str] = []

    def read() -> None:
        for line in process.stdout:
            lines.append(line)
            match = re.search(r"serving .* at (http://\S+)/v1", line)
            if match:
                url.append(match.group(1))

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 90
    while not url:
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit("exaserve serve did not start:\n" + "".join(lines[-30:]))
        time.sleep(0.1)
    return process, url[0], lines


async def http(url: str, method: str, path: str, body: dict | None = None, timeout: float = 30.0,
               first_event_only: bool = False) -> tuple[int, dict, bytes, bool]:
    """One HTTP/1.0 exchange (no chunked encoding) on its own connection: (status, headers, body read, stream complete).

    A plain asyncio client: thousands of them fit in one process on a small machine."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout)
    try:
        payload = json.dumps(body).encode() if body is not None else b""
        writer.write(f"{method} {path} HTTP/1.0\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        status = int(head.split(b" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.decode().partition(":") for line in head.split(b"\r\n")[1:] if line)}
        data = b""
        deadline = time.monotonic() + timeout
        while True:
            chunk = await asyncio.wait_for(reader.read(65536), max(0.01, deadline - time.monotonic()))
            if not chunk:
                break
            data += chunk
            if first_event_only and b"\n\n" in data:
                break
        complete = data.rstrip().endswith(b"data: [DONE]") and b'"error"' not in data
        return status, headers, data, complete
    finally:
        writer.close()


async def overload(url: str, streams: int, max_tokens: int, timeout: float) -> Counter:
    outcome: Counter = Counter()
    body = {"model": "echo", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True}
    gate = asyncio.Event()

    async def one() -> None:
        await gate.wait()  # all at once
        try:
            status, headers, data, complete = await http(url, "POST", "/v1/completions", body, timeout)
        except asyncio.TimeoutError:
            outcome["timeout"] += 1
            return
        except (OSError, asyncio.IncompleteReadError) as exc:
            outcome[f"connection error ({type(exc).__name__})"] += 1
            return
        if status == 200:
            outcome["200 complete" if complete else "200 cut"] += 1
        elif status in (429, 503):
            outcome[f"{status} {'with' if 'retry-after' in headers else 'WITHOUT'} Retry-After"] += 1
        else:
            outcome[f"{status}"] += 1

    tasks = [asyncio.create_task(one()) for _ in range(streams)]
    await asyncio.sleep(0.5)
    gate.set()
    await asyncio.gather(*tasks)
    return outcome


async def abandon(url: str, count: int, max_tokens: int, timeout: float) -> int:
    """Open `count` streams, read each one's first event, hang up; completion tokens the clients saw."""
    seen = 0
    body = {"model": "paced", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True}

    async def one() -> None:
        nonlocal seen
        try:
            status, _, data, _ = await http(url, "POST", "/v1/completions", body, timeout, first_event_only=True)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
            return
        if status == 200:
            seen += sum(len(json.loads(e[6:])["choices"][0]["text"]) for e in data.decode().split("\n\n")
                        if e.startswith("data: {"))

    await asyncio.gather(*(one() for _ in range(count)))
    return seen


def generated(url: str) -> int:
    """Tokens every replica generated so far (their engines' counters, on /metrics)."""
    import urllib.request
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        text = r.read().decode()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("exaserve_replica_generated_tokens_total{")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--max-queued", type=int, default=1024, help="gateway.max_queued_requests")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per stream")
    parser.add_argument("--abandon", type=int, default=500, help="streams abandoned after their first event")
    parser.add_argument("--abandon-tokens", type=int, default=512)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        process, url, lines = start_server(Path(tmp), args.replicas, args.max_queued)
        try:
            started = time.monotonic()
            outcome = asyncio.run(overload(url, args.streams, args.max_tokens, args.timeout))
            elapsed = time.monotonic() - started
            print(f"overload: {args.streams} concurrent streams x {args.max_tokens} tokens, {args.replicas} echo "
                  f"replicas, gateway.max_queued_requests {args.max_queued}, loopback; {elapsed:.1f} s")
            for key, count in sorted(outcome.items()):
                print(f"  {key:32s} {count}")
            time.sleep(2)
            health = asyncio.run(http(url, "GET", "/health"))[0]
            fresh = asyncio.run(http(url, "POST", "/v1/completions",
                                     {"model": "echo", "prompt": "after", "max_tokens": 5}))[0]
            print(f"  after: /health {health}, a fresh request {fresh}")
            if args.abandon:
                before = generated(url)
                seen = asyncio.run(abandon(url, args.abandon, args.abandon_tokens, args.timeout))
                time.sleep(args.abandon_tokens * 0.03)  # as long as a whole stream takes: each ended or aborted
                extra = generated(url) - before
                full = args.abandon * args.abandon_tokens
                print(f"abandoned: {args.abandon} streams x {args.abandon_tokens} tokens closed after the first "
                      f"event: clients read {seen} tokens, replicas generated {extra} ({extra / full:.1%} of "
                      f"{full} if none were aborted)")
        finally:
            process.terminate()
            try:
                code = process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                code = "killed after 60 s"
        log = "".join(lines)
        lost = re.findall(r"node \S+ lost", log)
        print(f"  node-lost events in the controller's log: {len(lost)}; exaserve serve exit status: {code}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
