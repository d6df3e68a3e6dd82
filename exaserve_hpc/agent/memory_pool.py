"""The node's memory pool: device memory (host memory on CPU nodes) in fixed-size blocks.

A replica reserves before it loads anything and releases when its process
is gone, whatever the cause. Accounting is by block count per device, so
freed blocks are reusable by the next reservation at once and there is no
fragmentation to manage: a reservation needs ``ceil(bytes / block_size)``
free blocks on each of its devices, not a contiguous run.

Call protocol (pure, no clock, no I/O; the agent is the only caller):
- ``can_reserve(nbytes, devices)`` -> bool
- ``reserve(replica_id, nbytes, devices, indices=None)`` -> Reservation, or
  ReservationError at once with the numbers (asked, free, largest reservable);
  ``indices``: exactly these devices (the controller's plan), else the ones
  with most free blocks
- ``release(replica_id)`` -> bytes freed (0 if it held nothing: idempotent)
- ``status()`` -> MemoryPoolStatus for the heartbeat

Device i is the node's i-th granted GPU (gpu_binding.py), or the host on a
CPU node; ``device_ids`` says what each is called (CUDA_VISIBLE_DEVICES entries)
and travels in the status, so status can show a replica's devices.

Invariant: for every device, reserved blocks + free blocks == total blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from exaserve_hpc.protocol import MemoryPoolStatus
from exaserve_hpc.units import format_size

DEFAULT_BLOCK_SIZE = 64 << 20


class ReservationError(Exception):
    """A reservation that cannot be met now; carries the numbers for the controller."""

    def __init__(self, replica_id: str, asked: int, devices: int, free: int, largest: int, block_size: int,
                 why: str = ""):
        self.replica_id, self.asked, self.devices = replica_id, asked, devices
        self.free, self.largest, self.block_size = free, largest, block_size
        what = why or (f"replica {replica_id} asks {format_size(asked)} on {devices} device(s); "
                       f"free: {format_size(free)} in all; largest reservable: {format_size(largest)} "
                       f"per device on {devices} device(s) (blocks of {format_size(block_size)}). "
                       "Stop or move a replica on this node, or place this one on another node")
        super().__init__(what)


@dataclass(frozen=True)
class Reservation:
    replica_id: str
    devices: tuple[int, ...]
    blocks_per_device: int
    block_size: int

    @property
    def bytes_per_device(self) -> int:
        return self.blocks_per_device * self.block_size

    @property
    def nbytes(self) -> int:
        return self.bytes_per_device * len(self.devices)


class MemoryPool:
    def __init__(self, device_bytes: list[int], block_size: int = DEFAULT_BLOCK_SIZE,
                 device_ids: Optional[list[str]] = None):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 byte, got {block_size}")
        if not device_bytes or any(b < 0 for b in device_bytes):
            raise ValueError(f"device_bytes must list one size >= 0 per device, got {device_bytes}")
        if device_ids is not None and len(device_ids) != len(device_bytes):
            raise ValueError(f"device_ids {device_ids} must name each of the {len(device_bytes)} device(s)")
        self.block_size = block_size
        self.device_ids = list(device_ids or [])  # [] on a CPU node: the host is no GPU
        self.total_blocks = [b // block_size for b in device_bytes]
        self.free_blocks = list(self.total_blocks)
        self.reservations: dict[str, Reservation] = {}

    @property
    def device_count(self) -> int:
        return len(self.total_blocks)

    def blocks_for(self, nbytes: int) -> int:
        return -(-max(nbytes, 0) // self.block_size)

    def largest_reservable(self, devices: int = 1) -> int:
        """Bytes per device of the largest reservation on ``devices`` devices that would succeed now."""
        if devices > self.device_count or devices < 1:
            return 0
        return sorted(self.free_blocks, reverse=True)[devices - 1] * self.block_size

    def free_bytes(self) -> int:
        return sum(self.free_blocks) * self.block_size

    def can_reserve(self, nbytes: int, devices: int = 1) -> bool:
        return self.blocks_for(nbytes) * self.block_size <= self.largest_reservable(devices)

    def reserve(self, replica_id: str, nbytes: int, devices: int = 1,
                indices: Optional[Sequence[int]] = None) -> Reservation:
        """Reserve ``nbytes`` on each of ``devices`` devices: ``indices`` if given, else the ones with
        most free blocks."""
        if replica_id in self.reservations:
            raise ReservationError(replica_id, nbytes, devices, self.free_bytes(), self.largest_reservable(devices),
                                   self.block_size, f"replica {replica_id} already holds a reservation; "
                                   "release it first")
        if not 1 <= devices <= self.device_count:
            raise ReservationError(replica_id, nbytes, devices, self.free_bytes(), 0, self.block_size,
                                   f"replica {replica_id} asks for {devices} device(s); this node has "
                                   f"{self.device_count}")
        blocks = self.blocks_for(nbytes)
        if indices:
            return self._reserve_exactly(replica_id, nbytes, devices, list(indices))
        if not self.can_reserve(nbytes, devices):
            raise ReservationError(replica_id, nbytes, devices, self.free_bytes(), self.largest_reservable(devices),
                                   self.block_size)
        chosen = sorted(range(self.device_count), key=lambda d: (-self.free_blocks[d], d))[:devices]
        for d in chosen:
            self.free_blocks[d] -= blocks
        reservation = Reservation(replica_id, tuple(sorted(chosen)), blocks, self.block_size)
        self.reservations[replica_id] = reservation
        self._check()
        return reservation

    def _reserve_exactly(self, replica_id: str, nbytes: int, devices: int, indices: list[int]) -> Reservation:
        """The controller planned these devices: take them or refuse, never substitute others."""
        blocks = self.blocks_for(nbytes)

        def refuse(why: str) -> ReservationError:
            return ReservationError(replica_id, nbytes, devices, self.free_bytes(),
                                    self.largest_reservable(devices), self.block_size, why)

        if len(indices) != devices or len(set(indices)) != len(indices):
            raise refuse(f"replica {replica_id} names devices {indices} (gpu_indices) but spans {devices} "
                         "device(s); name each of its devices once")
        outside = [i for i in indices if not 0 <= i < self.device_count]
        if outside:
            raise refuse(f"replica {replica_id} asks for device(s) {outside}, which this node was not granted "
                         f"(its devices are 0..{self.device_count - 1})")
        short = [i for i in indices if self.free_blocks[i] < blocks]
        if short:
            raise refuse(f"replica {replica_id} asks {format_size(blocks * self.block_size)} on device(s) "
                         f"{indices}; free: " + ", ".join(
                             f"device {i} {format_size(self.free_blocks[i] * self.block_size)}" for i in short)
                         + ". Stop or move a replica there, or plan this one on other devices")
        for d in indices:
            self.free_blocks[d] -= blocks
        reservation = Reservation(replica_id, tuple(indices), blocks, self.block_size)
        self.reservations[replica_id] = reservation
        self._check()
        return reservation

    def release(self, replica_id: str) -> int:
        reservation = self.reservations.pop(replica_id, None)
        if reservation is None:
            return 0
        for d in reservation.devices:
            self.free_blocks[d] += reservation.blocks_per_device
        self._check()
        return reservation.nbytes

    def status(self) -> MemoryPoolStatus:
        return MemoryPoolStatus(block_size=self.block_size,
                                total=[b * self.block_size for b in self.total_blocks],
                                free=[b * self.block_size for b in self.free_blocks],
                                reservations={r.replica_id: r.nbytes for r in self.reservations.values()},
                                devices={r.replica_id: list(r.devices) for r in self.reservations.values()},
                                device_ids=list(self.device_ids))

    def _check(self) -> None:
        for d in range(self.device_count):
            held = sum(r.blocks_per_device for r in self.reservations.values() if d in r.devices)
            assert held + self.free_blocks[d] == self.total_blocks[d], (d, held, self.free_blocks[d])
