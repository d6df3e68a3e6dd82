"""GPU binding end to end on the local Slurm cluster (GRES gpu:4 per node on stand-in devices): a job
of replicas that each use a whole GPU gets them distinct devices on every node, each process holding
exactly what status shows. (A job on all four nodes, test_cluster_e2e.py, checks the same for the
default, fractional share.) Marked slurm: under CI=true it must run."""

from __future__ import annotations

import pytest
import yaml

from .fleet import check_devices, echo_site, submit, wait_serving

pytestmark = [pytest.mark.slurm, pytest.mark.process]


def test_replicas_using_whole_gpus_get_distinct_devices_on_a_node(slurm_cluster, shared_tmp):
    """Two replicas per node, each using a whole GPU (gpu_memory_utilization 1): never the same device."""
    site = echo_site(shared_tmp, replicas=4)
    data = yaml.safe_load(site.read_text())
    data["models"][0]["gpu_memory_utilization"] = 1.0
    site.write_text(yaml.safe_dump(data))
    job = submit(site, shared_tmp / "jobs", nodes=2)
    try:
        status = wait_serving(job, agents=2, replicas=4)
        by_node = check_devices(status, {"tiny-llama": 1.0})
        assert sorted(len(r) for r in by_node.values()) == [2, 2], by_node
        # status counts the GPUs each step was granted (GRES gpu:4), though no NVML reports them here
        assert [(a["gpus"], len(a["gpu_ids"])) for a in status["agents"]] == [(4, 4), (4, 4)], status["agents"]
    finally:
        job.cancel()
