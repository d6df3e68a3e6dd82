"""The shipped site configs, planned in full and audited; hand-built shapes that cannot be placed."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from exaserve_hpc.config.schema import load_site, parse_site
from exaserve_hpc.controller.catalogue import catalogue_from_site
from exaserve_hpc.controller.invariants import plan_violations
from exaserve_hpc.controller.plan import replica_index
from exaserve_hpc.controller.placement import plan_site
from exaserve_hpc.topology import topology_from_site

SITES = Path(__file__).resolve().parents[3] / "site-configs"


@pytest.fixture(scope="module")
def exa256():
    site = load_site(SITES / "exa256-a100.yaml")
    return site, plan_site(site)


def test_exa256_places_all_3072_replicas_within_every_invariant(exa256):
    site, plan = exa256
    topo, cat = topology_from_site(site), catalogue_from_site(site)
    assert len(plan.assignments) == 3072 and plan.unplaced == []
    assert plan.replicas_per_model() == Counter({"llama-3.1-8b-instruct": 2000, "mistral-7b-instruct": 1000,
                                                 "llama-3.1-70b-instruct": 64, "llama-3.1-405b-instruct": 8})
    assert plan_violations(plan, topo, cat, site.scheduler.max_replicas_per_node) == []


def test_exa256_shapes_and_spread(exa256):
    site, plan = exa256
    for a in plan.assignments:
        if a.model == "llama-3.1-405b-instruct":
            # TP 8 on one node: a TensorRT-LLM replica does not span nodes (config check refuses PP > 1)
            assert len(a.stages) == 1 and len(set(a.nodes)) == 1 and a.stages[0].gpus == tuple(range(8))
        if a.model == "llama-3.1-70b-instruct":
            assert len(a.gpus) == 4 and a.bytes_per_gpu == int(0.9 * 80 * 2**30)
    spread = plan.spread()
    assert sorted(spread["llama-3.1-70b-instruct"].values()) == [4] * 16
    assert set(spread["llama-3.1-8b-instruct"].values()) == {125}
    assert sorted(Counter(spread["mistral-7b-instruct"].values()).items()) == [(62, 8), (63, 8)]
    assert max(plan.replicas_per_node().values()) <= 16


def test_replica_ids_are_readable_and_numbered_from_zero(exa256):
    _, plan = exa256
    ids = [a.replica_id for a in plan.assignments if a.model == "llama-3.1-8b-instruct"]
    assert "llama-3.1-8b-instruct/r0042" in ids
    assert sorted(replica_index(r) for r in ids) == list(range(2000))


@pytest.mark.parametrize("name, replicas, per_node_max", [("local", 2, 2), ("slurm-local", 4, 1), ("small16-a100", 192, 16)])
def test_small_sites_place_everything(name, replicas, per_node_max):
    site = load_site(SITES / f"{name}.yaml")
    plan = plan_site(site)
    assert len(plan.assignments) == replicas and not plan.unplaced
    assert max(plan.replicas_per_node().values()) <= per_node_max
    assert plan_violations(plan, topology_from_site(site), catalogue_from_site(site),
                           site.scheduler.max_replicas_per_node) == []


def test_cpu_site_uses_host_memory_as_one_device():
    # four CPU nodes in two fault groups (slurm-local declares stand-in GPUs now)
    site = parse_site({"site": "cpu4", "cluster": {"nodes": 4, "nodelist": "n[1-4]", "gpus_per_node": 0,
                                                   "fault_groups": {"rack-a": "n[1-2]", "rack-b": "n[3-4]"}},
                       "models": [{"model_name": "tiny-llama", "replicas": 4, "max_seq_len": 1024,
                                   "tiny": {"max_position": 1024}}]})
    plan = plan_site(site)
    assert all(a.gpus == (0,) for a in plan.assignments)
    assert all(len(v) == 1 and v[0] == 64 * 2**30 for v in plan.memory_total.values())
    assert sorted(plan.spread()["tiny-llama"].values()) == [2, 2]


def _site(models, **cluster):
    base = {"nodes": 4, "gpus_per_node": 8, "gpu_memory": "80GiB", "fault_group_size": 2}
    return parse_site({"site": "t", "cluster": {**base, **cluster}, "models": models,
                       "scheduler": {"max_replicas_per_node": 16}})


@pytest.mark.parametrize("model, expect", [
    ({"tensor_parallel": 8}, "tensor_parallel 8 needs 8 devices in one NVLink domain"),
    ({"pipeline_parallel": 3}, "pipeline_parallel 3 needs 3 nodes in one fault group"),
    ({"weight_bytes": "200GB", "gpu_memory_utilization": 0.5}, "raise gpu_memory_utilization"),
])
def test_impossible_shapes_are_unplaced_with_the_reason(model, expect):
    site = _site([{"model_name": "big", "replicas": 3, **model}], nvlink_domain_size=4)
    plan = plan_site(site)
    assert plan.assignments == []
    assert [(u.model, u.count) for u in plan.unplaced] == [("big", 3)]
    assert expect in plan.unplaced[0].reason


def test_out_of_capacity_places_what_fits_and_says_why():
    site = _site([{"model_name": "m", "replicas": 40, "tensor_parallel": 2, "gpu_memory_utilization": 0.9}])
    plan = plan_site(site)
    assert len(plan.assignments) == 16  # 4 nodes x 4 pairs of GPUs
    assert plan.unplaced[0].count == 24 and "out of capacity" in plan.unplaced[0].reason
    assert sorted(plan.spread()["m"].values()) == [8, 8]


def test_replica_cap_is_the_stated_reason_when_it_binds():
    site = parse_site({"site": "t", "cluster": {"nodes": 2, "gpus_per_node": 8, "gpu_memory": "80GiB"},
                       "scheduler": {"max_replicas_per_node": 3},
                       "models": [{"model_name": "s", "replicas": 10, "gpu_memory_utilization": 0.1}]})
    plan = plan_site(site)
    assert len(plan.assignments) == 6
    assert "max_replicas_per_node (3)" in plan.unplaced[0].reason


def test_small_models_share_gpus_by_fraction():
    site = parse_site({"site": "t", "cluster": {"nodes": 1, "gpus_per_node": 1, "gpu_memory": "80GiB"},
                       "models": [{"model_name": "s", "replicas": 4, "gpu_memory_utilization": 0.3}]})
    plan = plan_site(site)
    assert len(plan.assignments) == 3 and plan.unplaced_count("s") == 1
    assert plan.memory_used["node0"] == [3 * int(0.3 * 80 * 2**30)]
