"""`exaserve launch` with router.count: 2, without Slurm: two ranks on this machine (srun's variables set by
hand, the job directory carrying the bootstrap, CURVE on). Rank 1 runs router 1 and its gateway beside its
agent; every replica connects to both routers; the job directory lists both gateways; status shows both
routers seeing every replica. Then rank 1's node is lost (its process group killed: router, gateway, agent,
replica) under a stream of requests through rank 0's gateway: 0 of them fail, status marks router 1 lost,
and rank 0 still stops cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import yaml

from waiting import wait_for

pytestmark = pytest.mark.process


def start_rank(site_file: Path, job_dir: Path, rank: int, node: str, log: Path, late_router: float = 0
               ) -> subprocess.Popen:
    env = {**os.environ, "SLURM_JOB_ID": "t2", "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2",
           "SLURMD_NODENAME": node}
    if late_router:  # this rank's router registers that many seconds after its agent joined
        env["EXASERVE_INJECT_FAILURE"] = f"router_late:{late_router:g}"
    return subprocess.Popen([sys.executable, "-m", "exaserve_hpc.launcher", "--site", str(site_file),
                             "--job-dir", str(job_dir), "--port", "0"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def two_router_site(tmp_path: Path, name: str) -> Path:
    """Two nodes, router.count 2, two echo replicas kept at two."""
    site = {"site": name, "cluster": {"nodes": 2, "nodelist": "nodea,nodeb"},
            "heartbeat": {"interval": "1s"}, "scheduler": {"tick_interval": "500ms"},
            "router": {"count": 2, "replica_heartbeat": "500ms"},
            "run_dir": str(tmp_path / "run"), "weight_cache": {"l3_path": str(tmp_path / "models"),
                                                               "l2_path": str(tmp_path / "shm")},
            "models": [{"model_name": "echo", "engine": "echo", "replicas": 2, "min_replicas": 2,
                        "max_seq_len": 4096}]}
    site_file = tmp_path / "site.yaml"
    site_file.write_text(yaml.safe_dump(site))
    return site_file


def rank_logs(logs: list[Path]) -> str:
    """Every rank's output, for a failed assertion's message."""
    return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in logs if p.exists())


def kill_ranks(ranks: list[subprocess.Popen]) -> None:
    """Whatever a test left running: each rank's whole process group."""
    for r in ranks:
        if r.poll() is None:
            os.killpg(r.pid, signal.SIGKILL)


def listed_gateways(job_dir: Path) -> list[str]:
    """The gateways the job directory lists (serve.json), router 0's first."""
    try:
        return json.loads((job_dir / "serve.json").read_text()).get("gateways", [])
    except (OSError, ValueError):
        return []


def status(url: str) -> dict:
    return httpx.get(f"{url}/v1/exaserve/status", timeout=10).json()


def complete(http: httpx.Client, url: str, text: str) -> int:
    return http.post(f"{url}/v1/completions", json={"model": "echo", "prompt": text, "max_tokens": 8}).status_code


