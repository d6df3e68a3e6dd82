"""The NVML seam: GPU inventory and telemetry through nvidia-ml-py, or a clean "no GPU".

Every NVML failure (library missing, no driver, no device) becomes an empty
list plus a reason string; nothing above this module imports pynvml.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from exaserve_hpc.protocol import GpuInfo

log = logging.getLogger(__name__)

T = TypeVar("T")

try:  # NVML itself may be missing at run time (no driver); that is a reason, not an error (see _each_gpu)
    import pynvml
except ImportError:
    pynvml = None


def _each_gpu(describe: Callable[[Any, int, Any], T]) -> tuple[list[T], str]:
    """describe(pynvml, index, handle) for every GPU NVML sees: (the results, reason when there are none).
    The one place that initialises and shuts down NVML and turns its failures into a reason."""
    if pynvml is None:
        return [], "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
        return [], f"no GPU: NVML unavailable ({exc})"
    try:
        found = [describe(pynvml, index, pynvml.nvmlDeviceGetHandleByIndex(index))
                 for index in range(pynvml.nvmlDeviceGetCount())]
        return found, "" if found else "no GPU: NVML reports 0 devices"
    except Exception as exc:
        log.warning("NVML query failed: %s", exc)
        return [], f"NVML query failed ({exc})"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def read_gpus() -> tuple[list[GpuInfo], str]:
    """(GPUs with memory/utilisation/temperature/power, reason when there are none)."""
    def describe(pynvml, index: int, handle) -> GpuInfo:
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        return GpuInfo(
            index=index, name=_text(pynvml.nvmlDeviceGetName(handle)),
            memory_total=int(memory.total), memory_used=int(memory.used),
            utilization=float(_optional(lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu, 0)),
            temperature=float(_optional(lambda: pynvml.nvmlDeviceGetTemperature(handle, 0), 0)),
            power_watts=float(_optional(lambda: pynvml.nvmlDeviceGetPowerUsage(handle), 0)) / 1000.0)
    return _each_gpu(describe)


@dataclass(frozen=True)
class NvmlDevice:
    """One GPU as NVML names it, for binding replicas (gpu_binding.py): identity, free memory, nearby CPUs."""
    index: int  # NVML's enumeration (PCI bus order)
    uuid: str
    minor: int = -1  # /dev/nvidiaN; -1: unknown
    memory_free: int = 0
    cpus: frozenset[int] = frozenset()  # CPUs NVML calls near this GPU; empty: not reported


def read_devices() -> tuple[list[NvmlDevice], str]:
    """(every GPU NVML sees, reason when there are none); same failure rules as read_gpus."""
    words = -(-(os.cpu_count() or 1) // 64)  # the CPU mask comes as 64-bit words

    def describe(pynvml, index: int, handle) -> NvmlDevice:
        mask = _optional(lambda: list(pynvml.nvmlDeviceGetCpuAffinity(handle, words)), [])
        return NvmlDevice(
            index=index, uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
            minor=int(_optional(lambda: pynvml.nvmlDeviceGetMinorNumber(handle), -1)),
            memory_free=int(pynvml.nvmlDeviceGetMemoryInfo(handle).free),
            cpus=frozenset(w * 64 + b for w, word in enumerate(mask) for b in range(64) if int(word) >> b & 1))
    return _each_gpu(describe)


def _optional(read, default):
    try:
        return read()
    except Exception:  # a counter this GPU does not support
        return default


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def host_memory() -> tuple[int, int]:
    """(total, used) bytes of host memory, from /proc/meminfo."""
    fields = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                fields[key] = int(value.split()[0]) * 1024
    except OSError:
        return 0, 0
    total = fields.get("MemTotal", 0)
    return total, total - fields.get("MemAvailable", total)
