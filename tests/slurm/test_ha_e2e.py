"""Control-plane HA on the local Slurm cluster (issue 18): `exaserve launch` with `ha.etcd.members: 3` starts
a real etcd member on each of the first three nodes (each in its own network namespace, 10.77.0.1-3) and
controller candidates on ranks 0-2; rank 0 leads. Kill rank 0's node (link cut, every process killed, its
etcd member included): a standby leads within two lease periods (measured and printed), the surviving
agents follow it, and the fleet serves again through the new leader's gateway, without a requeue."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from exaserve_hpc.ha.etcd_client import EtcdClient
from exaserve_hpc.ha.etcd_member import MemberSpec
from exaserve_hpc.ha.etcd_tls import TlsFiles
from exaserve_hpc.batch.slurm.client import CliSlurmClient
from tests.ha.conftest import fleet_state_names, logged_at
from tests.waiting import wait_for

from .fleet import cluster, echo_site, remove_shared_dir, shared_dir, submit, wait_serving

pytestmark = [pytest.mark.slurm, pytest.mark.process]

TTL = 5.0
REPLICAS = 4
GATEWAY_PORT = 18080  # fixed on every candidate, as the proxy recipe needs (only the leader's listens)
RECIPE = Path(__file__).resolve().parents[2] / "sbatch" / "haproxy-exaserve.cfg"


def start_proxy(directory: Path) -> tuple[subprocess.Popen, str]:
    """The documented HAProxy recipe (sbatch/haproxy-exaserve.cfg, docs/slurm.md) for candidates n1-n3, on a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    text = RECIPE.read_text().replace("127.0.0.1:8000", f"127.0.0.1:{port}").replace(
        "/etc/haproxy/errors/exaserve-503.http", str(RECIPE.with_name("haproxy-exaserve-503.http")))
    for i in range(3):
        text = text.replace(f"NODE{i}:PORT", f"10.77.0.{i + 1}:{GATEWAY_PORT}")
    config = directory / "haproxy.cfg"
    config.write_text(text)
    proxy = subprocess.Popen(["haproxy", "-db", "-f", str(config)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    return proxy, f"http://127.0.0.1:{port}"


class OpenAIStream:
    """Two threads sending completions with the official client (its default retry rules, more retries)."""

    def __init__(self, url: str, retries: int, timeout: float):
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=retries, timeout=timeout)
        self.longest = timeout * (retries + 1) + 30  # a request's own timeouts and the retries' pauses
        self.ok: list[float] = []
        self.failed: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(2)]
        for t in self.threads:
            t.start()

    def run(self, worker: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                reply = self.client.completions.create(model="tiny-llama", prompt=f"w{worker} r{n}", max_tokens=4)
                (self.ok.append(time.monotonic()) if reply.choices[0].text else self.failed.append("empty"))
            except openai.OpenAIError as exc:
                self.failed.append(repr(exc)[:200])
            self.stop.wait(0.1)

    def finish(self) -> None:
        """Stop sending, and let every request in flight end (by an answer, or by the client's timeout)."""
        self.stop.set()
        for t in self.threads:
            t.join(self.longest)


def controller(job) -> dict:
    try:
        return json.loads((job.job_dir / "controller.json").read_text())
    except (OSError, ValueError):
        return {}


def complete(url: str) -> str:
    try:
        reply = httpx.post(f"{url}/v1/completions", json={"model": "tiny-llama", "prompt": "after failover",
                                                          "max_tokens": 4}, timeout=10)
    except httpx.HTTPError:
        return ""
    return reply.json()["choices"][0]["text"] if reply.status_code == 200 else ""


def test_leader_node_killed_a_standby_leads_and_the_fleet_serves_again(slurm_cluster):
    directory = shared_dir("ha")
    site = echo_site(directory, replicas=REPLICAS, heartbeat="2s", misses=3)
    data = yaml.safe_load(site.read_text())
    data["ha"] = {"etcd": {"members": 3}, "lease_ttl": f"{TTL:g}s", "state_interval": "0.5s"}
    site.write_text(yaml.safe_dump(data))
    logs = directory / "logs"  # every process's own log file (the job's output is written on n1, killed)
    logs.mkdir()
    job = submit(site, directory / "jobs", nodes=4, log_dir=logs, port=GATEWAY_PORT)
    proxy, proxied, direct = None, None, None
    try:
        serving = wait_serving(job, agents=4, replicas=REPLICAS)
        members = [json.loads((job.job_dir / "etcd" / "restart-0" / f"member-{r}.json").read_text())
                   for r in range(3)]
        assert [m["host"] for m in members] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"], members
        first = controller(job)
        assert first["endpoint"].startswith("tcp://10.77.0.1:"), first
        assert complete(first["gateway_url"]), job.log()
        # the fleet state in etcd names every serving replica (what the standby restores), not a fixed sleep
        replicas = [r["replica_id"] for r in serving["replicas"] if r["state"] == "serving"]
        etcd = EtcdClient([MemberSpec(**m).client_url for m in members], timeout=2.0,
                          tls=TlsFiles(*(str(job.job_dir / "etcd" / "restart-0" / "pki" / f)
                                         for f in ("ca.crt", "client.crt", "client.key"))))
        wait_for(lambda: fleet_state_names(etcd, str(job.job_id), replicas), 30,
                 "the fleet state in etcd naming the serving replicas")
        # Clients through the documented proxy, and clients of the leader's gateway itself, during the failover
        proxy, url = start_proxy(directory)
        wait_for(lambda: complete(url), 30, "the proxy to reach the leader's gateway")
        proxied = OpenAIStream(url, retries=5, timeout=30)
        direct = OpenAIStream(first["gateway_url"], retries=0, timeout=10)
        wait_for(lambda: len(proxied.ok) >= 5 and len(direct.ok) >= 5, 30, "both streams to be served")

        killed, killed_wall = time.monotonic(), time.time()
        cluster("kill-node", "n1")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and controller(job).get("endpoint") in (None, "", first["endpoint"]):
            time.sleep(0.1)
        published = time.monotonic() - killed
        new = controller(job)
        assert new.get("endpoint") and new["endpoint"] != first["endpoint"], job.log()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not complete(new["gateway_url"]):
            time.sleep(0.3)
        served = time.monotonic() - killed
        status = httpx.get(f"{new['gateway_url']}/v1/exaserve/status", timeout=10).json()
        leader_logs = "".join(p.read_text(errors="replace") for p in logs.glob("rank*.log"))
        elected = max(logged_at(p.read_text(errors="replace"), " leads (election key") for p in logs.glob("rank*.log"))
        print(f"\nHA failover on the local Slurm cluster: a standby elected {elected - killed_wall:.1f}s after n1 was "
              f"killed (lease TTL {TTL:g}s), its controller published {published:.1f}s after, serving through its "
              f"gateway {served:.1f}s after; "
              f"agents {sorted((a['agent_id'], a['state']) for a in status['agents'])}")
        assert served < 90, job.log()
        assert 0 < elected - killed_wall <= 2 * TTL, leader_logs[-3000:]  # within two lease periods
        assert published <= 2 * TTL + 5.0, job.log()  # plus building the plane
        alive = {a["agent_id"] for a in status["agents"] if a["state"] == "alive"}
        assert alive == {"n2", "n3", "n4"}, status["agents"]
        assert "restored the fleet state from etcd" in leader_logs, leader_logs[-3000:]
        wait_for(lambda: sum(t > killed + served for t in proxied.ok) >= 10, 30,
                 "the proxy's clients to be served by the new leader")
        for stream in (proxied, direct):
            stream.finish()
        print(f"HA through the proxy recipe (HAProxy): {len(proxied.ok)} served, {len(proxied.failed)} failed; "
              f"direct to the first leader's gateway: {len(direct.ok)} served, {len(direct.failed)} failed")
        assert len(proxied.failed) <= len(direct.failed), (proxied.failed, direct.failed)
        assert direct.failed, "the direct clients lost nothing: the kill did not reach the leader's gateway"

        # Stopped as Slurm stops it (TERM to the job's step: preemption, the time-limit warning), the job ends
        # by itself although its batch script's node is dead: the leader that stopped the run cancels it last.
        client = CliSlurmClient()
        stop = time.monotonic()
        client.cancel(job.job_id, signal="TERM")
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and client.job_record(job.job_id).get("JobState") == "RUNNING":
            time.sleep(0.5)
        state = client.job_record(job.job_id).get("JobState")
        print(f"HA: stopped after the failover, the job left RUNNING in {time.monotonic() - stop:.1f}s ({state})")
        assert state != "RUNNING", job.log()
        ended = json.loads((job.job_dir / "job-ended").read_text())
        assert ended["node"] != "n1" and "batch host is down" in ended["why"], ended
    finally:
        for stream in (proxied, direct):
            if stream is not None:
                stream.stop.set()
        if proxy is not None:
            proxy.terminate()
            proxy.wait(10)
        job.cancel()
        time.sleep(2)
        cluster("revive-node", "n1", check=False)
        remove_shared_dir(directory)
