"""Requeue end to end on the local Slurm cluster: a node is lost, capacity falls below the floor, rank 0
checkpoints its state (HDF5, in the job directory) and requeues the job excluding the dead node; the
restarted run restores that state. Marked slurm: under CI=true it must run."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from exaserve_hpc.checkpoint import load_state
from exaserve_hpc.slurm.client import CliSlurmClient, SlurmError
from exaserve_hpc.slurm.requeue import CHECKPOINT_FILE
from exaserve_hpc.slurm.states import JobState

from .fleet import Job, cluster, echo_site, submit, wait_serving

pytestmark = [pytest.mark.slurm, pytest.mark.process]

NODES = 3  # of the cluster's 4: the requeued run gets the spare node in place of the dead one
REPLICAS = 3


def wait(predicate, timeout: float, what: str, job: Job):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    logs = cluster("logs", check=False).stdout[-4000:]
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\njob output:\n{job.log()}\n"
                         f"cluster logs (tail):\n{logs}")


def controller_info(job: Job) -> dict:
    try:
        return json.loads((job.job_dir / "controller.json").read_text())
    except (OSError, ValueError):
        return {}


def test_capacity_floor_requeues_with_checkpoint_and_the_restart_restores_it(slurm_cluster, tmp_path):
    site = echo_site(tmp_path, replicas=REPLICAS, heartbeat="2s", misses=3)
    job = submit(site, tmp_path / "jobs", nodes=NODES, launcher_args="--capacity-floor 0.9")
    client = CliSlurmClient()
    victim = None
    try:
        before = wait_serving(job, agents=NODES, replicas=REPLICAS, timeout=150)
        nodes = controller_info(job)["nodes"]
        controller_node, victim = nodes[0], nodes[-1]
        assert before["restored"] is None
        t0 = time.time()
        cluster("kill-node", victim)

        checkpoint = job.job_dir / CHECKPOINT_FILE
        wait(checkpoint.exists, 60, "the controller's checkpoint after the node loss", job)
        saved = load_state(checkpoint)
        print(f"\nrequeue: kill {victim} -> checkpoint written {time.time() - t0:.1f}s")
        assert saved.job_id == str(job.job_id) and saved.restart == 0
        assert saved.excluded_nodes == [victim]
        assert sorted(saved.placement) == sorted(r["replica_id"] for r in before["replicas"])
        assert victim not in {node for _, node in saved.placement.values()}

        # Slurm holds a requeued job ~120 s (BeginTime) before it may run again; an operator's
        # `scontrol update StartTime=now` releases it, which keeps this test short.
        def pending():
            try:
                info = client.job(job.job_id)
            except SlurmError:
                return None
            # The exclusion is set right after the requeue (SlurmClient.requeue): wait for both.
            requeued = info.state is JobState.PENDING and info.restarts >= 1 and victim in info.excluded_nodes
            return info if requeued else None
        info = wait(pending, 90, f"the job to be pending again after the requeue, excluding {victim}", job)
        assert victim in info.excluded_nodes, info
        subprocess.run(["scontrol", "update", f"JobId={job.job_id}", "StartTime=now"], capture_output=True,
                       timeout=30)
        print(f"requeue: kill -> job pending again {time.time() - t0:.1f}s")

        wait(lambda: controller_info(job).get("restart") == 1, 120, "rank 0 of the restarted run", job)
        after = wait_serving(job, agents=NODES, replicas=REPLICAS, timeout=150)
        print(f"requeue: kill -> restarted run serving {time.time() - t0:.1f}s")
        restored = after["restored"]
        assert restored is not None, "the restarted run did not restore the checkpoint"
        assert restored == {
            "job_id": saved.job_id, "restart": saved.restart, "saved_at": saved.saved_at,
            "placement": {rid: list(v) for rid, v in saved.placement.items()},
            "affinity": {str(h): r for h, r in saved.affinity.items()},
            "quota": {g: list(v) for g, v in saved.quota.items()},
            "rollout": {m: [r.version, r.stage, r.weight] for m, r in saved.rollout.items()},
            "excluded_nodes": saved.excluded_nodes}
        running = client.job(job.job_id)
        assert running.state is JobState.RUNNING and victim not in running.nodes, running
        assert controller_info(job)["nodes"][0] == controller_node or controller_node not in running.nodes
        # Replicas whose node is still in the allocation came back on it.
        now = {r["replica_id"]: r["node"] for r in after["replicas"] if r["state"] == "serving"}
        for rid, (_, node) in saved.placement.items():
            if node in running.nodes:
                assert now[rid] == node, (rid, node, now)
    finally:
        job.cancel()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if client.job(job.job_id).state.terminal:
                    break
            except SlurmError:
                break
            time.sleep(0.5)
        if victim:
            cluster("revive-node", victim, check=False)
