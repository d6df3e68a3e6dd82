"""Capacity helper: target QPS and request shape -> replicas, with 30% headroom.

Throughput model (a roofline estimate, good to a factor of ~2; pass a measured
rate to `replicas_for_target` once one exists). Assumptions:
- parameters = weight_bytes / bytes_per_param (2: fp16/bf16 weights);
- prefill is compute-bound: 2 x params x input_tokens FLOPs, spread over the
  replica's tp x pp GPUs at `flops_efficiency` of peak;
- decode is memory-bound: every step each GPU streams its weight shard once,
  plus the KV of every sequence in the batch, at `bandwidth_efficiency` of
  peak HBM bandwidth; one step yields one token per sequence in the batch;
- the batch is the model's max_batch_size, or fewer when the KV space left in
  the reservation after weights cannot hold that many (input + output)-token
  sequences;
- pipeline stages are kept busy by micro-batches (throughput scales with
  tp x pp; latency does not, and is not modelled);
- prefill and decode are charged one after the other (continuous batching
  overlaps them, so real throughput is somewhat higher: the estimate errs
  towards more replicas).
Replicas = ceil(target_qps x (1 + headroom) / requests_per_s_per_replica).

`placeable_replicas` is the other side of capacity: how many more replicas the machine has room for, as the
placer would place them; the controller cuts the autoscaler's target to it, and `exaserve plan --capacity`
prints both per model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from exaserve_hpc.topology import Topology
from exaserve_hpc.units import format_size
from exaserve_hpc.controller.catalogue import ModelSpec
from exaserve_hpc.controller.occupancy import Occupancy
from exaserve_hpc.controller.placement import Placer, capacity_problem, shape_problem
from exaserve_hpc.controller.plan import Plan

HEADROOM = 0.30


@dataclass(frozen=True)
class Accelerator:
    peak_flops: float = 312e12  # A100 bf16 dense
    flops_efficiency: float = 0.5
    memory: int = 80 * 2**30
    memory_bandwidth: float = 2.0e12  # bytes/s, A100 80 GB HBM2e
    bandwidth_efficiency: float = 0.7
    bytes_per_param: float = 2.0


A100_80GB = Accelerator()


@dataclass(frozen=True)
class ReplicaThroughput:
    requests_per_s: float
    batch: int  # sequences decoded together
    prefill_s: float  # per request
    decode_step_s: float  # per step of the whole batch
    limited_by: str  # "max_batch_size" or "KV space"


@dataclass(frozen=True)
class CapacityEstimate:
    model: str
    replicas: int
    requests_per_s_per_replica: float
    headroom: float
    reason: str


def replica_throughput(spec: ModelSpec, input_tokens: int, output_tokens: int,
                       accel: Accelerator = A100_80GB) -> ReplicaThroughput:
    if spec.weight_bytes is None:
        raise ValueError(f"model {spec.name} has no weight_bytes, so its throughput cannot be estimated; "
                         f"set weight_bytes in the site config or pass measured_requests_per_s")
    if input_tokens < 0 or output_tokens < 1:
        raise ValueError(f"request shape needs input_tokens >= 0 and output_tokens >= 1, "
                         f"got {input_tokens} and {output_tokens}")
    gpus = spec.devices_per_replica
    params = spec.weight_bytes / accel.bytes_per_param
    prefill_s = 2 * params * input_tokens / (accel.peak_flops * accel.flops_efficiency * gpus)
    kv_per_seq = (spec.kv_bytes_per_token or 0) * (input_tokens + output_tokens)
    kv_space = int(spec.gpu_memory_utilization * accel.memory) * gpus - spec.weight_bytes
    batch, limited_by = spec.max_batch_size, "max_batch_size"
    if kv_per_seq and kv_space // kv_per_seq < batch:
        batch, limited_by = int(kv_space // kv_per_seq), "KV space"
    if batch < 1:
        raise ValueError(f"model {spec.name}: one {input_tokens + output_tokens}-token sequence needs "
                         f"{format_size(kv_per_seq)} of KV but only {format_size(max(kv_space, 0))} is left "
                         f"after weights; raise gpu_memory_utilization or parallelism")
    bandwidth = accel.memory_bandwidth * accel.bandwidth_efficiency
    mean_context = input_tokens + output_tokens / 2
    step_s = (spec.weight_bytes / gpus + batch * mean_context * (spec.kv_bytes_per_token or 0) / gpus) / bandwidth
    per_request_s = prefill_s + output_tokens * step_s / batch
    return ReplicaThroughput(1 / per_request_s, batch, prefill_s, step_s, limited_by)


def replicas_for_target(spec: ModelSpec, target_qps: float, input_tokens: int, output_tokens: int,
                        accel: Accelerator = A100_80GB, headroom: float = HEADROOM,
                        measured_requests_per_s: float | None = None) -> CapacityEstimate:
    """Replicas that serve `target_qps` requests of this shape with `headroom` to spare."""
    if target_qps < 0 or headroom < 0:
        raise ValueError(f"target_qps ({target_qps}) and headroom ({headroom}) must be >= 0")
    if measured_requests_per_s is not None:
        if measured_requests_per_s <= 0:
            raise ValueError(f"measured_requests_per_s must be > 0, got {measured_requests_per_s}")
        rps, basis = measured_requests_per_s, "measured"
    else:
        t = replica_throughput(spec, input_tokens, output_tokens, accel)
        rps, basis = t.requests_per_s, f"roofline, batch {t.batch} ({t.limited_by})"
    replicas = math.ceil(target_qps * (1 + headroom) / rps - 1e-9)
    replicas = max(replicas, spec.min_replicas, 1 if target_qps > 0 else 0)
    return CapacityEstimate(spec.name, replicas, rps, headroom,
                            f"{target_qps:g} req/s x {1 + headroom:.2f} headroom / {rps:.2f} req/s per replica "
                            f"({basis}); floor min_replicas {spec.min_replicas}")


def placeable_replicas(plan: Plan, topology: Topology, spec: ModelSpec, max_replicas_per_node: int, limit: int,
                       down: Iterable[str] = ()) -> tuple[int, str]:
    """How many more replicas of `spec` fit beside `plan` (at most `limit`), placed as the placer would,
    and why no more fit ("" when `limit` fit). The bound the autoscaler's target is cut to: a target past
    it would only add replicas that wait for room."""
    problem = shape_problem(spec, topology)
    if problem is not None or limit <= 0:
        return 0, problem or ""
    occ = Occupancy.from_plan(topology, plan, max_replicas_per_node, down)
    placer = Placer(occ)
    for k in range(limit):
        if placer.place(spec, f"{spec.name}/probe{k}") is None:
            return k, capacity_problem(spec, occ)
    return limit, ""


@dataclass(frozen=True)
class RequestMix:
    """One model's demand: peak requests/s and mean request shape (a workload's, or given by hand)."""
    model: str
    qps: float
    input_tokens: float
    output_tokens: float


def replicas_for_mix(specs: dict[str, ModelSpec], mixes: Iterable[RequestMix], replicas_per_device: dict[str, int],
                     accel: Accelerator = A100_80GB, headroom: float = HEADROOM) -> list[CapacityEstimate]:
    """Replicas per model for each mix, with `headroom`. A replica sharing its GPUs with others
    (`replicas_per_device[model]` > 1: gpu_memory_utilization below 1) gets that share of their compute and
    bandwidth, so its throughput is the roofline's divided by the sharing."""
    out = []
    for mix in mixes:
        if mix.model not in specs:
            raise ValueError(f"request mix for {mix.model!r}, which the site does not serve; its models: "
                             f"{', '.join(sorted(specs))}")
        spec = specs[mix.model]
        t = replica_throughput(spec, max(0, round(mix.input_tokens)), max(1, round(mix.output_tokens)), accel)
        share = max(1, replicas_per_device.get(mix.model, 1))
        est = replicas_for_target(spec, mix.qps, round(mix.input_tokens), max(1, round(mix.output_tokens)), accel,
                                  headroom, measured_requests_per_s=t.requests_per_s / share)
        out.append(CapacityEstimate(est.model, est.replicas, est.requests_per_s_per_replica, headroom,
                                    f"{mix.qps:g} req/s x {1 + headroom:.2f} / {est.requests_per_s_per_replica:.2f} "
                                    f"req/s per replica (roofline, batch {t.batch} ({t.limited_by}), "
                                    f"{mix.input_tokens:.0f} in / {mix.output_tokens:.0f} out tokens, GPU shared by "
                                    f"{share}); floor min_replicas {spec.min_replicas}"))
    return out
