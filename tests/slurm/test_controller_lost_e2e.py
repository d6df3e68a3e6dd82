"""Rank 0's node lost without HA (issue 25 item 2), on the local Slurm cluster: `kill-node` of the node running
rank 0 (controller, gateway, and the job's batch script). The surviving agents hear nothing from the
controller for `heartbeat.controller_timeout` and exit; one of them gives the job back
(app/controller_lost.py): with requeue on, a successor job excluding the dead node, restoring the
controller's last periodic checkpoint, then this job cancelled, so the successor (afterany) starts and
serves; with requeue off, this job cancelled. Either way the job never stays RUNNING with no process.
Marked slurm: under CI=true it must run."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from exaserve_hpc.controller_state import CHECKPOINT_FILE
from exaserve_hpc.app.controller_lost import CLAIM_FILE
from exaserve_hpc.batch.slurm.client import CliSlurmClient, SlurmError
from exaserve_hpc.batch.slurm.states import JobState

from .fleet import Job, cluster, echo_site, submit, wait_job, wait_serving

pytestmark = [pytest.mark.slurm, pytest.mark.process]

NODES = 3  # of the cluster's 4: the successor gets the spare node in place of rank 0's
REPLICAS = 3
CONTROLLER_TIMEOUT = 12.0  # heartbeat.controller_timeout (> 2 x the 2 s interval)


def read_json(path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def site_for(directory, **requeue) -> object:
    path = echo_site(directory, replicas=REPLICAS, heartbeat="2s", misses=3)
    data = yaml.safe_load(path.read_text())
    data["heartbeat"]["controller_timeout"] = f"{CONTROLLER_TIMEOUT:g}s"
    data["requeue"] = {"checkpoint_interval": "2s", "capacity_floor": 0, **requeue}
    path.write_text(yaml.safe_dump(data))
    return path


def ended(client: CliSlurmClient, job: Job):
    try:
        info = client.job(job.job_id)
    except SlurmError:
        return None
    return info if info.state.terminal else None


def left_running(client: CliSlurmClient, job: Job) -> str:
    """The job's raw state once it is no longer RUNNING (COMPLETING, CANCELLED, ...), else ""."""
    try:
        state = client.job_record(job.job_id).get("JobState", "")
    except SlurmError:
        return ""
    return "" if state in ("", "RUNNING") else state


def kill_rank_0(job: Job) -> tuple[str, float]:
    wait_job(lambda: (job.job_dir / CHECKPOINT_FILE).exists(), 30, "the first periodic checkpoint", job)
    node = read_json(job.job_dir / "controller.json")["nodes"][0]
    killed = time.monotonic()
    cluster("kill-node", node)
    return node, killed


def test_rank_0_node_lost_a_successor_excluding_it_restores_the_checkpoint_and_serves(slurm_cluster, shared_tmp):
    logs = shared_tmp / "logs"  # every process's own log (the job's output is written on rank 0's node)
    logs.mkdir()
    job = submit(site_for(shared_tmp), shared_tmp / "jobs", nodes=NODES, log_dir=logs)
    client = CliSlurmClient()
    victim, successor = None, None
    try:
        before = wait_serving(job, agents=NODES, replicas=REPLICAS, timeout=150)
        victim, killed = kill_rank_0(job)
        record = wait_job(lambda: read_json(job.job_dir / "successor.json"), CONTROLLER_TIMEOUT + 40,
                          "a surviving rank's successor job", job)
        submitted = time.monotonic() - killed
        successor = Job(int(record["job_id"]), job.job_root)
        assert record["exclude"] == [victim], record
        claim = read_json(job.job_dir / CLAIM_FILE)
        assert claim["action"] == "successor" and claim["node"] != victim, claim
        first = wait_job(lambda: ended(client, job), 60, "the first job to end (its batch host is dead)", job)
        gone = time.monotonic() - killed
        assert first.state is JobState.CANCELLED, first
        after = wait_serving(successor, agents=NODES, replicas=REPLICAS, timeout=180 - (time.monotonic() - killed))
        serving = time.monotonic() - killed
        print(f"\nrank 0's node {victim} killed (no HA, controller_timeout {CONTROLLER_TIMEOUT:g}s): successor "
              f"submitted by rank {claim['rank']} after {submitted:.1f}s, first job ended after {gone:.1f}s, "
              f"successor serving after {serving:.1f}s")
        assert serving < 180
        assert after["restored"] is not None, "the successor did not restore the periodic checkpoint"
        assert sorted(after["restored"]["placement"]) == sorted(r["replica_id"] for r in before["replicas"])
        running = client.job(successor.job_id)
        assert victim not in running.nodes, running
    finally:
        for j in (job, successor):
            if j is not None:
                j.cancel_and_wait()
        if victim:
            cluster("revive-node", victim, check=False)


def test_rank_0_node_lost_with_requeue_off_the_job_ends_within_the_controller_timeout(slurm_cluster, shared_tmp):
    logs = shared_tmp / "logs"
    logs.mkdir()
    job = submit(site_for(shared_tmp, enabled=False), shared_tmp / "jobs", nodes=NODES, log_dir=logs)
    client = CliSlurmClient()
    victim = None
    try:
        wait_serving(job, agents=NODES, replicas=REPLICAS, timeout=150)
        victim, killed = kill_rank_0(job)
        # Cancelled, the job is COMPLETING at once (its live nodes go back as they finish); it becomes
        # CANCELLED once slurmctld has marked the dead node down (SlurmdTimeout), which no rank can hasten.
        stopping = wait_job(lambda: left_running(client, job), CONTROLLER_TIMEOUT + 30, "the job to stop running",
                            job, poll=0.2)
        stopped = time.monotonic() - killed
        first = wait_job(lambda: ended(client, job), 90, "the job to end", job)
        gone = time.monotonic() - killed
        print(f"\nrank 0's node {victim} killed (no HA, requeue off, controller_timeout {CONTROLLER_TIMEOUT:g}s): "
              f"job {stopping} after {stopped:.1f}s, {first.state.value} after {gone:.1f}s")
        assert stopped < CONTROLLER_TIMEOUT + 10, stopped
        assert first.state is JobState.CANCELLED, first
        assert read_json(job.job_dir / CLAIM_FILE)["action"] == "cancel"
        assert not (job.job_dir / "successor.json").exists()
    finally:
        job.cancel_and_wait()
        if victim:
            cluster("revive-node", victim, check=False)
