"""How many replicas a CPU node can run: replicas x their compute threads <= the node's cores (issue 25).

A CPU engine (engine/registry.py `cpu_compute`: the reference engine) keeps one core busy per compute
thread of each replica it runs. `max_replicas_per_node` (16 by default, sized for GPU nodes) let the
autoscaler grow `exaserve serve` to 16 reference replicas on a 2-core machine: every process then got a
sliver of a core, heartbeats were seconds late and nothing finished. So on a node without GPUs, while the
site serves any CPU-compute model, the node holds at most `cpu_replica_slots(cores, threads)` replicas
(Occupancy's per-node cap, placement and the autoscaler's `placeable_replicas` alike). A node that does
not report its cores (an older agent) is not bounded. The agent measures its cores and its replicas'
threads (agent/replica_process.py usable_cores, replica_threads) and reports them in its hello.
"""

from __future__ import annotations

from exaserve_hpc.engine.registry import engine_spec


def cpu_replica_slots(cores: int, threads_per_replica: int) -> int:
    """Replicas of a CPU engine a node with `cores` usable cores runs at once: threads x replicas <= cores,
    at least one (a node too small for one still runs one); 0 when the cores are unknown (no bound)."""
    if cores <= 0:
        return 0
    return max(1, cores // max(1, threads_per_replica))


def node_replica_cap(cap: int, cpu_slots: int) -> int:
    """The replicas one node may hold: `max_replicas_per_node`, lowered to its CPU slots where it has any."""
    return min(cap, cpu_slots) if cpu_slots > 0 else cap


def site_bounds_cpu(site) -> bool:
    """Whether the site's CPU nodes are bounded by cores: nodes without GPUs, and a CPU-compute engine."""
    if site.cluster.gpus_per_node:
        return False
    return any(engine_spec(m.engine).cpu_compute for m in site.models)
