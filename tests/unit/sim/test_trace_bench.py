"""benchmarks/bench_router_trace.py and the simulator share one replica model (sim/fleet.sim_replica) and the
real Dispatcher with each policy as a site builds it: on the same requests they must agree, every policy the
bench compares (the field's routers included) must serve every request, and the bench's capacity criterion
must refuse a rate whose backlog grows."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_router_trace as bench  # noqa: E402
import bench_sim_vs_trace as versus  # noqa: E402
from tenant_trace import generate  # noqa: E402

from exaserve_hpc.sim.simulation import Simulation  # noqa: E402
from exaserve_hpc.sim.workload import parse_workload  # noqa: E402

REPLICAS = 4


@pytest.fixture(scope="module")
def setup():
    logging.getLogger("exaserve_hpc").setLevel(logging.ERROR)
    site = versus.site_for(REPLICAS, "least_tokens")
    fleet = bench.Fleet(site, versus.MODEL, site.cluster.gpu_kind, REPLICAS)
    raw = generate(300, 40, 3)
    t0 = raw[0]["timestamp"]
    rows = [bench.Row((r["timestamp"] - t0) / 1000.0, r["input_length"], r["output_length"], r["hash_ids"])
            for r in raw]
    rows, skipped = bench.usable(rows, fleet)
    assert skipped == 0
    return site, fleet, rows


def simulate(site_policy: str, rows, scale: float, tmp_path) -> dict:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": round(r.arrival * 1000), "input_length": r.input_length,
                                        "output_length": r.output_length, "hash_ids": r.hash_ids}) + "\n"
                            for r in rows))
    wl = parse_workload({"name": "t", "duration": (rows[-1].arrival + 1e-3) / scale,
                         "streams": [{"model": versus.MODEL, "kind": "trace", "path": str(path), "rate": scale,
                                      "block_tokens": bench.BLOCK}]})
    return Simulation(versus.site_for(REPLICAS, site_policy), wl, static=True, routers=1).run()


@pytest.mark.parametrize("policy", ["least_tokens", "prefix_affinity"])
def test_the_bench_and_the_simulator_agree_on_the_same_requests(setup, policy, tmp_path):
    site, fleet, rows = setup
    scale = 0.7  # below the 4 replicas' capacity: a backlog that grows makes any small difference grow with it
    b = bench.replay(rows, policy, fleet, scale)
    s = simulate(policy, rows, scale, tmp_path)
    assert b["completed"] == s["completed"] == len(rows)
    assert s["ttft_mean_s"] == pytest.approx(b["ttft_mean"], rel=0.10)


def test_every_policy_the_bench_compares_serves_every_request_from_its_site_settings(setup):
    site, fleet, rows = setup
    for name in bench.POLICIES:
        r = bench.replay(rows, name, fleet, 2.0)
        assert (r["completed"], r["failed"]) == (len(rows), 0), name
        assert r["ttft_mean"] > 0


def test_the_capacity_is_sustained_and_a_quarter_more_is_not(setup):
    site, fleet, rows = setup
    capacity, probes = bench.measure_capacity(rows, fleet, tolerance=0.05, log=lambda m: None)
    sustained = {round(p["rate"], 6): p["sustained"] for p in probes}
    assert sustained[round(capacity, 6)]
    above = [p for p in probes if p["rate"] > capacity]
    assert above and not any(p["sustained"] for p in above)
    # one criterion: a rate is sustained only if the backlog grew by at most one request a replica
    for p in probes:
        early, late = p["backlog"]
        assert p["sustained"] == (late - early <= REPLICAS)
