"""One fleet on the local Slurm cluster (issue 12): the running job places as `exaserve plan` does, a
lost node's replicas are re-placed keeping the fault-group spread, and a pipeline-parallel replica
spanning two nodes serves the tokens of the unsplit model.

The site: slurm-local's two fault groups of two nodes (rack-a n1-n2, rack-b n3-n4), 4 GRES GPUs per
node (stand-in devices: declared to the planner, bound to each replica, computed on the CPU); models
with TP=2 and fractional replicas (echo engine, fast to start on two shared cores), and one tiny
reference checkpoint served twice, as PP=2 and as PP=1: the Llama-3-style Hugging Face one transformers wrote
(tests/fixtures/hf/llama3, BPE tokenizer and chat template), put in the store by `exaserve model import`.
Marked slurm: under CI=true it must run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from exaserve_hpc.cache.model_import import import_model
from exaserve_hpc.engine.hf_tokenizer import HfTokenizer
from exaserve_hpc.config.schema import load_site
from exaserve_hpc.controller.catalogue import catalogue_from_site
from exaserve_hpc.controller.invariants import plan_violations
from exaserve_hpc.controller.plan import Assignment, Plan, Stage
from exaserve_hpc.topology import topology_from_site

from .fleet import (ROOT, Job, RequestStream, check_devices, cluster, environ, kill_and_watch, node_processes,
                    remove_shared_dir, shared_dir, submit, wait_serving)

pytestmark = [pytest.mark.slurm, pytest.mark.process]

HF_FIXTURE = ROOT / "tests" / "fixtures" / "hf" / "llama3"
GOLDEN = json.loads((HF_FIXTURE.parent / "golden.json").read_text())["families"]["llama3"]
MODELS = [
    {"model_name": "tp2", "engine": "echo", "replicas": 2, "tensor_parallel": 2, "gpu_memory_utilization": 0.9},
    {"model_name": "frac", "engine": "echo", "replicas": 4, "gpu_memory_utilization": 0.4},
    {"model_name": "pp2", "engine": "reference", "replicas": 1, "pipeline_parallel": 2, "max_seq_len": 256,
     "gpu_memory_utilization": 0.5},
    {"model_name": "pp1", "engine": "reference", "replicas": 1, "max_seq_len": 256, "gpu_memory_utilization": 0.5},
]
REPLICAS = sum(m["replicas"] for m in MODELS)  # a PP=2 replica counts once (stage 0 registers)
KILLED = "n3"  # holds a tp2 and a frac replica (each model has another one serving), not the PP replicas


def fleet_site(directory: Path) -> Path:
    """slurm-local with MODELS; pp1 and pp2 read the same Hugging Face checkpoint, imported here once."""
    data = yaml.safe_load((ROOT / "site-configs" / "slurm-local.yaml").read_text())
    checkpoint = import_model(HF_FIXTURE, directory / "models", "llama3-tiny")
    models = []
    for model in MODELS:
        model = {**model, "min_replicas": model["replicas"]}  # no autoscaling mid-test
        if model["engine"] == "reference":
            model.update(model_path=str(checkpoint))
        models.append(model)
    data["models"] = models
    data["scheduler"]["max_replicas_per_node"] = 4
    data["weight_cache"]["l3_path"] = str(directory / "models")
    data["run_dir"] = str(directory / "run")
    data.setdefault("gateway", {})["host"] = "0.0.0.0"
    path = directory / "site.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def fleet(slurm_cluster):
    directory = shared_dir("placement")
    site = fleet_site(directory)
    job = submit(site, directory / "jobs", nodes=4)
    try:
        wait_serving(job, agents=4, replicas=REPLICAS, timeout=180)
        yield job, site
    finally:
        job.cancel_and_wait()
        cluster("revive-node", KILLED, check=False)
        remove_shared_dir(directory)


def cli_json(*args: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", *args], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, (args, result.stdout, result.stderr)
    return json.loads(result.stdout)


def placed(status: dict) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """replica id -> [(node, gpus) per pipeline stage], for every serving replica in `status`."""
    return {r["replica_id"]: [(s["node"], tuple(s["gpus"])) for s in r["stages"]]
            for r in status["replicas"] if r["state"] == "serving"}


def as_plan(site_path: Path, status: dict, down: set[str]) -> tuple[Plan, object, dict]:
    """The serving placement in `status` as a Plan over the site's declared topology (what `exaserve
    plan` sees), so plan_violations audits it independently of the controller."""
    site = load_site(site_path)
    topology, catalogue = topology_from_site(site), catalogue_from_site(site)
    used = {n.name: [0] * len(n.devices) for n in topology.nodes}
    assignments = []
    for rid, stages in placed(status).items():
        spec = catalogue[rid.split("/r")[0]]
        first = topology.node(stages[0][0]).devices[stages[0][1][0]]
        reserved = spec.reservation(first)
        for node, gpus in stages:
            for d in gpus:
                used[node][d] += reserved
        assignments.append(Assignment(rid, spec.name, tuple(Stage(n, g) for n, g in stages), reserved,
                                      reserved / first.memory))
    plan = Plan(site.site, assignments, used, {n.name: [d.memory for d in n.devices] for n in topology.nodes},
                {n.name: n.fault_group for n in topology.nodes}, down_nodes=frozenset(down))
    return plan, topology, catalogue


def test_status_shows_the_placement_exaserve_plan_computes(fleet):
    job, site = fleet
    planned = cli_json("plan", "--site", str(site), "--json", "-")
    assert not planned["unplaced"], planned["unplaced"]
    expected = {a["replica_id"]: [(s["node"], tuple(s["gpus"])) for s in a["stages"]] for a in planned["assignments"]}
    # The site really exercises what it claims: TP=2 devices, a PP=2 replica on two nodes, shared GPUs.
    assert any(len(stages[0][1]) == 2 for stages in expected.values())
    assert any(len({n for n, _ in stages}) == 2 for stages in expected.values())

    status = cli_json("status", "--run-dir", str(job.job_dir), "--json")
    assert placed(status) == expected, json.dumps(status["replicas"], indent=1)[:4000]
    for r in status["replicas"]:  # stage 0's node and devices, as status also shows them
        assert (r["node"], tuple(r["gpus"])) == expected[r["replica_id"]][0]
    assert status["placement"]["violations"] == []
    plan, topology, catalogue = as_plan(site, status, set())
    assert plan_violations(plan, topology, catalogue, 4) == []
    # Each serving process holds the devices status names, within its node's Slurm grant.
    check_devices(status, {m["model_name"]: m["gpu_memory_utilization"] for m in MODELS})


def complete(job: Job, model: str, prompt: str, max_tokens: int = 12) -> str:
    response = httpx.post(f"{job.url()}/v1/completions", timeout=60,
                          json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_a_pipeline_replica_spanning_two_nodes_serves_the_tokens_of_the_unsplit_model(fleet):
    job, _ = fleet
    status = job.status()
    (pp2,) = [r for r in status["replicas"] if r["model"] == "pp2"]
    stage_nodes = [s["node"] for s in pp2["stages"]]
    assert pp2["state"] == "serving" and len(set(stage_nodes)) == 2, pp2
    # Stage 1 runs as its own replica process on the other node (started there by that node's agent),
    # bound to the devices its stage was planned (the spec travels hex-encoded on the command line).
    other, gpus = stage_nodes[1], pp2["stages"][1]["gpus"]
    mine = "pp2/r0000".encode().hex().encode()
    stage = []
    for pid in node_processes(other):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"exaserve_hpc.agent.replica_main" in cmdline and mine in cmdline:
            stage.append(pid)
    assert len(stage) == 1, f"stage 1 of pp2 on {other}: processes {stage}"
    assert environ(stage[0]).get("CUDA_VISIBLE_DEVICES") == ",".join(str(g) for g in gpus)
    for prompt in ("Pipeline stages on two nodes, one replica.", "A second, different prompt"):
        split, whole = complete(job, "pp2", prompt), complete(job, "pp1", prompt)
        assert split and split == whole, (prompt, split, whole)
    # The model's own tokens through both: transformers' greedy continuation of its golden prompt
    tokenizer = HfTokenizer.from_dir(HF_FIXTURE)
    assert complete(job, "pp2", GOLDEN["prompt_text"]) == tokenizer.decode(GOLDEN["greedy_ids"][:12])
    chat = [c for c in GOLDEN["chat"] if c.get("add_generation_prompt") and "ids" in c][1]["messages"]
    answers = []
    for model in ("pp2", "pp1"):
        response = httpx.post(f"{job.url()}/v1/chat/completions", timeout=60,
                              json={"model": model, "messages": chat, "max_tokens": 12, "temperature": 0})
        assert response.status_code == 200, response.text
        answers.append((response.json()["choices"][0]["message"]["content"], response.json()["usage"]))
    assert answers[0] == answers[1] and answers[0][1]["prompt_tokens"] == len(
        [c for c in GOLDEN["chat"] if c.get("add_generation_prompt") and "ids" in c][1]["ids"]), answers


def test_a_lost_node_is_re_placed_keeping_the_spread_and_no_request_fails(fleet):
    job, site = fleet
    before = placed(wait_serving(job, agents=4, replicas=REPLICAS))
    on_killed = {rid for rid, stages in before.items() if any(n == KILLED for n, _ in stages)}
    assert on_killed and not any(rid.startswith("pp") for rid in on_killed), before
    stream = RequestStream(job.url(), workers=3, interval=0.1, models=("tp2", "frac")).start().flowing()
    timings, status = kill_and_watch(job, KILLED, REPLICAS, stream)
    print(f"\nfleet failover on the local cluster: {timings.report()}")
    assert timings.serving_at, f"replicas not serving again; status {json.dumps(status)[:3000]}"
    after = placed(status)
    assert set(after) == set(before) and not any(n == KILLED for s in after.values() for n, _ in s)
    assert {rid for rid in after if after[rid] != before[rid]} == on_killed  # only the lost node's moved
    plan, topology, catalogue = as_plan(site, status, {KILLED})
    assert plan_violations(plan, topology, catalogue, 4) == [], after
    assert status["placement"]["violations"] == []
    assert stream.sent > 20 and not stream.failed, [o.detail for o in stream.failed][:5]
