"""Run under mpirun: greedy tokens of a TP x PP replica, printed by rank 0 as JSON.

    mpirun -n 4 python tests/engine/mpi_parallel_check.py --tp 2 --pp 2 --ckpt DIR
"""

import argparse
import json
import sys

from exaserve_hpc.engine.base import EngineRequest
from exaserve_hpc.engine.parallel import start_parallel_engine

PROMPTS = ["The quick brown fox jumps over the lazy dog, again and again.",
           "The quick brown fox jumps over the lazy cat.", "HPC!"]


def requests():
    return [EngineRequest(f"r{i}", [256] + list(p.encode()), 12, stop_token_ids=())
            for i, p in enumerate(PROMPTS)]


def engine_kwargs():
    return dict(max_wait_ms=0, max_seq_len=128, max_batch_size=4, block_size=8,
                prefill_chunk_tokens=16, kv_cache_dtype="fp32")


def run(engine) -> dict[str, list[int]]:
    """The first request alone (its blocks get cached), then the rest together."""
    tokens: dict[str, list[int]] = {}
    first, *rest = requests()
    for group in ([first], rest):
        for req in group:
            engine.add_request(req)
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--ckpt", required=True)
    args = parser.parse_args()
    engine = start_parallel_engine(args.ckpt, tp=args.tp, pp=args.pp, **engine_kwargs())
    if engine is None:
        return 0  # a worker rank: served until the leader shut down
    engine.warmup()
    tokens = run(engine)
    stats = engine.stats()
    engine.shutdown()
    print(json.dumps({"tokens": tokens, "prefix_hit_tokens": stats["prefix_hit_tokens"],
                      "kv_bytes_per_token": stats["kv_bytes_per_token"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
