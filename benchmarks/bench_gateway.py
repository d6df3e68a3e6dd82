"""Gateway benchmark: requests/s and latency of the serving path on loopback.

Starts `exaserve serve` with echo replicas (no model: the figure is the
gateway + router + ZeroMQ + replica loop's own), then drives it with
concurrent HTTP clients and reports requests/s, p50 and p99 latency for
non-streaming and streaming completions.

    .venv/bin/python benchmarks/bench_gateway.py [--requests 2000] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml


def start_server(tmp: Path, replicas: int) -> tuple[subprocess.Popen, str]:
    site = {
        "site": "bench-echo",
        "cluster": {"nodes": 1, "nodelist": "localhost"},
        "heartbeat": {"interval": "1s"},
        "gateway": {"max_queued_requests": 4096},
        "run_dir": str(tmp / "run"),
        "models": [{"model_name": "echo", "engine": "echo", "replicas": replicas, "max_seq_len": 4096}],
    }
    path = tmp / "site.yaml"
    path.write_text(yaml.safe_dump(site))
    process = subprocess.Popen([sys.executable, "-m", "exaserve_hpc.cli", "serve", "--site", str(path), "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    url: list[str] = []

    def read() -> None:
        for line in process.stdout:
            match = re.search(r"at (http://\S+)/v1", line)
            if match:
                url.append(match.group(1))

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 60
    while not url:
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("server did not start")
        time.sleep(0.1)
    return process, url[0]


async def drive(url: str, total: int, concurrency: int, stream: bool, max_tokens: int) -> dict:
    latencies: list[float] = []
    failures = 0
    counter = iter(range(total))
    body = {"model": "echo", "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": max_tokens,
            "stream": stream}

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal failures
        for _ in counter:
            started = time.perf_counter()
            try:
                if stream:
                    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                        async for _line in response.aiter_lines():
                            pass
                        ok = response.status_code == 200
                else:
                    response = await client.post(f"{url}/v1/completions", json=body)
                    ok = response.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                latencies.append(time.perf_counter() - started)
            else:
                failures += 1

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    latencies.sort()
    return {"requests": total, "failures": failures, "seconds": elapsed, "rps": len(latencies) / elapsed,
            "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        process, url = start_server(Path(tmp), args.replicas)
        try:
            asyncio.run(drive(url, 100, 8, False, args.max_tokens))  # warm connections and code paths
            print(f"gateway benchmark: {args.requests} requests, concurrency {args.concurrency}, "
                  f"{args.replicas} echo replicas, max_tokens {args.max_tokens}, loopback, 2-core machine shared "
                  f"by client and server")
            for stream in (False, True):
                result = asyncio.run(drive(url, args.requests, args.concurrency, stream, args.max_tokens))
                print(f"  {'stream ' if stream else 'nostream'}: {result['rps']:7.1f} req/s  "
                      f"p50 {result['p50_ms']:6.1f} ms  p99 {result['p99_ms']:6.1f} ms  "
                      f"failures {result['failures']}")
        finally:
            process.terminate()
            process.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
