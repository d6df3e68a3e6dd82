"""`exaserve plan` output and --json; topology from config and from inventory."""

from __future__ import annotations

import argparse
import json

import pytest

from exaserve_hpc.config.schema import load_site
from exaserve_hpc.controller.plan_report import add_plan_arguments, cmd_plan
from exaserve_hpc.topology import DEFAULT_HOST_MEMORY, topology_from_inventory, topology_from_site

GiB = 2**30


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return parser.parse_args(list(argv))


def test_plan_prints_tables_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert cmd_plan(_args("--site", "exa256-a100", "--json", str(out))) == 0
    text = capsys.readouterr().out
    for needle in ("replicas per model", "llama-3.1-405b-instruct", "3072", "spread per fault group", "rack15",
                   "device memory use", "every replica placed"):
        assert needle in text
    data = json.loads(out.read_text())
    assert data["replicas"] == 3072 and len(data["assignments"]) == 3072
    assert data["spread"]["llama-3.1-70b-instruct"]["rack00"] == 4
    assert data["assignments"][0]["stages"][0]["gpus"] and data["unplaced"] == []


def test_plan_reports_what_could_not_be_placed(tmp_path, capsys):
    site = tmp_path / "tight.yaml"
    site.write_text("site: tight\ncluster: {nodes: 1, gpus_per_node: 2, gpu_memory: 80GiB}\n"
                    "models: [{model_name: big, replicas: 2, tensor_parallel: 4}]\n")
    assert cmd_plan(_args("--site", str(site))) == 1
    text = capsys.readouterr().out
    assert "could not be placed" in text and "tensor_parallel 4 needs 4 devices" in text


def test_plan_capacity_prints_the_room_left_beside_the_plan(tmp_path, capsys):
    site = tmp_path / "room.yaml"
    site.write_text("site: room\ncluster: {nodes: 2, gpus_per_node: 4, gpu_memory: 80GiB}\n"
                    "scheduler: {max_replicas_per_node: 16}\n"
                    "models: [{model_name: half, replicas: 2, gpu_memory_utilization: 0.5},"
                    " {model_name: whole, replicas: 1, tensor_parallel: 4, gpu_memory_utilization: 0.9}]\n")
    assert cmd_plan(_args("--site", str(site), "--capacity")) == 0
    rows = {line.split("│")[1].strip(): line for line in capsys.readouterr().out.splitlines()
            if line.count("│") >= 3 and ("half" in line or "whole" in line) and "out of capacity" in line}
    # The TP=4 replica holds node0's 4 GPUs at 0.9 (8 GiB left on each: no half fits there); both halves pack
    # onto one GPU of node1, whose 3 other GPUs take 2 halves each: 6 more; no free domain of 4 for a TP=4
    assert rows["half"].split("│")[2].strip() == "6" and rows["whole"].split("│")[2].strip() == "0"


def test_config_error_goes_to_stderr_with_status_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("site: bad\ncluster: {nodes: 0}\nmodels: [{model_name: m}]\n")
    assert cmd_plan(_args("--site", str(bad))) == 2
    err = capsys.readouterr().err
    assert "cluster.nodes" in err
    assert cmd_plan(_args("--site", "no-such-site")) == 2
    assert "exa256-a100" in capsys.readouterr().err


def test_topology_from_site_gpu_and_cpu(tmp_path):
    from pathlib import Path
    sites = Path(__file__).resolve().parents[3] / "site-configs"
    exa = topology_from_site(load_site(sites / "exa256-a100.yaml"))
    assert len(exa.nodes) == 256 and len(exa.groups) == 16 and exa.largest_domain == 8
    assert exa.latency_us("gpu001", "gpu001") == 0 < exa.latency_us("gpu001", "gpu002") < exa.latency_us("gpu001", "gpu017")
    cpu = topology_from_site(load_site(sites / "local.yaml"))
    (node,) = cpu.nodes
    assert node.is_cpu and node.devices[0].memory == DEFAULT_HOST_MEMORY and node.nvlink_domains == ((0,),)


def test_topology_from_inventory():
    inv = [{"hostname": "a", "fault_group": "r0",
            "gpus": [{"index": i, "memory": "80GiB", "nvlink_domain": i // 4} for i in range(8)]},
           {"hostname": "b", "host_memory": "128GiB"}]
    topo = topology_from_inventory(inv)
    a, b = topo.nodes
    assert a.nvlink_domains == ((0, 1, 2, 3), (4, 5, 6, 7)) and a.devices[0].memory == 80 * GiB
    assert b.is_cpu and b.devices[0].memory == 128 * GiB and b.fault_group == "ungrouped-b"
    with pytest.raises(ValueError, match="hostname"):
        topology_from_inventory([{"gpus": []}])
    with pytest.raises(ValueError, match="not 0..1"):
        topology_from_inventory([{"hostname": "x", "gpus": [{"index": 0, "memory": 1}, {"index": 2, "memory": 1}]}])
