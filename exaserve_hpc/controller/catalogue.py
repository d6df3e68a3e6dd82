"""The model catalogue as placement needs it: one frozen ModelSpec per model.

Memory model (per device a replica stage occupies):
- GPU: the engine claims ``gpu_memory_utilization`` of each of its GPUs up
  front (vLLM/TensorRT-LLM style), so the *reservation* is that fraction of
  the GPU's memory. The replica *needs* its share of the weights plus the KV
  of one full ``max_seq_len`` sequence, both split over tp x pp devices; the
  need must fit inside the reservation, and reservations on a device must sum
  to at most its memory (fractions sum to at most 1).
- CPU (host device): ``gpu_memory_utilization`` means nothing there, so the
  reservation is the need itself, with a floor of CPU_RESERVATION_FLOOR for
  the process and its buffers. A model with no ``weight_bytes`` is sized from
  its ``tiny`` architecture (float32), else given the floor.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional

from exaserve_hpc.config.schema import ModelConfig, SiteConfig, TinyModelConfig
from exaserve_hpc.topology import Device
from exaserve_hpc.units import format_size

CPU_RESERVATION_FLOOR = 256 * 2**20
TINY_VOCAB = 259  # the byte tokenizer's vocabulary (engine/tokenizer.py)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    tensor_parallel: int
    pipeline_parallel: int
    gpu_memory_utilization: float
    weight_bytes: Optional[int]  # whole model; None: unknown
    kv_bytes_per_token: Optional[int]
    max_seq_len: int
    priority: int  # configured importance 0..100
    demand_weight: float
    replicas: int  # wanted at start
    min_replicas: int
    max_batch_size: int
    architecture: Optional[str] = None  # engine/gpu_specs.ARCHITECTURES key: how its steps are costed
    kv_cache_dtype: str = "fp16"

    @property
    def devices_per_replica(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    @cached_property
    def need_per_device(self) -> int:
        """Weights plus one full-length sequence of KV, split over tp x pp devices; 0 when unknown."""
        whole = (self.weight_bytes or 0) + (self.kv_bytes_per_token or 0) * self.max_seq_len
        return -(-whole // self.devices_per_replica)

    def reservation(self, device: Device) -> int:
        """Bytes this model claims on one device it occupies."""
        if device.kind == "cpu":
            return max(self.need_per_device, CPU_RESERVATION_FLOOR)
        return int(self.gpu_memory_utilization * device.memory)

    def fits_device(self, device: Device) -> bool:
        return self.need_per_device <= self.reservation(device) <= device.memory

    def why_not_fits(self, device: Device) -> str:
        need, claim = self.need_per_device, self.reservation(device)
        if claim > device.memory:
            return (f"needs {format_size(claim)} per {device.kind} but a device has {format_size(device.memory)}; "
                    f"give the nodes more memory or raise pipeline_parallel")
        return (f"needs {format_size(need)} per GPU (weights + one {self.max_seq_len}-token sequence of KV over "
                f"tp x pp = {self.devices_per_replica}) but gpu_memory_utilization {self.gpu_memory_utilization} "
                f"of {format_size(device.memory)} reserves {format_size(claim)}; raise gpu_memory_utilization, "
                f"tensor_parallel or pipeline_parallel")

    @property
    def footprint(self) -> float:
        """Sort key for placement order: biggest first, so large shapes find whole domains free."""
        return self.devices_per_replica * self.gpu_memory_utilization


def tiny_weight_bytes(tiny: TinyModelConfig) -> int:
    """float32 bytes of a reference-engine tiny model (embeddings, attention, MLP, head)."""
    h, heads, kv, inter = tiny.hidden, tiny.heads, tiny.kv_heads, tiny.intermediate
    per_layer = 2 * h * h + 2 * h * (h * kv // heads) + 3 * h * inter + 2 * h
    return 4 * (2 * TINY_VOCAB * h + tiny.layers * per_layer + h)


def tiny_kv_bytes_per_token(tiny: TinyModelConfig) -> int:
    return 4 * 2 * tiny.layers * (tiny.hidden * tiny.kv_heads // tiny.heads)


def spec_from_config(site: SiteConfig, model: ModelConfig) -> ModelSpec:
    weight, kv = model.weight_bytes, model.kv_bytes_per_token
    if model.tiny is not None:
        weight = weight if weight is not None else tiny_weight_bytes(model.tiny)
        kv = kv if kv is not None else tiny_kv_bytes_per_token(model.tiny)
    return ModelSpec(
        name=model.model_name,
        tensor_parallel=model.tensor_parallel,
        pipeline_parallel=model.pipeline_parallel,
        gpu_memory_utilization=model.gpu_memory_utilization,
        weight_bytes=weight,
        kv_bytes_per_token=kv,
        max_seq_len=model.max_seq_len,
        priority=model.priority,
        demand_weight=model.demand_weight,
        replicas=site.initial_replicas(model),
        min_replicas=site.min_replicas(model),
        max_batch_size=site.max_batch_size(model),
        architecture=model.architecture,
        kv_cache_dtype=model.kv_cache_dtype,
    )


def catalogue_from_site(site: SiteConfig) -> dict[str, ModelSpec]:
    """name -> ModelSpec, in config order."""
    return {m.model_name: spec_from_config(site, m) for m in site.models}


def placement_order(catalogue: dict[str, ModelSpec]) -> list[ModelSpec]:
    """Biggest footprint first, then higher priority, then name (deterministic)."""
    return sorted(catalogue.values(), key=lambda s: (-s.footprint, -s.priority, s.name))
