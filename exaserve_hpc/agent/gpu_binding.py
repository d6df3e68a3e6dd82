"""GPU binding: which GPUs this node's step was granted, and what each replica process is given.

The grant, first source that names any GPU wins:
  SLURM_STEP_GPUS        the step's GPU ids on this node (Slurm sets it per node, per step)
  SLURM_JOB_GPUS         the job's ids (set for the batch step, inherited by srun steps)
  CUDA_VISIBLE_DEVICES   the step's own (Slurm with task/cgroup sets it, zero-based; an operator may too)
  NVML                   every GPU the agent sees (nvml_probe.py, the one seam to the driver)
  cluster.gpus_per_node  the site's word, ids 0..N-1, when nothing above answers and this is not a
                         Slurm job (a Slurm job that names no GPU was granted none)
A CPU site (cluster.gpus_per_node 0) binds no GPU whatever the node has: its replicas run on the host.
A site asking for more GPUs per node than the grant holds is refused at start (GpuGrantError, naming
cluster.gpus_per_node, the granted count and its source); a larger grant is used up to gpus_per_node.

The memory pool's device i is the grant's GPU i. A replica reserving devices (i, j) gets
CUDA_VISIBLE_DEVICES with their UUIDs when NVML knows them (unambiguous whether or not a cgroup hides
the other GPUs), else their entries in the step's CUDA_VISIBLE_DEVICES (what CUDA in the step
understands), else the ids the grant named; CUDA_DEVICE_ORDER=PCI_BUS_ID, so CUDA's numbering
agrees with NVML's and Slurm's; and the CPUs NVML calls near those GPUs, within the agent's own
(Slurm's cpuset), when NVML reports any. A replica of the host device gets CUDA_VISIBLE_DEVICES=""
(no GPU: CUDA sees none) and keeps the agent's CPUs.

Everything here is pure (environment and NVML readings come in as values) but `node_grant` and
`node_pool`, the edges that read them.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import msgspec

from exaserve_hpc.protocol import GpuInfo
from exaserve_hpc.agent.memory_pool import MemoryPool
from exaserve_hpc.agent.nvml_probe import NvmlDevice, host_memory, read_devices

log = logging.getLogger(__name__)

SLURM_SOURCES = ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES")
NO_DEVICE_WORDS = ("", "NoDevFiles", "-1", "none")  # what Slurm and CUDA use for "no GPU here"


class GpuGrantError(Exception):
    """The site and the GPUs this node was granted disagree; the message names the setting."""


@dataclass(frozen=True)
class GrantedGpu:
    granted_id: str  # as the source named it ("2", "GPU-...", "MIG-...")
    ident: str  # what CUDA_VISIBLE_DEVICES names it by: the UUID when NVML knows it, else granted_id
    memory_free: int = 0  # bytes, from NVML; 0: unknown
    cpus: frozenset[int] = frozenset()  # CPUs near it, from NVML; empty: unknown
    nvml_index: int = -1  # NVML's index of it; -1: NVML does not know it


@dataclass(frozen=True)
class GpuGrant:
    gpus: tuple[GrantedGpu, ...] = ()
    source: str = "no GPU"  # e.g. "SLURM_STEP_GPUS=0,1,2,3", "NVML", "cluster.gpus_per_node"

    def idents(self, indices: Sequence[int]) -> list[str]:
        return [self.gpus[i].ident for i in indices]


@dataclass(frozen=True)
class ReplicaBinding:
    devices: tuple[str, ...]  # CUDA_VISIBLE_DEVICES entries; () = none (a host replica)
    env: dict[str, str]
    cpus: Optional[frozenset[int]]  # None: leave the CPU affinity as the agent's


def parse_ids(value: str) -> list[str]:
    """GPU ids in a Slurm/CUDA list: "0,1,2", "0-3", "GPU-<uuid>,..."; the no-device words give []."""
    if value.strip() in NO_DEVICE_WORDS:
        return []
    ids: list[str] = []
    for part in (p.strip() for p in value.split(",")):
        low, dash, high = part.partition("-")
        if dash and low.isdigit() and high.isdigit():
            ids += [str(i) for i in range(int(low), int(high) + 1)]
        elif part:
            ids.append(part)
    return ids


def in_slurm_job(environ: Mapping[str, str]) -> bool:
    return bool(environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID"))


def detect_grant(environ: Mapping[str, str], nvml: Sequence[NvmlDevice],
                 gpus_per_node: Optional[int]) -> GpuGrant:
    """The GPUs this node's replicas may use (see the module docstring); `gpus_per_node` None: the
    site is not known (nothing to check, no fallback)."""
    if gpus_per_node == 0:
        return GpuGrant(source="cluster.gpus_per_node is 0 (CPU site)")
    ids, source = [], ""
    for name in SLURM_SOURCES:
        if name in environ:
            ids, source = parse_ids(environ[name]), f"{name}={environ[name]}"
            break
    if not source and nvml:
        ids, source = [str(d.index) for d in nvml], f"NVML ({len(nvml)} GPU(s) visible)"
    if not source and in_slurm_job(environ):
        source = "Slurm job with no SLURM_STEP_GPUS, SLURM_JOB_GPUS or CUDA_VISIBLE_DEVICES"
    if not source and gpus_per_node:
        ids, source = [str(i) for i in range(gpus_per_node)], "cluster.gpus_per_node"
    if not source:
        return GpuGrant()
    if gpus_per_node is not None and len(ids) < gpus_per_node:
        raise GpuGrantError(
            f"cluster.gpus_per_node is {gpus_per_node} but this node was granted {len(ids)} GPU(s) "
            f"({source}); ask the scheduler for {gpus_per_node} per node (sbatch --gpus-per-node="
            f"{gpus_per_node}) or set cluster.gpus_per_node to {len(ids)}")
    # CUDA in the step numbers GPUs as the step's CUDA_VISIBLE_DEVICES does (zero-based under a device
    # cgroup), not by Slurm's node-wide ids; both lists are ascending, so pair them when counts agree
    cuda_ids = parse_ids(environ.get("CUDA_VISIBLE_DEVICES", "")) if source.startswith("SLURM_") else []
    local = dict(zip(ids, cuda_ids)) if len(cuda_ids) == len(ids) else {}
    if gpus_per_node is not None and len(ids) > gpus_per_node:
        log.info("%d GPU(s) granted (%s); the site uses %d (cluster.gpus_per_node)", len(ids), source,
                 gpus_per_node)
        ids = ids[:gpus_per_node]
    matched = match_nvml(ids, nvml) if not source.startswith("NVML") else {i: nvml[int(i)] for i in ids}
    gpus = tuple(GrantedGpu(i, matched[i].uuid, matched[i].memory_free, matched[i].cpus, matched[i].index)
                 if i in matched else GrantedGpu(i, local.get(i, i)) for i in ids)
    return GpuGrant(gpus, source)


def match_nvml(ids: Sequence[str], nvml: Sequence[NvmlDevice]) -> dict[str, NvmlDevice]:
    """Which NVML device each granted id names; ids it cannot place stay unmatched (bound by id).

    By UUID when the id is one; else by /dev/nvidiaN minor number when every id is one (Slurm's ids
    follow gres.conf's device files); else in order when NVML sees exactly the granted GPUs (a
    cgroup hides the rest: both lists are in PCI order); else by NVML index.
    """
    by_uuid = {d.uuid: d for d in nvml}
    found = {i: by_uuid[i] for i in ids if i in by_uuid}
    numeric = [i for i in ids if i not in found and i.isdigit()]
    if not numeric or not nvml:
        return found
    minors = {d.minor: d for d in nvml if d.minor >= 0}
    if all(int(i) in minors for i in numeric):
        return {**found, **{i: minors[int(i)] for i in numeric}}
    if len(nvml) == len(ids) and len(numeric) == len(ids):
        return dict(zip(ids, nvml))
    return {**found, **{i: nvml[int(i)] for i in numeric if int(i) < len(nvml)}}


def replica_binding(grant: GpuGrant, indices: Sequence[int], allowed_cpus: frozenset[int]) -> ReplicaBinding:
    """What the replica on pool devices `indices` is given (see the module docstring)."""
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    if not grant.gpus:  # the pool is host memory: hide every GPU
        return ReplicaBinding((), {**env, "CUDA_VISIBLE_DEVICES": ""}, None)
    devices = tuple(grant.idents(indices))
    near = frozenset().union(*(grant.gpus[i].cpus for i in indices)) & allowed_cpus
    return ReplicaBinding(devices, {**env, "CUDA_VISIBLE_DEVICES": ",".join(devices)}, near or None)


def granted_telemetry(grant: GpuGrant, readings: Sequence[GpuInfo]) -> list[GpuInfo]:
    """NVML's readings of the granted GPUs only, indexed as the memory pool's devices: the controller
    compares reading i with pool device i (its OOM guard), and counts the node's GPUs from them."""
    by_index = {g.index: g for g in readings}
    return [msgspec.structs.replace(by_index[g.nvml_index], index=i) for i, g in enumerate(grant.gpus)
            if g.nvml_index in by_index]


