"""Replacement allocation end to end on the local Slurm cluster: a node is lost under a steady request
stream; rank 0 asks Slurm for a companion job, whose agent joins the controller over ZeroMQ (CURVE), and
the fleet is back to its planned nodes and replicas. Not one request fails. Marked slurm."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from exaserve_hpc.batch.slurm.client import CliSlurmClient, SlurmError
from exaserve_hpc.batch.slurm.companion_jobs import companion_name

from .fleet import (RequestStream, cluster, kill_and_watch_replacement, remove_shared_dir, replacement_site,
                    shared_dir, submit, wait_serving)

pytestmark = [pytest.mark.slurm, pytest.mark.process]

NODES = 3  # of the cluster's 4: the spare one becomes the replacement
REPLICAS = 3


def test_lost_node_is_replaced_by_a_companion_job_and_capacity_returns(slurm_cluster, shared_tmp):
    site = replacement_site(shared_tmp, replicas=REPLICAS, heartbeat="2s", misses=3)
    job = submit(site, shared_tmp / "jobs", nodes=NODES, launcher_args="--replace-lost-nodes --capacity-floor 0")
    client = CliSlurmClient()
    victim = None
    stream = None
    try:
        wait_serving(job, agents=NODES, replicas=REPLICAS, timeout=150)
        nodes = json.loads((job.job_dir / "controller.json").read_text())["nodes"]
        victim = nodes[-1]  # never rank 0's node
        stream = RequestStream(job.url(), workers=3, interval=0.05).start().flowing()
        timings, status = kill_and_watch_replacement(job, victim, nodes, REPLICAS, stream)
        print(f"\nreplacement on the local cluster: {timings.report()}")
        if not timings.restored_at:
            companions = "\n".join(p.read_text() for p in sorted((shared_tmp / "jobs").glob("exaserve-replace-*.out")))
            pytest.fail(f"capacity did not return: {timings.report()}\nstatus {json.dumps(status)[:2000]}\n"
                        f"job output:\n{job.log()}\ncompanion output:\n{companions}\n"
                        f"cluster logs:\n{cluster('logs', check=False).stdout[-3000:]}")
        alive = sorted(a["agent_id"] for a in status["agents"] if a["state"] == "alive")
        assert len(alive) == NODES and victim not in alive, alive
        # 3 heartbeats of silence, then heartbeat.grace (one interval), plus slack for the shared cores
        assert timings.detected_at - timings.killed_at <= 2.0 * 3 + 2.0 + 2.0, timings.report()
        assert stream.sent > 30 and not stream.failed, [o.detail for o in stream.failed][:5]
    finally:
        if stream is not None:
            stream.stop()
        job.cancel()
        subprocess.run(["scancel", f"--name={companion_name(str(job.job_id))}"], capture_output=True, timeout=30)
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            try:
                mine = [j for j in client.jobs() if j.job_id == job.job_id or j.name == companion_name(str(job.job_id))]
            except SlurmError:
                break
            if all(j.state.terminal for j in mine):
                break
            time.sleep(0.5)
        if victim:
            cluster("revive-node", victim, check=False)
