"""The simulator's per-replica step costs (sim/fleet.scaled_timings): from the model's architecture they are
the replica's own roofline (engine/gpu_specs.replica_roofline), which costs attention by its FLOPs, counts
tensor-parallel all-reduces and runs pipeline stages in series; the fallback scaling by weight bytes does
none of that."""

from __future__ import annotations

from dataclasses import replace

from exaserve_hpc.controller.catalogue import ModelSpec
from exaserve_hpc.engine.gpu_specs import GPU_SPECS, LLAMA3_70B, replica_roofline
from exaserve_hpc.engine.timing import GpuTimings, StepSample, timings_for
from exaserve_hpc.sim.fleet import scaled_timings

A100 = GPU_SPECS["a100-80gb"]
SPEC = ModelSpec(name="70b", tensor_parallel=4, pipeline_parallel=1, gpu_memory_utilization=0.9,
                 weight_bytes=140 * 10**9, kv_bytes_per_token=160 * 1024, max_seq_len=8192, priority=0,
                 demand_weight=1.0, replicas=1, min_replicas=1, max_batch_size=64, architecture="llama-3-70b",
                 kv_cache_dtype="fp8")
DECODE = StepSample(prefill_tokens=0, prefill_pairs=0, decode_seqs=64, decode_context_tokens=64 * 2000)
PREFILL = StepSample(prefill_tokens=4096, prefill_pairs=4096 * 4097 // 2, decode_seqs=0, decode_context_tokens=0)


def test_with_an_architecture_the_replica_is_costed_by_its_own_roofline():
    got = scaled_timings(timings_for("a100-80gb"), SPEC, A100)
    assert got == GpuTimings(**replica_roofline(A100, LLAMA3_70B, 4, 1, weights="bf16", kv_cache="fp8"))
    assert got.kv_bytes_per_token == 160 * 1024  # the fp8 K/V the site declares


def test_pipeline_stages_run_in_series_and_tensor_parallelism_pays_its_all_reduces():
    base = timings_for("a100-80gb")
    tp4 = scaled_timings(base, SPEC, A100)
    tp4_pp2 = scaled_timings(base, replace(SPEC, pipeline_parallel=2), A100)
    assert tp4_pp2.seconds(DECODE) >= tp4.seconds(DECODE)  # two stages in series: no faster a step
    fallback = scaled_timings(base, replace(SPEC, pipeline_parallel=2, architecture=None), None)
    assert fallback.seconds(DECODE) < 0.7 * tp4_pp2.seconds(DECODE)  # the old scaling's 8-GPU split
    tp8 = scaled_timings(base, replace(SPEC, tensor_parallel=8), A100)
    assert 0.5 * tp4.seconds(PREFILL) < tp8.seconds(PREFILL) < tp4.seconds(PREFILL)  # all-reduces eat the gain


def test_the_kv_dtype_changes_bytes_read_not_attention_arithmetic():
    fp8 = scaled_timings(timings_for("a100-80gb"), SPEC, A100)
    fp16 = scaled_timings(timings_for("a100-80gb"), replace(SPEC, kv_cache_dtype="fp16"), A100)
    assert fp8.prefill_per_pair_s == fp16.prefill_per_pair_s and fp8.kv_read_per_token_s == fp16.kv_read_per_token_s / 2
