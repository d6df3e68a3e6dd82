"""Timing-model engine: the step protocol with time instead of arithmetic.

Routers and simulators need thousands of replicas that cost nothing but
behave like engines. This one shares the reference engine's scheduler and
block manager (same admission, chunked prefill, preemption, prefix cache,
KV events, stats), but a step computes no logits: it takes

    step_s = step_overhead_s
           + prefill_per_token_s  * uncached prompt tokens computed this step
           + prefill_per_pair_s   * (query, key) pairs of those tokens' attention
           + decode_per_seq_s     * sequences decoding this step
           + kv_read_per_token_s  * K/V tokens the decoding sequences attend to

and the tokens it emits are a fixed filler (requests end at max_tokens).
Constants per GPU kind are in ``GPU_TIMINGS`` (keys match the site
config's ``cluster.gpu_kind``, e.g. ``a100-80gb``): Llama-3-8B rooflines
from the vendors' datasheets, sources and checks in ``engine/gpu_specs.py``;
pass ``timings=`` for your own (``benchmarks/calibrate_timing.py`` fits them
to a real engine).

Steps are scheduled as vLLM does with chunked prefill: at most
``max_num_batched_tokens`` tokens a step (default 8192, vLLM's for a large
GPU; None for no budget), decodes first, then prefill chunks in arrival
order from what is left (``engine/batching.py``).

Virtual time: the clock is injectable. ``step()`` starts a batch and returns
[]; a later ``step()`` at or after ``next_event_time()`` completes it
(tokens, first-token times stamped at the batch's end) and starts the next.
A simulator advances its clock to the smallest ``next_event_time()`` of its
engines; under ``time.monotonic`` the same engine paces itself in real time
inside the replica loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np

from exaserve_hpc.engine.base import StepOutput
from exaserve_hpc.engine.continuous import ContinuousBatchingEngine
from exaserve_hpc.engine.gpu_specs import GPU_SPECS, roofline
from exaserve_hpc.engine.batching import ScheduledBatch, Sequence
from exaserve_hpc.engine.tokenizer import VOCAB_SIZE

FILLER = b"exaserve timing model output. "


@dataclass(frozen=True)
class StepSample:
    """The work of one step (and, measured on a real engine, its seconds)."""

    prefill_tokens: int
    prefill_pairs: int           # causal (query, key) pairs of the prefill chunks
    decode_seqs: int
    decode_context_tokens: int   # sum over decoding sequences of the K/V tokens attended
    seconds: float = 0.0


def step_sample(batch: ScheduledBatch) -> StepSample:
    """The work of a scheduled batch (before it ran: num_computed_tokens is
    where each chunk starts)."""
    pairs = sum(n * s.num_computed_tokens + n * (n + 1) // 2 for s, n in batch.prefills)
    context = sum(s.num_computed_tokens + 1 for s in batch.decodes)
    return StepSample(batch.prefill_tokens, pairs, len(batch.decodes), context)


@dataclass(frozen=True)
class GpuTimings:
    """Seconds per unit of work for one model on one GPU kind."""

    step_overhead_s: float       # fixed per step (weights read once per step, launch)
    prefill_per_token_s: float   # per uncached prompt token (compute bound)
    decode_per_seq_s: float      # per decoding sequence
    kv_read_per_token_s: float   # per cached K/V token a decode attends to (bandwidth)
    prefill_per_pair_s: float = 0.0   # per causal (query, key) pair in prefill attention
    kv_bytes_per_token: int = 131072  # fp16 K+V of one token, all layers

    def step_seconds(self, batch: ScheduledBatch) -> float:
        return self.seconds(step_sample(batch))

    def seconds(self, work: StepSample) -> float:
        return (self.step_overhead_s + self.prefill_per_token_s * work.prefill_tokens
                + self.prefill_per_pair_s * work.prefill_pairs
                + self.decode_per_seq_s * work.decode_seqs
                + self.kv_read_per_token_s * work.decode_context_tokens)


# Llama-3-8B in bf16 on one GPU of each kind: a roofline from the datasheets with stated
# efficiencies (engine/gpu_specs.py names the sources and checks it against published figures),
# to be replaced by `benchmarks/calibrate_timing.py`'s fit where a machine has been measured.
# "reference-cpu": fitted by benchmarks/calibrate_timing.py to the numpy
# reference engine with the default 2-layer tiny model on a shared 2-core box,
# one BLAS thread (median error 4.5% over 18 measured steps).
GPU_TIMINGS: dict[str, GpuTimings] = {
    **{kind: GpuTimings(**roofline(spec)) for kind, spec in GPU_SPECS.items()},
    "reference-cpu": GpuTimings(1.65e-4, 3.9e-6, 1.5e-5, 2.4e-7, prefill_per_pair_s=4.0e-8,
                                kv_bytes_per_token=256),
}
# vLLM's default per-step token budget for its OpenAI server on a GPU of >= 70 GiB (V1 engine,
# chunked prefill on); the timing engine uses it unless told otherwise.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


def fit_timings(samples: list[StepSample], kv_bytes_per_token: int) -> GpuTimings:
    """Least-squares fit of the five constants to measured steps, in
    relative error (a 1 ms step counts as much as a 1 s one); a constant the
    data drive negative is clamped to 0 and the rest refitted."""

    y = np.array([s.seconds for s in samples])
    x = np.array([[1.0, s.prefill_tokens, s.decode_seqs, s.decode_context_tokens,
                   s.prefill_pairs] for s in samples]) / y[:, None]
    y = np.ones_like(y)
    keep = list(range(5))
    while True:
        coef = np.zeros(5)
        coef[keep] = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        negative = [i for i in keep if coef[i] < 0]
        if not negative:
            break
        keep.remove(negative[0])
    overhead, per_token, per_seq, kv_read, per_pair = (float(c) for c in coef)
    return GpuTimings(overhead, per_token, per_seq, kv_read, per_pair,
                      kv_bytes_per_token=kv_bytes_per_token)


def timings_for(gpu_kind: str) -> GpuTimings:
    try:
        return GPU_TIMINGS[gpu_kind]
    except KeyError:
        raise ValueError(f"no timing constants for GPU kind {gpu_kind!r}; known kinds: "
                         f"{', '.join(sorted(GPU_TIMINGS))}; or pass timings=GpuTimings(...)") from None


class TimingEngine(ContinuousBatchingEngine):
    """Engine protocol over a cost model; see the module docstring.

    ``model_dir`` is accepted for symmetry with ``ReferenceEngine`` and not
    read. Other keyword arguments are ``ContinuousBatchingEngine._setup``'s.
    """

    def __init__(self, model_dir: str | os.PathLike | None = None, *, gpu_kind: str = "h100-sxm",
                 timings: GpuTimings | None = None, kv_cache_dtype: str = "fp16",
                 vocab_size: int = VOCAB_SIZE,
                 max_num_batched_tokens: int | None = DEFAULT_MAX_NUM_BATCHED_TOKENS, **kwargs) -> None:
        if kv_cache_dtype not in ("fp16", "fp8"):
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported; choose fp16 or fp8")
        self.gpu_kind = gpu_kind if timings is None else "custom"
        timings = timings or timings_for(gpu_kind)
        if kv_cache_dtype == "fp8":  # half the bytes to store and to read
            timings = replace(timings, kv_read_per_token_s=timings.kv_read_per_token_s / 2,
                              kv_bytes_per_token=timings.kv_bytes_per_token // 2)
        self.timings = timings
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_bytes_per_token = timings.kv_bytes_per_token
        self._setup(vocab_size=vocab_size, **kwargs)
        if max_num_batched_tokens is not None:  # at least one decode per running sequence fits
            max_num_batched_tokens = max(max_num_batched_tokens, self.max_batch_size)
        self.scheduler.config = replace(self.scheduler.config, max_num_batched_tokens=max_num_batched_tokens)
        self._inflight: ScheduledBatch | None = None
        self._ready_at = 0.0
        self.busy_seconds = 0.0

    def next_event_time(self) -> float | None:
        """When ``step()`` next has something to do: the running batch's end,
        the batching window's end, or now (None when idle)."""
        if self._inflight is not None:
            return self._ready_at
        waiting = self.scheduler.waiting
        if self._aborts or self.scheduler.running:
            return self._clock()
        if waiting:
            return max(self._clock(), waiting[0].arrived + self.scheduler.config.max_wait_ms / 1e3)
        return None

    def step(self) -> list[StepOutput]:
        """Complete the batch in flight if its time has come, then start the next."""
        self._check_open()
        outputs = self._take_aborts()
        now = self._clock()
        if self._inflight is not None:
            if now < self._ready_at:
                return outputs
            batch, self._inflight = self._inflight, None
            outputs += self._complete(batch, self._filler(batch), self._ready_at)
            now = max(now, self._ready_at)
        batch = self.scheduler.schedule(now)
        if batch:
            seconds = self.timings.step_seconds(batch)
            self.busy_seconds += seconds
            self._inflight, self._ready_at = batch, now + seconds
        self._publish_events()
        return outputs

    def _filler(self, batch: ScheduledBatch) -> dict[Sequence, int]:
        return {seq: FILLER[seq.generated % len(FILLER)] for seq, n in batch.chunks()
                if not seq.done and seq.num_pending == n}

    def warmup(self) -> None:
        """Nothing to load; checks the engine is open and the constants sane."""
        self._check_open()
        t = self.timings
        if min(t.step_overhead_s, t.prefill_per_token_s, t.decode_per_seq_s,
               t.kv_read_per_token_s, t.prefill_per_pair_s) < 0:
            raise ValueError(f"timing constants must be >= 0, got {t}")

    def stats(self) -> dict:
        return {**super().stats(), "gpu_kind": self.gpu_kind, "busy_seconds": self.busy_seconds}
