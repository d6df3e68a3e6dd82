"""Reference-engine benchmarks: prefix cache, decode scaling, KV memory, chunked prefill.

Run: .venv/bin/python benchmarks/bench_engine.py [--runs N]
(medians of N runs; decode: the best of N, since a shared machine only adds time)

1. TTFT of a 4,096-token prompt whose first 3,584 tokens are cached vs the
   same prompt cold (target: cached >= 5x faster).
2. Decode tokens/s against batch size 1..64.
3. KV memory per token, fp16 vs fp8 (the tiny model, and a Llama-3-8B shape),
   and what fp8 / fp16 K/V change in greedy output and logits vs fp32.
4. A 3,072-token prompt arriving first among 32 short ones: p50/p99 TTFT of
   the short ones with chunked prefill on vs off.
All on the numpy reference engine and a 2-layer tiny model (CPU).
"""

from __future__ import annotations

import os

# One BLAS thread unless told otherwise: on a shared box, OpenBLAS threads spin
# against other processes and a 2x step time becomes 20x. (Set before numpy loads.)
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from exaserve_hpc.cache.checkpoint import TinyModelSpec, create_tiny_checkpoint, load_checkpoint  # noqa: E402
from exaserve_hpc.engine.base import EngineRequest  # noqa: E402
from exaserve_hpc.engine.kv_cache import PagedKVCache  # noqa: E402
from exaserve_hpc.engine.reference import ReferenceEngine  # noqa: E402

SPEC = TinyModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=172,
                     max_position=4608, shards=1, seed=0)


def make_engine(loaded, **kwargs) -> ReferenceEngine:
    kwargs.setdefault("max_wait_ms", 0)
    kwargs.setdefault("max_seq_len", 4608)
    return ReferenceEngine.from_weights(*loaded, **kwargs)


def prompt(n: int, salt: int) -> list[int]:
    return [256] + list(np.random.default_rng(salt).integers(0, 256, n - 1))


def ttft(engine: ReferenceEngine, req: EngineRequest) -> float:
    """Seconds from add_request to the request's first token."""
    start = time.perf_counter()
    engine.add_request(req)
    while True:
        if any(o.request_id == req.request_id for o in engine.step()):
            elapsed = time.perf_counter() - start
            break
    while engine.has_unfinished():
        engine.step()
    return elapsed


def bench_prefix(loaded, runs: int) -> None:
    cold, warm, hits = [], [], []
    for k in range(runs):
        full = prompt(4096, 100 + k)
        cold.append(ttft(make_engine(loaded, chunked_prefill=False), EngineRequest("c", full, 1)))
        engine = make_engine(loaded, chunked_prefill=False)
        other_tail = full[:3584] + prompt(100, 999)[1:]
        ttft(engine, EngineRequest("seed", other_tail, 1))  # caches the 3,584-token prefix
        before = engine.stats()["prefix_hit_tokens"]
        warm.append(ttft(engine, EngineRequest("w", full, 1)))
        hits.append(engine.stats()["prefix_hit_tokens"] - before)
    c, w = statistics.median(cold), statistics.median(warm)
    print(f"[prefix cache] 4096-token prompt TTFT: cold {c * 1e3:.1f} ms, first 3584 cached "
          f"{w * 1e3:.1f} ms -> {c / w:.1f}x (target >= 5x; prefix-hit tokens {hits[0]})")


def bench_decode(loaded, runs: int, steps: int = 48) -> None:
    print(f"[decode] batch size -> tokens/s (16-token prompts, {steps} decode steps, "
          f"best of {runs})")
    for batch in (1, 2, 4, 8, 16, 32, 64):
        rates = []
        for _ in range(runs):
            engine = make_engine(loaded, max_batch_size=64, prefill_batch_size=64,
                                 decode_batch_size=64, max_seq_len=512)
            for i in range(batch):
                engine.add_request(EngineRequest(f"r{i}", prompt(16, i), steps + 1,
                                                 stop_token_ids=()))
            engine.step()  # prefill
            start, n = time.perf_counter(), 0
            while engine.has_unfinished():
                n += sum(len(o.new_token_ids) for o in engine.step())
            rates.append(n / (time.perf_counter() - start))
        print(f"    {batch:3d} -> {max(rates):9.0f} tokens/s")


