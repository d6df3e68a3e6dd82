"""Bad input on the local Slurm cluster stops the job at start with a message naming the setting, not
a hang: a site asking for more GPUs per node than Slurm granted the step, a gateway interface the node
lacks, a gateway port already taken on the node. Marked slurm: under CI=true these must run."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import yaml

from exaserve_hpc.batch.slurm.client import CliSlurmClient, SlurmError

from .fleet import CLUSTER, NODES, Job, echo_site, submit

pytestmark = [pytest.mark.slurm, pytest.mark.process]

MESSAGE_WITHIN = 90.0  # seconds from submission for rank 0's error
ENDS_WITHIN = 60.0  # seconds after it: a failure at start must end the job, not leave it holding nodes


def refused(job: Job, *words: str) -> str:
    """Wait for rank 0's error naming the setting, then for the job to end; return the job output.

    Rank 0 prints the error and publishes it in place of the controller's address, so the other ranks
    (waiting in the MPI bcast or on the job directory) stop too and the job gives its nodes back."""
    deadline = time.monotonic() + MESSAGE_WITHIN
    while time.monotonic() < deadline and not all(w in job.log() for w in words):
        time.sleep(1)
    output = job.log()
    if not all(w in output for w in words):
        job.cancel()
        raise AssertionError(f"no error naming {words} in {MESSAGE_WITHIN:.0f}s:\n{output}")
    client = CliSlurmClient()
    deadline = time.monotonic() + ENDS_WITHIN
    while time.monotonic() < deadline:
        try:
            if client.job(job.job_id).state.terminal:
                return job.log()
        except SlurmError:
            return job.log()
        time.sleep(1)
    job.cancel()
    raise AssertionError(f"job {job.job_id} still running {ENDS_WITHIN:.0f}s after rank 0's error: the other "
                         f"ranks wait for a controller that failed at start:\n{job.log()}")


def edit_site(site, **sections) -> None:
    data = yaml.safe_load(site.read_text())
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    site.write_text(yaml.safe_dump(data))


def test_more_gpus_per_node_than_granted_is_refused_naming_the_setting(slurm_cluster, shared_tmp):
    site = echo_site(shared_tmp, replicas=2)  # cluster.gpus_per_node: 4
    job = submit(site, shared_tmp / "jobs", nodes=2, extra=("--option", "gpus_per_node=2"))
    refused(job, "cluster.gpus_per_node is 4", "granted 2")


def test_a_gateway_interface_the_node_lacks_is_refused_naming_the_setting(slurm_cluster, shared_tmp):
    site = echo_site(shared_tmp, replicas=2)
    edit_site(site, gateway={"interface": "ib0", "host": "127.0.0.1"})
    job = submit(site, shared_tmp / "jobs", nodes=2)
    refused(job, "gateway.interface", "'ib0'")


def test_a_gateway_port_in_use_on_the_node_is_refused_naming_the_setting(slurm_cluster, shared_tmp):
    port = 18555
    site = echo_site(shared_tmp, replicas=2)
    edit_site(site, gateway={"port": port})
    # Something else already listens on that port on every node (in each node's own namespace).
    holders = [subprocess.Popen(["bash", str(CLUSTER), "exec", node, sys.executable, "-c",
                                 f"import socket, time; s = socket.socket(); s.bind(('0.0.0.0', {port})); "
                                 f"s.listen(); time.sleep(600)"]) for node in NODES]
    try:
        time.sleep(2)
        job = submit(site, shared_tmp / "jobs", nodes=2, port=None)
        refused(job, "gateway.port", str(port), "in use")
    finally:
        for holder in holders:
            holder.kill()
            holder.wait(10)
