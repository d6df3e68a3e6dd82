"""Several routers on the local Slurm cluster (router.count: 2): the submitted job runs router 1 and its
gateway on rank 1's node; every replica connects to both routers; the job directory lists both gateways;
losing rank 1's node (its namespace's link cut, every process killed) under a request stream through rank
0's gateway fails none of those requests, and status marks router 1 lost. Marked slurm: under CI=true it
must run."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import yaml


from .fleet import RequestStream, cluster, echo_site, submit, wait_serving

pytestmark = [pytest.mark.slurm, pytest.mark.process]


def test_two_routers_on_two_nodes_and_losing_router_1s_node_fails_no_request(shared_tmp):
    site = echo_site(shared_tmp, replicas=2, heartbeat="1s", misses=3)
    data = yaml.safe_load(site.read_text())
    data.setdefault("router", {})["count"] = 2
    site.write_text(yaml.safe_dump(data))
    job = submit(site, shared_tmp / "jobs", nodes=2)
    lost_node = None
    try:
        status = wait_serving(job, agents=2, replicas=2)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(json.loads((job.job_dir / "serve.json").read_text())
                                                  .get("gateways", [])) < 2:
            time.sleep(0.3)
        listed = json.loads((job.job_dir / "serve.json").read_text())
        assert len(listed.get("gateways", [])) == 2, f"{listed}\n{job.log()}"
        registration = json.loads((job.job_dir / "routers" / "rank-1.json").read_text())
        lost_node = registration["node"]
        assert lost_node != json.loads((job.job_dir / "controller.json").read_text())["nodes"][0]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            routers = job.status()["router"].get("routers", [])
            if [(r["state"], r["replicas"]) for r in routers] == [("serving", 2), ("serving", 2)]:
                break
            time.sleep(0.3)
        assert [(r["state"], r["replicas"]) for r in routers] == [("serving", 2), ("serving", 2)], routers
        with httpx.Client(timeout=30) as http:
            for url in listed["gateways"]:  # each gateway answers, through its own router
                response = http.post(f"{url}/v1/completions", json={"model": "tiny-llama", "prompt": "hello",
                                                                   "max_tokens": 4})
                assert response.status_code == 200, response.text

        stream = RequestStream(job.url(), workers=4, interval=0.05).start().flowing()
        cluster("kill-node", lost_node)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status = job.status()
            serving = [r for r in status["replicas"] if r["state"] == "serving" and r["node"] != lost_node]
            if [r["state"] for r in status["router"]["routers"]] == ["serving", "lost"] and len(serving) == 2:
                break
            time.sleep(0.3)
        stream.settle()  # requests in flight at the move finish
        stream.stop()
        assert [r["state"] for r in status["router"]["routers"]] == ["serving", "lost"], status["router"]
        assert stream.sent > 50 and not stream.failed, [o.detail for o in stream.failed][:5]
    finally:
        job.cancel_and_wait()
        if lost_node:
            cluster("revive-node", lost_node, check=False)
