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

    calibrate_timing.py --published [--max-ratio 1.5]

puts the datasheet model (engine/gpu_specs.replica_roofline: GEMMs at the FP8 or FP16 peak, attention from
its FLOPs, HBM reads in the weights' and KV cache's dtypes, tensor-parallel all-reduces over NVLink)
against published offline throughput of Llama 8B, 70B and 405B on H100, H200 and A100
(benchmarks/published_figures.py: TensorRT-LLM's perf-overview tables, sources there): the model's
steady-state throughput for the same input/output lengths, tensor parallelism and precision, its ratio to
the published figure, and the spread; exit 1 when a row is off by more than --max-ratio either way.
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
from exaserve_hpc.engine.gpu_specs import GPU_SPECS, MODEL_SHAPES, replica_roofline  # noqa: E402
from exaserve_hpc.engine.timing import GPU_TIMINGS, GpuTimings, StepSample, fit_timings  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from published_figures import PUBLISHED, Published  # noqa: E402

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


# The offline benchmark's engine settings, as trtllm-bench uses them (perf-overview.md): a step takes at most
# 8,192 tokens (max_num_tokens), the KV cache gets 90% of what the weights leave, and a sequence keeps the
# KV of its whole input and output from admission on (the guaranteed-no-evict scheduler).
STEP_TOKEN_BUDGET = 8192
KV_SHARE_OF_FREE = 0.90
MAX_BATCH = 2048  # max_batch_size (trtllm-bench's heuristics pick 2,048-4,096 for these runs)


def offline_throughput(t: GpuTimings, isl: int, osl: int, kv_tokens: float, max_batch: int = MAX_BATCH,
                       budget: int = STEP_TOKEN_BUDGET) -> tuple[float, str]:
    """Output tokens/s of an engine with timings `t` given every request at once (steady state): r requests
    start and finish a step, r x osl sequences decode (Little's law) and r x isl prompt tokens prefill in
    it, r bounded by the batch, the KV cache and the step's token budget. Returns (tokens/s, the bound)."""
    bounds = {"batch": max_batch / osl, "kv cache": kv_tokens / (isl + osl) / osl, "token budget": budget / (isl + osl)}
    bound = min(bounds, key=bounds.get)
    r = bounds[bound]
    decoding, prefill = r * osl, r * isl
    step = (t.step_overhead_s + decoding * t.decode_per_seq_s + decoding * (isl + osl / 2) * t.kv_read_per_token_s
            + prefill * t.prefill_per_token_s + r * isl * (isl + 1) / 2 * t.prefill_per_pair_s)
    return decoding / step, bound


def model_figure(row: Published) -> tuple[float, str]:
    gpu, shape = GPU_SPECS[row.gpu], MODEL_SHAPES[row.model]
    weights = "fp8" if row.precision == "fp8" else "bf16"
    timings = GpuTimings(**replica_roofline(gpu, shape, tp=row.tp, weights=weights, kv_cache=weights))
    weight_bytes = shape.params * (1 if weights == "fp8" else 2)
    free = row.tp * gpu.memory_gb * (1 << 30) - weight_bytes
    return offline_throughput(timings, row.isl, row.osl, KV_SHARE_OF_FREE * free / timings.kv_bytes_per_token)


def check_published(max_ratio: float) -> int:
    print(f"{'model':<15} {'gpu':<10} {'prec':<5} {'tp':>2} {'isl/osl':>10} {'published':>10} {'model':>10} "
          f"{'model/pub':>9}  bound")
    ratios, worst = [], None
    for row in PUBLISHED:
        figure, bound = model_figure(row)
        ratio = figure / row.tokens_per_s
        ratios.append(ratio)
        if worst is None or abs(np.log(ratio)) > abs(np.log(worst[0])):
            worst = (ratio, row)
        flag = "" if 1 / max_ratio <= ratio <= max_ratio else "  <-- off"
        print(f"{row.model:<15} {row.gpu:<10} {row.precision:<5} {row.tp:>2} {f'{row.isl}/{row.osl}':>10} "
              f"{row.tokens_per_s:>10.0f} {figure:>10.0f} {ratio:>9.2f}  {bound}{flag}")
    off = [r for r in ratios if not 1 / max_ratio <= r <= max_ratio]
    print(f"{len(ratios)} published figures ({', '.join(sorted({r.source for r in PUBLISHED}))}): model/published "
          f"median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}; "
          f"{len(ratios) - len(off)} within {max_ratio:g}x; worst {worst[0]:.2f} ({worst[1].model} {worst[1].gpu} "
          f"{worst[1].precision} tp{worst[1].tp} {worst[1].isl}/{worst[1].osl})")
    return 1 if off else 0


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
    parser.add_argument("--published", action="store_true",
                        help="the datasheet model against published throughput (benchmarks/published_figures.py)")
    parser.add_argument("--max-ratio", type=float, default=1.5)
    args = parser.parse_args()
    if args.published:
        return check_published(args.max_ratio)
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