def node_grant(gpus_per_node: Optional[int], environ: Optional[Mapping[str, str]] = None) -> GpuGrant:
    """This node's grant, read from the environment and NVML (the edge of this module)."""
    environ = os.environ if environ is None else environ
    nvml, why = read_devices() if gpus_per_node != 0 else ([], "")
    grant = detect_grant(environ, nvml, gpus_per_node)
    log.info("GPUs: %s from %s%s", ",".join(g.ident for g in grant.gpus) or "none", grant.source,
             f" ({why})" if why and not nvml else "")
    return grant


def node_pool(l2_capacity: int, pool_bytes: Optional[int], block_size: int,
              grant: GpuGrant = GpuGrant()) -> MemoryPool:
    """The node's memory pool, one device per granted GPU (else the host): `pool_bytes` each if given,
    else NVML's free memory, else host memory less L2 (10% left for the OS) shared among them
    (stand-in GPUs without NVML: the reference engine computes in host memory)."""
    count = max(1, len(grant.gpus))
    ids = [g.ident for g in grant.gpus] or None
    if pool_bytes is not None:
        return MemoryPool([pool_bytes] * count, block_size, ids)
    if grant.gpus and all(g.memory_free for g in grant.gpus):
        return MemoryPool([g.memory_free for g in grant.gpus], block_size, ids)
    total, _ = host_memory()
    return MemoryPool([max(0, int(total * 0.9) - l2_capacity) // count] * count, block_size, ids)