def test_a_router_per_rank_and_losing_rank_1_leaves_rank_0_serving(tmp_path):
    site_file = two_router_site(tmp_path, "two-router-launch")
    job_dir = tmp_path / "job"
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    ranks = [start_rank(site_file, job_dir, 0, "nodea", logs[0]), start_rank(site_file, job_dir, 1, "nodeb", logs[1])]
    output = lambda: rank_logs(logs)  # noqa: E731
    try:
        assert wait_for(lambda: len(listed_gateways(job_dir)) == 2 or any(r.poll() is not None for r in ranks), 90,
                        "both gateways listed in the job directory") and len(listed_gateways(job_dir)) == 2, output()
        url0, url1 = listed_gateways(job_dir)
        assert (job_dir / "routers" / "rank-1.json").exists()
        wait_for(lambda: [(r["state"], r["replicas"]) for r in status(url0)["router"]["routers"]]
                 == [("serving", 2), ("serving", 2)], 60, "both routers seeing both replicas")
        assert {r["node"] for r in status(url0)["replicas"]} == {"nodea", "nodeb"}
        with httpx.Client(timeout=30) as http:
            for url in (url0, url1):
                assert [complete(http, url, f"hello {i}") for i in range(5)] == [200] * 5

        codes: list[int] = []
        done = threading.Event()

        def stream() -> None:
            with httpx.Client(timeout=30) as http:
                while not done.is_set():
                    try:
                        codes.append(complete(http, url0, f"request {len(codes)}"))
                    except httpx.HTTPError:
                        codes.append(0)

        client = threading.Thread(target=stream, daemon=True)
        client.start()
        wait_for(lambda: len(codes) >= 20, 30, "requests flowing through gateway 0")
        os.killpg(ranks[1].pid, signal.SIGKILL)  # node b lost: router 1, gateway 1, its agent and replica
        wait_for(lambda: [r["state"] for r in status(url0)["router"]["routers"]] == ["serving", "lost"], 30,
                 "router 1 marked lost")
        # the lost node's replica is placed again on node a; the stream goes on meanwhile
        wait_for(lambda: sum(r["state"] == "serving" and r["node"] == "nodea" for r in status(url0)["replicas"]) == 2,
                 60, "both replicas serving on node a")
        before = len(codes)
        wait_for(lambda: len(codes) >= before + 20, 30, "requests after the re-placement")
        done.set()
        client.join(35)
        assert codes and set(codes) == {200}, f"gateway 0 failed {sum(c != 200 for c in codes)} of {len(codes)}"
        os.kill(ranks[0].pid, signal.SIGUSR1)
        assert ranks[0].wait(timeout=60) == 0, output()
    finally:
        kill_ranks(ranks)


def test_a_router_rank_that_comes_after_placement_is_linked_by_the_replicas_started_before_it(tmp_path):
    """Rank 1's router registers 20 s after its agent joined (EXASERVE_INJECT_FAILURE=router_late:20), so
    both replicas were started knowing router 0 alone. When router 1 registers, router 0 names it to them
    (Routers), they link to it, and gateway 1 serves. Before, router 1 served with 0 replicas for good."""
    site_file = two_router_site(tmp_path, "late-router-launch")
    job_dir = tmp_path / "job"
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    ranks = [start_rank(site_file, job_dir, 0, "nodea", logs[0]),
             start_rank(site_file, job_dir, 1, "nodeb", logs[1], late_router=20)]
    output = lambda: rank_logs(logs)  # noqa: E731

    gateways = lambda: listed_gateways(job_dir)  # noqa: E731
    try:
        assert wait_for(lambda: gateways() or ranks[0].poll() is not None, 60, "gateway 0 listed"), output()
        url0 = gateways()[0]
        serving = lambda: sorted(r["node"] for r in status(url0)["replicas"] if r["state"] == "serving")  # noqa: E731
        wait_for(lambda: serving() == ["nodea", "nodeb"], 60, "both replicas serving, router 1 not registered")
        assert not (job_dir / "routers" / "rank-1.json").exists(), output()
        assert len(status(url0)["router"]["routers"]) == 1
        assert wait_for(lambda: len(gateways()) == 2 or ranks[1].poll() is not None, 60,
                        "gateway 1 listed"), output()
        url1 = gateways()[1]
        assert wait_for(lambda: [(r["state"], r["replicas"]) for r in status(url0)["router"]["routers"]]
                        == [("serving", 2), ("serving", 2)], 30, "router 1 seeing both replicas"), output()
        with httpx.Client(timeout=30) as http:
            assert [complete(http, url1, f"late {i}") for i in range(5)] == [200] * 5
        wait_for(lambda: status(url0)["router"]["routers"][1]["accepted"] >= 5, 10, "router 1's report of them")
        os.kill(ranks[0].pid, signal.SIGUSR1)
        assert ranks[0].wait(timeout=60) == 0, output()
    finally:
        kill_ranks(ranks)


def test_more_routers_than_nodes_is_refused_naming_the_setting():
    from exaserve_hpc.config.schema import SiteConfig
    from exaserve_hpc.app.control_plane import ControlPlaneError
    from exaserve_hpc.app.router_rank import check_router_count

    site = SiteConfig.model_validate({"site": "x", "cluster": {"nodes": 4, "nodelist": "n[1-4]"},
                                      "router": {"count": 3},
                                      "models": [{"model_name": "echo", "engine": "echo", "max_seq_len": 64}]})
    check_router_count(site, 3)
    with pytest.raises(ControlPlaneError, match=r"router.count is 3 but the job has 2 node\(s\); allowed: 1 to 2"):
        check_router_count(site, 2)
