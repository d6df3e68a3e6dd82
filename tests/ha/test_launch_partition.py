"""No split brain under `exaserve launch` with `ha.etcd`: the leader (rank 0) runs in its own network
namespace, joined to the others by a veth pair; the etcd members listen on this side. Cutting the link
partitions the leader from etcd (and from the other ranks): it stops leading (its plane closes, nothing
drained) before the standby on this side leads; the other agents follow the new leader, and once the link
is back the old leader's rank stays a standby and its agent follows the new leader too."""

from __future__ import annotations

import subprocess
import time

import pytest

from serve_harness import write_local_site
from tests.ha.conftest import (NODES, cli_status as status, ip, kill_ranks, logged_at, need_etcd, read_json,
                               start_cluster, start_rank, tls_settings)
from tests.waiting import wait_for

pytestmark = pytest.mark.process
TTL = 2.0








def test_partitioned_leader_stops_before_the_standby_leads(netns, tmp_path):
    need_etcd()
    name, host_if, address = netns
    members = start_cluster(tmp_path / "etcd", host=address)
    site_file = write_local_site(tmp_path, weight_cache={"l2_path": str(tmp_path / "shm")},
                                 cluster={"nodes": 3, "nodelist": ",".join(NODES)},
                                 heartbeat={"controller_timeout": "60s"}, gateway={"host": "0.0.0.0"},
                                 ha={"etcd": {"endpoints": [m.spec.client_url for m in members], **tls_settings(members)},
                                     "lease_ttl": f"{TTL:g}s", "state_interval": "0.5s"})
    job_dir = tmp_path / "job"
    logs = [tmp_path / f"rank{r}.log" for r in range(3)]
    ranks = [start_rank(site_file, job_dir, 0, logs[0], "hap", netns=name)]
    ranks += [start_rank(site_file, job_dir, r, logs[r], "hap") for r in (1, 2)]
    output = lambda: "\n".join(f"--- {p.name}\n{p.read_text()}" for p in logs)  # noqa: E731
    try:
        wait_for(lambda: sum(r["state"] == "serving" for r in status(job_dir).get("replicas", [])) >= 2, 120,
                 "two serving replicas")
        first = read_json(job_dir / "controller.json")
        assert f"//{address.rsplit('.', 1)[0]}.2:" in first["endpoint"], (first, output())
        time.sleep(1.0)
        ip("link", "set", host_if, "down")
        cut = time.time()
        wait_for(lambda: read_json(job_dir / "controller.json").get("endpoint")
                 not in (None, "", first["endpoint"]), 30,
                 "a new leader on this side")
        wait_for(lambda: "stopped leading" in logs[0].read_text(), 30, "the old leader to close its plane")
        old, new_log = logs[0].read_text(), next(p for p in logs[1:] if " leads (election key" in p.read_text())
        stopped = logged_at(old, "stops leading")
        began = logged_at(new_log.read_text(), " leads (election key")
        print(f"\npartition under launch: the old leader stopped leading {stopped - cut:.2f}s after the cut, "
              f"the standby ({new_log.stem}) led {began - cut:.2f}s after the cut (gap {began - stopped:.2f}s)")
        assert 0 < stopped < began, output()
        assert "draining replicas on every node" not in old, "the deposed leader drained the fleet"
        ip("link", "set", host_if, "up")
        # healed: rank 0 stays a standby; its agent follows the new leader like the others
        wait_for(lambda: {a["agent_id"] for a in status(job_dir).get("agents", []) if a["state"] == "alive"}
                 == set(NODES), 60, "every agent at the new leader")
        assert read_json(job_dir / "controller.json")["endpoint"] != first["endpoint"]
        assert logs[0].read_text().count(" leads (election key") == 1, output()
    finally:
        subprocess.run(["ip", "link", "set", host_if, "up"], capture_output=True)
        kill_ranks(ranks)
        for m in members:
            m.stop()
