"""The NVML seam: GPU inventory and telemetry through nvidia-ml-py, or a clean "no GPU".

Every NVML failure (library missing, no driver, no device) becomes an empty
list plus a reason string; nothing above this module imports pynvml.
"""

from __future__ import annotations

import logging

from ..protocol import GpuInfo

log = logging.getLogger(__name__)


def read_gpus() -> tuple[list[GpuInfo], str]:
    """(GPUs with memory/utilisation/temperature/power, reason when there are none)."""
    try:
        import pynvml
    except ImportError:
        return [], "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded, ...
        return [], f"no GPU: NVML unavailable ({exc})"
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(GpuInfo(
                index=index, name=_text(pynvml.nvmlDeviceGetName(handle)),
                memory_total=int(memory.total), memory_used=int(memory.used),
                utilization=float(_optional(lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu, 0)),
                temperature=float(_optional(lambda: pynvml.nvmlDeviceGetTemperature(handle, 0), 0)),
                power_watts=float(_optional(lambda: pynvml.nvmlDeviceGetPowerUsage(handle), 0)) / 1000.0))
        return gpus, "" if gpus else "no GPU: NVML reports 0 devices"
    except Exception as exc:
        log.warning("NVML query failed: %s", exc)
        return [], f"NVML query failed ({exc})"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


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
