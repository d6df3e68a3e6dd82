"""Fit the timing-model engine's constants to the reference engine on this machine.

Run: .venv/bin/python benchmarks/calibrate_timing.py [--layers 2 --hidden 64 ...]

Measures single prefill steps (64..2048 uncached tokens) and decode steps
(batch 1..64 at contexts 16..512), takes the fastest of ``--repeats`` runs of each (other processes on a
shared machine only ever add time), fits ``GpuTimings`` by least squares
(``exaserve_hpc.engine.timing.fit_timings``), prints the constants as a
``GPU_TIMINGS`` entry and the fit's error on the samples. On a GPU machine,
measure the real backend the same way and add its line to GPU_TIMINGS.

    calibrate_timing.py --samples steps.csv --gpu h200

fits measured steps of a real engine instead (CSV columns prefill_tokens,
prefill_pairs, decode_seqs, decode_context_tokens, seconds: one row a step,
e.g. from vLLM's scheduler stats) and prints the fit beside the datasheet
roofline ``GPU_TIMINGS[--gpu]`` (engine/gpu_specs.py), constant by constant,
so a measured machine replaces the roofline with evidence.
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
from exaserve_hpc.engine.reference import ReferenceEngine  # noqa: E402
from exaserve_hpc.engine.timing import GPU_TIMINGS, StepSample, fit_timings  # noqa: E402

FIELDS = ("step_overhead_s", "prefill_per_token_s", "decode_per_seq_s", "kv_read_per_token_s", "prefill_per_pair_s")


def read_samples(path: str) -> list[StepSample]:
    import csv

    with open(path, newline="") as f:
        return [StepSample(int(r["prefill_tokens"]), int(r["prefill_pairs"]), int(r["decode_seqs"]),
                           int(r["decode_context_tokens"]), seconds=float(r["seconds"])) for r in csv.DictReader(f)]


def compare(samples: list[StepSample], gpu: str, kv_bytes: int) -> int:
    if gpu not in GPU_TIMINGS:
        print(f"--gpu {gpu!r} is unknown; choose one of {', '.join(sorted(GPU_TIMINGS))}", file=sys.stderr)
        return 2
    fit, model = fit_timings(samples, kv_bytes), GPU_TIMINGS[gpu]
    for name in FIELDS:
        measured, roof = getattr(fit, name), getattr(model, name)
        print(f"{name:<22} measured {measured:.3g}  roofline {roof:.3g}  ({measured / roof if roof else float('nan'):.2f}x)")
    errors = [abs(model.seconds(s) - s.seconds) / s.seconds for s in samples]
    print(f"roofline against the {len(samples)} measured steps: median relative error {statistics.median(errors):.1%}")
    return 0


def timed_step(engine: ReferenceEngine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def measure(loaded, repeats: int) -> list[StepSample]:
    samples = []
    rng = np.random.default_rng(0)
    for n in (64, 128, 256, 512, 1024, 2048):
        times = []
        for r in range(repeats):
            engine = ReferenceEngine.from_weights(*loaded, max_wait_ms=0, max_seq_len=2100,
                                                  chunked_prefill=False, max_batch_size=1)
            engine.add_request(EngineRequest("p", [int(t) for t in rng.integers(0, 256, n)], 1))
            times.append(timed_step(engine))
        samples.append(StepSample(n, n * (n + 1) // 2, 0, 0, seconds=min(times)))
    for batch in (1, 4, 16, 64):
        for context in (16, 128, 512):
            engine = ReferenceEngine.from_weights(*loaded, max_wait_ms=0, max_seq_len=2100,
                                                  max_batch_size=64, prefill_batch_size=64,
                                                  decode_batch_size=64, chunked_prefill=False)
            for i in range(batch):
                ids = [int(t) for t in rng.integers(0, 256, context)]
                engine.add_request(EngineRequest(f"d{i}", ids, repeats + 2, stop_token_ids=()))
            engine.step()  # prefill
            times = [timed_step(engine) for _ in range(repeats)]
            samples.append(StepSample(0, 0, batch, batch * (context + 1),
                                      seconds=min(times)))
    return samples


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=172)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samples", help="CSV of a real engine's measured steps (see the module docstring)")
    parser.add_argument("--gpu", default="h200", help="the GPU_TIMINGS kind to compare --samples with")
    parser.add_argument("--kv-bytes-per-token", type=int, default=131072)
    args = parser.parse_args()
    if args.samples:
        return compare(read_samples(args.samples), args.gpu, args.kv_bytes_per_token)
    spec = TinyModelSpec(layers=args.layers, hidden=args.hidden, heads=args.heads,
                         kv_heads=args.kv_heads, intermediate=args.intermediate,
                         max_position=2176, shards=1)
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_checkpoint(create_tiny_checkpoint(Path(tmp) / "tiny", spec))
    kv_bytes = ReferenceEngine.from_weights(*loaded, max_seq_len=64, max_batch_size=1) \
        .kv_bytes_per_token
    samples = measure(loaded, args.repeats)
    fit = fit_timings(samples, kv_bytes)
    errors = [abs(fit.seconds(s) - s.seconds) / s.seconds for s in samples]
    print(f'"reference-cpu": GpuTimings({fit.step_overhead_s:.3g}, {fit.prefill_per_token_s:.3g}, '
          f'{fit.decode_per_seq_s:.3g}, {fit.kv_read_per_token_s:.3g}, {fit.prefill_per_pair_s:.3g}, '
          f'kv_bytes_per_token={fit.kv_bytes_per_token}),')
    print(f"fit over {len(samples)} samples: median relative error {statistics.median(errors):.1%}, "
          f"max {max(errors):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
