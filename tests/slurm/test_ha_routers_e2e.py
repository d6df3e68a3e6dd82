"""Control-plane HA with several routers on the local Slurm cluster (issue 18): `exaserve launch` with
`ha.etcd.members: 3` and `router.count: 3` on four nodes runs router k and gateway k on rank k, controller
candidates on ranks 0-2, rank 0 leading. Kill n1 (rank 0: the leader, router 0, gateway 0, an etcd member)
under request streams through gateways 1 and 2: none of those requests fails, a standby leads within two
lease periods (measured and printed), adopts routers 1 and 2, and keeps every replica of the surviving nodes
(same id, same process): nothing restarts, nothing is requeued."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from tests.ha.conftest import logged_at

from .fleet import RequestStream, cluster, echo_site, remove_shared_dir, shared_dir, submit, wait_serving

pytestmark = [pytest.mark.slurm, pytest.mark.process]

TTL = 5.0
REPLICAS = 4


def read(path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def test_leader_node_killed_the_other_gateways_fail_no_request_and_keep_their_replicas(slurm_cluster):
    directory = shared_dir("ha-routers")
    site = echo_site(directory, replicas=REPLICAS, heartbeat="2s", misses=3)
    data = yaml.safe_load(site.read_text())
    data["ha"] = {"etcd": {"members": 3}, "lease_ttl": f"{TTL:g}s", "state_interval": "0.5s"}
    data.setdefault("router", {})["count"] = 3
    site.write_text(yaml.safe_dump(data))
    logs = directory / "logs"  # every process's own log file (the job's output is written on n1, killed)
    logs.mkdir()
    job = submit(site, directory / "jobs", nodes=4, log_dir=logs)
    streams: list[RequestStream] = []
    try:
        wait_serving(job, agents=4, replicas=REPLICAS)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (
                len(read(job.job_dir / "serve.json").get("gateways", [])) == 3
                and [(r["state"], r["replicas"]) for r in job.status()["router"].get("routers", [])]
                == [("serving", REPLICAS)] * 3):
            time.sleep(0.3)
        assert len(read(job.job_dir / "serve.json").get("gateways", [])) == 3, job.log()
        routers = job.status()["router"].get("routers", [])
        # Seen once (a CI run on a loaded machine): router 2 serving with 0 replicas for 60 s. Its cause is not
        # known; on a failure this prints what each process logged (INFO and up: routers joining, replicas'
        # routers) so the next one can be told apart.
        assert [(r["state"], r["replicas"]) for r in routers] == [("serving", REPLICAS)] * 3, \
            f"{routers}\n{job.log()[-4000:]}\n" + "\n".join(
                f"{p.name}: {line}" for p in sorted(logs.glob("*.log"))
                for line in p.read_text(errors="replace").splitlines()[-60:]
                if "router" in line or "WARNING" in line or "ERROR" in line)[-12000:]
        gateways = {k: read(job.job_dir / "routers" / f"rank-{k}.json")["gateway_url"] for k in (1, 2)}
        first = job.status()
        assert read(job.job_dir / "controller.json")["endpoint"].startswith("tcp://10.77.0.1:"), job.log()
        kept = {r["replica_id"]: r["pid"] for r in first["replicas"] if r["state"] == "serving" and r["node"] != "n1"}
        assert kept, first["replicas"]
        old = read(job.job_dir / "controller.json")["endpoint"]
        streams = [RequestStream(url, workers=2, interval=0.05).start() for url in gateways.values()]
        time.sleep(3)  # requests flowing, and the fleet state is in etcd

        killed, killed_wall = time.monotonic(), time.time()
        cluster("kill-node", "n1")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and read(job.job_dir / "controller.json").get("endpoint") in (None, "", old):
            time.sleep(0.1)
        published = time.monotonic() - killed
        deadline, status = time.monotonic() + 60, {}
        while time.monotonic() < deadline:
            try:
                status = job.status()
            except Exception:  # noqa: BLE001 - the new leader's gateway is coming up
                time.sleep(0.3)
                continue
            pids = {r["replica_id"]: r["pid"] for r in status.get("replicas", []) if r["state"] == "serving"}
            routers = {r["gateway"]: r["state"] for r in status.get("router", {}).get("routers", [])}
            if routers == {u: "serving" for u in gateways.values()} and all(pids.get(rid) for rid in kept):
                break
            time.sleep(0.3)
        adopted = time.monotonic() - killed
        time.sleep(5)  # the streams go on after the failover
        for stream in streams:
            stream.stop()
        leader_logs = "".join(p.read_text(errors="replace") for p in logs.glob("rank*.log"))
        elected = max(logged_at(p.read_text(errors="replace"), " leads (election key") for p in logs.glob("rank*.log"))
        failed = [len(s.failed) for s in streams]
        print(f"\nHA with 3 routers on the local Slurm cluster: a standby elected {elected - killed_wall:.1f}s after "
              f"n1 was killed (lease TTL {TTL:g}s), its controller published {published:.1f}s after, routers 1,2 "
              f"adopted with {len(kept)} replicas kept {adopted:.1f}s after; requests through gateways 1/2: "
              f"{[s.sent for s in streams]}, failed {failed}")
        warnings = "\n".join(line for p in sorted(logs.glob("*.log")) for line in
                              p.read_text(errors="replace").splitlines() if "WARNING" in line or "exaserve:" in line)
        assert failed == [0, 0], f"{[o.detail[:120] for s in streams for o in s.failed][:3]}\n{warnings[-8000:]}"
        assert all(s.sent > 20 for s in streams)
        assert 0 < elected - killed_wall <= 2 * TTL, leader_logs[-3000:]  # within two lease periods
        assert {r["gateway"]: r["state"] for r in status["router"]["routers"]} == {
            u: "serving" for u in gateways.values()}, status["router"]
        assert {rid: r["pid"] for r in status["replicas"] for rid in [r["replica_id"]] if rid in kept} == kept, \
            leader_logs[-3000:]
        assert sorted(read(job.job_dir / "serve.json")["gateways"]) == sorted(gateways.values())
    finally:
        for stream in streams:
            stream.stop()
        job.cancel()
        time.sleep(2)
        cluster("revive-node", "n1", check=False)
        remove_shared_dir(directory)
