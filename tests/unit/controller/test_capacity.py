"""Capacity helper: QPS and request shape -> replicas with 30% headroom."""

from __future__ import annotations

import math

import pytest

from exaserve_hpc.controller.capacity import replica_throughput, replicas_for_target
from exaserve_hpc.controller.catalogue import ModelSpec


def spec(**kw):
    base = dict(name="m", tensor_parallel=1, pipeline_parallel=1, gpu_memory_utilization=0.9,
                weight_bytes=16 * 10**9, kv_bytes_per_token=128 * 1024, max_seq_len=8192, priority=0,
                demand_weight=1.0, replicas=1, min_replicas=1, max_batch_size=64)
    return ModelSpec(**{**base, **kw})


def test_measured_rate_gives_exact_headroom_arithmetic():
    est = replicas_for_target(spec(), 100, 1000, 200, measured_requests_per_s=10)
    assert est.replicas == 13  # 100 x 1.3 / 10
    assert replicas_for_target(spec(), 101, 1000, 200, measured_requests_per_s=10).replicas == 14


def test_more_traffic_or_longer_requests_need_more_replicas():
    s = spec()
    base = replicas_for_target(s, 50, 1000, 200).replicas
    assert replicas_for_target(s, 100, 1000, 200).replicas > base
    assert replicas_for_target(s, 50, 8000, 200).replicas > base
    assert replicas_for_target(s, 50, 1000, 1000).replicas > base


def test_tensor_parallel_raises_per_replica_throughput():
    assert (replica_throughput(spec(tensor_parallel=4), 1000, 200).requests_per_s
            > replica_throughput(spec(), 1000, 200).requests_per_s)


def test_kv_space_limits_the_batch():
    t = replica_throughput(spec(kv_bytes_per_token=4 * 2**20), 4000, 1000)
    assert t.limited_by == "KV space" and t.batch < 64


def test_floor_and_errors():
    assert replicas_for_target(spec(min_replicas=3), 0.1, 10, 10).replicas == 3
    with pytest.raises(ValueError, match="weight_bytes"):
        replicas_for_target(spec(weight_bytes=None), 10, 10, 10)
    with pytest.raises(ValueError, match="output_tokens >= 1"):
        replica_throughput(spec(), 10, 0)


def test_roofline_figure_is_plausible_for_an_8b_model():
    t = replica_throughput(spec(), 1000, 200)
    # ~0.1 s prefill for 1000 tokens of an 8B model on half an A100's peak; decode step ~12 ms
    assert 0.05 < t.prefill_s < 0.3 and 0.005 < t.decode_step_s < 0.05
    assert math.isfinite(t.requests_per_s) and 1 < t.requests_per_s < 100