def bench_memory(loaded) -> None:
    for name, shape in (("tiny (2 layers, 2 kv heads, hd 16)", (2, 2, 16)),
                        ("Llama-3-8B shape (32 layers, 8 kv heads, hd 128)", (32, 8, 128))):
        per = {d: PagedKVCache(*shape, num_blocks=1, block_size=16, dtype=d).bytes_per_token
               for d in ("fp16", "fp8")}
        print(f"[kv memory] {name}: fp16 {per['fp16']} B/token, fp8 {per['fp8']} B/token "
              f"({per['fp16'] / per['fp8']:.1f}x)")
    pools = {d: make_engine(loaded, kv_cache_dtype=d, max_batch_size=8).kv.nbytes
             for d in ("fp16", "fp8")}
    print(f"[kv memory] tiny pool for 8 x 4608 tokens: fp16 {pools['fp16'] / 2**20:.1f} MiB, "
          f"fp8 {pools['fp8'] / 2**20:.1f} MiB")


def bench_fp8_accuracy(loaded, prompts: int = 16, tokens: int = 32) -> None:
    """Greedy agreement and last-prompt-token logit error between K/V dtypes."""
    dtypes = ("fp32", "fp16", "fp8")
    outs, logits = {}, {d: [] for d in dtypes}
    model = make_engine(loaded, max_seq_len=512, max_batch_size=1).model
    for dtype in dtypes:
        engine = make_engine(loaded, kv_cache_dtype=dtype, max_seq_len=512)
        for i in range(prompts):
            engine.add_request(EngineRequest(f"p{i}", prompt(64 + 8 * i, 300 + i), tokens,
                                             stop_token_ids=()))
        got: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
        outs[dtype] = got
        for i in range(prompts):
            pool = PagedKVCache(model.num_layers, model.kv_heads, model.head_dim, 40, 16, dtype)
            logits[dtype].append(model.prefill(prompt(64 + 8 * i, 300 + i), pool.view(range(40), 0)))
    for test, ref in (("fp16", "fp32"), ("fp8", "fp32"), ("fp8", "fp16")):
        a, b = outs[ref], outs[test]
        same = sum(x == y for k in a for x, y in zip(a[k], b[k]))
        whole = sum(a[k] == b[k] for k in a)
        err = [np.abs(t - r).max() / r.std() for t, r in zip(logits[test], logits[ref])]
        print(f"[kv {test} vs {ref}] greedy tokens identical {same}/{prompts * tokens}, "
              f"sequences {whole}/{prompts}; max |logit diff| / std(logits): median "
              f"{np.median(err):.2e}, max {np.max(err):.2e}")


def bench_chunked(loaded, runs: int) -> None:
    for chunked in (False, True):
        p50s, p99s, longs, totals = [], [], [], []
        for k in range(runs):
            engine = make_engine(loaded, max_batch_size=64, prefill_batch_size=8,
                                 chunked_prefill=chunked, prefill_chunk_tokens=256)
            start = time.perf_counter()
            engine.add_request(EngineRequest("long", prompt(3072, 7 + k), 16, stop_token_ids=()))
            for i in range(32):
                engine.add_request(EngineRequest(f"s{i}", prompt(32, 50 + i), 16,
                                                 stop_token_ids=()))
            first: dict[str, float] = {}
            while engine.has_unfinished():
                for out in engine.step():
                    first.setdefault(out.request_id, time.perf_counter() - start)
            totals.append(time.perf_counter() - start)
            short = np.array([v for r, v in first.items() if r != "long"]) * 1e3
            p50s.append(np.percentile(short, 50))
            p99s.append(np.percentile(short, 99))
            longs.append(first["long"] * 1e3)
        print(f"[chunked prefill {'on ' if chunked else 'off'}] 32 short prompts behind a "
              f"3072-token one: short TTFT p50 {statistics.median(p50s):.0f} ms, "
              f"p99 {statistics.median(p99s):.0f} ms; long TTFT {statistics.median(longs):.0f} ms; "
              f"all done in {statistics.median(totals) * 1e3:.0f} ms")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_checkpoint(create_tiny_checkpoint(Path(tmp) / "tiny", SPEC))
    bench_prefix(loaded, args.runs)
    bench_decode(loaded, args.runs)
    bench_memory(loaded)
    bench_fp8_accuracy(loaded)
    bench_chunked(loaded, args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
