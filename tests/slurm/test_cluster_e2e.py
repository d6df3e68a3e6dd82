"""End to end on the local Slurm cluster: submit the real job, serve through the gateway, lose a node
under load without failing a request. Marked slurm: under CI=true these must run."""

from __future__ import annotations

import json
import socket
import stat
import subprocess
import sys
import time

import openai
import pytest
import yaml

from exaserve_hpc.batch.slurm.client import CliSlurmClient
from exaserve_hpc.batch.slurm.states import JobState, NodeState

from .fleet import (Job, RequestStream, check_devices, cluster, echo_site, kill_and_watch, node_processes,
                    remove_shared_dir, shared_dir, submit, wait_serving)

pytestmark = [pytest.mark.slurm, pytest.mark.process]

REPLICAS = 4


@pytest.fixture(scope="module")
def fleet_job(slurm_cluster):
    directory = shared_dir("fleet")
    site = echo_site(directory, replicas=REPLICAS, heartbeat="2s", misses=3)
    job = submit(site, directory / "jobs", nodes=4)
    try:
        yield job
    finally:
        job.cancel_and_wait()
        for node in ("n1", "n2", "n3", "n4"):
            cluster("revive-node", node, check=False)
        remove_shared_dir(directory)


def test_submitted_job_serves_and_status_shows_four_agents_with_their_replicas(fleet_job: Job):
    wait_serving(fleet_job, agents=4, replicas=REPLICAS)
    assert CliSlurmClient().job(fleet_job.job_id).state is JobState.RUNNING
    client = openai.OpenAI(base_url=f"{fleet_job.url()}/v1", api_key="unused", max_retries=0, timeout=30)
    completion = client.completions.create(model="tiny-llama", prompt="hello cluster", max_tokens=5)
    assert completion.choices[0].text == "hello"

    result = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "status", "--json", "--run-dir",
                             str(fleet_job.job_dir)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert sorted(a["agent_id"] for a in status["agents"]) == ["n1", "n2", "n3", "n4"]
    assert {a["state"] for a in status["agents"]} == {"alive"}
    by_node = sorted(r["node"] for r in status["replicas"] if r["state"] == "serving")
    assert by_node == ["n1", "n2", "n3", "n4"], "one replica per node expected from a balanced placement"

    # The control plane's address and keys are private to the job's owner.
    for path in [fleet_job.job_dir / "controller.json", *sorted((fleet_job.job_dir / "keys").iterdir())]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    published = json.loads((fleet_job.job_dir / "controller.json").read_text())
    assert published["server_public_key"] and published["nodes"] == ["n1", "n2", "n3", "n4"]


def test_every_replica_holds_exactly_its_devices_within_the_steps_grant(fleet_job: Job):
    status = wait_serving(fleet_job, agents=4, replicas=REPLICAS)
    site = yaml.safe_load((fleet_job.job_root.parent / "site.yaml").read_text())
    check_devices(status, {m["model_name"]: m.get("gpu_memory_utilization", 0.9) for m in site["models"]})


def test_published_addresses_are_the_nodes_own_and_status_works_from_outside(fleet_job: Job):
    """Gateway, controller and router are published under rank 0's namespace address (10.77.0.X, what
    its node name resolves to), never a wildcard or loopback; this test runs in the root namespace,
    which reaches them only over the cluster's bridge."""
    wait_serving(fleet_job, agents=4, replicas=REPLICAS)
    published = json.loads((fleet_job.job_dir / "controller.json").read_text())
    rank0 = published["nodes"][0]
    address = socket.gethostbyname(rank0)
    assert address.startswith("10.77.0."), (rank0, address)
    assert published["gateway_url"].startswith(f"http://{address}:"), published
    assert published["endpoint"].startswith(f"tcp://{address}:"), published
    assert fleet_job.url() == published["gateway_url"]
    result = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "status", "--json", "--run-dir",
                             str(fleet_job.job_dir)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    routers = {r["endpoint"] for r in status["replicas"]}  # the router backend every replica connects to
    assert routers and all(e.startswith(f"tcp://{address}:") for e in routers), routers


def test_control_plane_refuses_a_peer_without_the_job_keys(fleet_job: Job):
    """Knowing the port is not enough: an agent without the job's CURVE keys is never admitted."""
    import zmq

    from exaserve_hpc.protocol import AgentHello, encode

    published = json.loads((fleet_job.job_dir / "controller.json").read_text())
    context = zmq.Context()
    intruder = context.socket(zmq.DEALER)
    intruder.setsockopt(zmq.IDENTITY, b"n9")
    intruder.setsockopt(zmq.LINGER, 0)
    public, secret = zmq.curve_keypair()  # a valid key, but not the job's
    intruder.curve_serverkey, intruder.curve_publickey, intruder.curve_secretkey = (
        published["server_public_key"].encode(), public, secret)
    intruder.connect(published["endpoint"])
    intruder.send(encode(AgentHello(agent_id="n9", hostname="n9", pid=1)))
    time.sleep(2.0)
    intruder.close()
    context.term()
    assert "n9" not in [a["agent_id"] for a in fleet_job.status()["agents"]]


def test_node_lost_under_load_is_detected_replaced_and_no_request_fails(fleet_job: Job):
    wait_serving(fleet_job, agents=4, replicas=REPLICAS)
    stream = RequestStream(fleet_job.url(), workers=4, interval=0.05).start().flowing()
    timings, status = kill_and_watch(fleet_job, "n3", REPLICAS, stream)
    print(f"\nfailover on the local cluster: {timings.report()}")
    assert not node_processes("n3"), "kill-node left processes of n3 running"
    heartbeat, misses, grace = 2.0, 3, 2.0  # heartbeat.grace defaults to one interval
    assert timings.detected_at, f"node n3 never declared lost; status {status}"
    # Silent for 3 heartbeats, suspected, lost one grace later; plus a tick and slack for the shared cores.
    assert timings.detected_at - timings.killed_at <= heartbeat * misses + grace + 2.0, timings.report()
    assert timings.serving_at, f"replicas not serving again; status {status}"
    serving = [r for r in status["replicas"] if r["state"] == "serving"]
    assert len(serving) == REPLICAS and "n3" not in {r["node"] for r in serving}
    assert stream.sent > 50 and not stream.failed, [o.detail for o in stream.failed][:5]

    # Slurm noticed too (SlurmdTimeout=10 s): the node is DOWN and the job runs on, shrunk to the survivors.
    client = CliSlurmClient()
    deadline = time.monotonic() + 45
    while time.monotonic() < deadline:
        node, job = {n.name: n for n in client.nodes()}["n3"], client.job(fleet_job.job_id)
        if node.state is NodeState.DOWN and "n3" not in job.nodes:
            break
        time.sleep(1)
    assert node.state is NodeState.DOWN, node
    assert job.state is JobState.RUNNING and job.nodes == ("n1", "n2", "n4"), job
