"""The datasheet timing model (engine/gpu_specs.replica_roofline) against published offline throughput of
Llama 8B, 70B and 405B on H100, H200 and A100 (benchmarks/published_figures.py), as
`benchmarks/calibrate_timing.py --published` prints it: within 1.5x of every figure but three, which are
named, and centred on them."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

from calibrate_timing import model_figure, offline_throughput  # noqa: E402
from published_figures import PUBLISHED  # noqa: E402

from exaserve_hpc.engine.timing import GpuTimings  # noqa: E402

# Outside 1.5x, with the evidence: A100 8B 2048/128 runs short of KV cache in the model (it keeps every
# sequence's whole input and output from admission on); release 0.14's H100 FP16 70B TP8 figures lie below
# what the same page's TP4 FP16 rows and release 0.17's A100 FP16 TP8 rows imply for twice the GPUs.
KNOWN_OFF = {("Llama-3-8B", "a100-80gb", "fp16", 1, 2048, 128), ("Llama-3-70B", "h100-sxm", "fp16", 8, 128, 2048),
             ("Llama-3-70B", "h100-sxm", "fp16", 8, 2048, 2048)}


def test_every_model_size_and_gpu_kind_is_covered():
    assert {(r.model, r.gpu) for r in PUBLISHED} >= {("Llama-3-8B", g) for g in ("h100-sxm", "h200", "a100-80gb")} | {
        ("Llama-3-70B", g) for g in ("h100-sxm", "h200", "a100-80gb")} | {
        ("Llama-3.1-405B", g) for g in ("h100-sxm", "h200")}


def test_the_model_is_within_1_5x_of_the_published_figures_but_the_named_three():
    ratios = {r[:6]: model_figure(r)[0] / r.tokens_per_s for r in PUBLISHED}
    off = {key for key, ratio in ratios.items() if not 1 / 1.5 <= ratio <= 1.5}
    assert off == KNOWN_OFF, {k: round(ratios[k], 2) for k in off ^ KNOWN_OFF}
    assert 0.9 <= statistics.median(ratios.values()) <= 1.1


def test_the_steady_state_bounds_take_the_tightest_of_batch_kv_and_token_budget():
    t = GpuTimings(0.001, 1e-5, 1e-5, 0.0)
    assert offline_throughput(t, 100, 100, kv_tokens=1e9, max_batch=64)[1] == "batch"
    assert offline_throughput(t, 100, 100, kv_tokens=2000, max_batch=4096)[1] == "kv cache"
    assert offline_throughput(t, 4000, 10, kv_tokens=1e9, max_batch=4096)[1] == "token budget"
    # decode-only limit: 64 sequences a step, a step of 1 ms + 64 x 10 us + their share of prefill
    tokens, _ = offline_throughput(t, 100, 100, kv_tokens=1e9, max_batch=64)
    assert tokens == 64 / (0.001 + 64 * 1e-5 + 64 * 1e-5)
