"""Write a synthetic multi-tenant trace in the Mooncake format (one JSON object a line:
timestamp ms, input_length, output_length, hash_ids of 512-token blocks).

    python benchmarks/tenant_trace.py OUT.jsonl [--requests 4000] [--tenants 300] [--seed 7]

A second workload for benchmarks/bench_router_trace.py that its constants were not tuned on:
- many tenants (Zipf-popular), each with its own system prompt of 1-12 blocks, and a few shared
  system prompts (8 "products") that a third of the tenants put in front of their own;
- conversations: a tenant's session continues from its previous turn (the whole history is the
  prefix of the next prompt), new sessions start from the system prompt;
- bursts: besides Poisson arrivals, now and then one tenant sends 20-60 requests within 2 s
  (a batch job or a retrying client), each a fresh session on its system prompt.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

BLOCK = 512


def generate(requests: int, tenants: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    next_hash = iter(range(10 ** 9))
    products = [[next(next_hash) for _ in range(rng.randint(2, 6))] for _ in range(8)]
    systems = []
    for _ in range(tenants):
        own = [next(next_hash) for _ in range(rng.randint(1, 12))]
        systems.append((rng.choice(products) if rng.random() < 1 / 3 else []) + own)
    weights = [1 / (k + 1) ** 1.1 for k in range(tenants)]  # Zipf popularity
    sessions: dict[int, list[list[int]]] = {}
    rows, t = [], 0.0
    while len(rows) < requests:
        t += rng.expovariate(4.0)  # 4 requests/s before bursts; the benchmark rescales time anyway
        tenant = rng.choices(range(tenants), weights)[0]
        burst = rng.random() < 0.01
        for k in range(rng.randint(20, 60) if burst else 1):
            at = t + (rng.uniform(0, 2.0) if burst else 0.0)
            live = sessions.setdefault(tenant, [])
            if not burst and live and rng.random() < 0.6:
                history = live.pop(rng.randrange(len(live)))  # a next turn of a conversation
            else:
                history = list(systems[tenant])
            new = [next(next_hash) for _ in range(rng.randint(1, 6))]
            hashes = history + new
            output = max(1, min(2000, int(rng.lognormvariate(5.0, 1.0))))
            rows.append({"timestamp": int(at * 1000), "input_length": len(hashes) * BLOCK - rng.randint(0, BLOCK - 1),
                         "output_length": output, "hash_ids": hashes})
            # the answer becomes part of the history: its blocks follow the prompt's
            live.append(hashes + [next(next_hash) for _ in range(-(-output // BLOCK))])
            if len(live) > 8:
                live.pop(0)
    rows.sort(key=lambda r: r["timestamp"])
    return rows[:requests]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--tenants", type=int, default=300)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    with open(args.out, "w") as f:
        for row in generate(args.requests, args.tenants, args.seed):
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
