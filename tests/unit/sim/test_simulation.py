"""The simulator end to end on small16-a100: the real controller and dispatcher in simulated time."""

from __future__ import annotations

import json

import pytest

from exaserve_hpc.cli import main as cli
from exaserve_hpc.config.schema import load_site, resolve_site
from exaserve_hpc.engine.timing import timings_for
from exaserve_hpc.controller import autoscale
from exaserve_hpc.sim.capacity_check import sized_site
from exaserve_hpc.sim.replica import SharedGpus, SimReplica, SimSeq
from exaserve_hpc.sim.simulation import Simulation
from exaserve_hpc.sim.workload import WorkloadError, load_workload, parse_workload

SMALL = "small16-a100"


def small_site(**router):
    site = load_site(resolve_site(SMALL))
    if not router:
        return site
    data = site.model_dump(mode="json", exclude_none=True)
    data["router"].update(router)
    from exaserve_hpc.config.schema import parse_site
    return parse_site(data)


def test_cli_simulate_writes_report_and_loses_nothing(tmp_path):
    out = tmp_path / "report"
    assert cli.main(["simulate", "--site", SMALL, "--workload", "tiny", "--out", str(out)]) == 0
    data = json.loads((out / "report.json").read_text())
    s = data["summary"]
    assert s["accepted"] > 3000 and s["completed"] == s["accepted"] and s["lost"] == 0 and s["failed"] == 0
    assert s["nodes_lost"] == ["gpu02"]  # the workload's fault, found by the controller from missing heartbeats
    assert any("gpu02 lost" in text for _, text in s["events"])
    assert 192 <= s["replicas_placed_max"] <= 200  # the plan, placed by the controller (+ rebalance moves in flight)
    for name in ("report.md", "latency.png", "utilisation.png", "replicas.png", "queue.png", "prefix.png",
                 "failures.png"):
        assert (out / name).stat().st_size > 500, name
    assert "## Failures and recovery" in (out / "report.md").read_text()
    model = s["by_model"]["llama-3.1-8b-instruct"]
    assert model["completed"] == s["completed"] and model["ttft_p99_s"] == pytest.approx(s["ttft_p99_s"])


def test_static_keeps_the_plan_and_dynamic_scales_down():
    wl = load_workload("tiny")
    static = Simulation(small_site(), wl, duration=180, static=True)
    static.run()
    dynamic = Simulation(small_site(), wl, duration=150)  # scale-down waits for the first rebalance moves
    dynamic.run()
    smallest = lambda sim: min(s.replicas["llama-3.1-8b-instruct"] for s in sim.rec.samples)  # noqa: E731
    # the lost node's replicas are missing only until the controller has re-placed them
    assert smallest(static) >= 128 - 16 and static.rec.samples[-1].replicas["llama-3.1-8b-instruct"] == 128
    assert smallest(dynamic) < 20  # the autoscaler's scale-down at 40 req/s


def test_changing_the_autoscaler_changes_the_simulation(monkeypatch):
    """The simulator runs the controller's own autoscaler: a patched decision rule shows in the outcome."""
    wl = load_workload("tiny")

    def hold(load, policy, history, now):
        return autoscale.ScaleDecision(load.model, load.replicas, load.replicas, load.load, "patched: hold")
    monkeypatch.setattr(autoscale, "decide", hold)
    sim = Simulation(small_site(), wl, duration=180)
    sim.run()
    assert min(s.replicas["llama-3.1-8b-instruct"] for s in sim.rec.samples) >= 128 - 16
    assert sim.rec.samples[-1].replicas["llama-3.1-8b-instruct"] == 128


def test_routing_policy_changes_prefix_hits():
    wl = load_workload("tiny")
    hits = {}
    for policy in ("round_robin", "prefix_affinity"):
        sim = Simulation(small_site(policy=policy), wl, duration=100)
        s = sim.run()
        assert s["lost"] == 0
        hits[policy] = sum(r.hit_tokens for r in sim.replicas.values()) / max(
            1, sum(r.query_tokens for r in sim.replicas.values()))
    assert hits["prefix_affinity"] > hits["round_robin"] + 0.05, hits


def test_replica_model_times_and_prefix_cache():
    t = timings_for("a100-80gb")
    r = SimReplica("m/r0", "m", t, max_batch=8, kv_tokens=100_000, block_tokens=64, chunk_tokens=512,
                   step_tokens=8192, gpus=(("n", 0),), shared=SharedGpus())
    blocks = tuple(range(8))
    assert r.add(SimSeq("a", 600, 3, blocks), 0.0)
    events, now = [], 0.0
    while r.busy:
        now = r.busy_until
        events += [(k, s.request_id, now) for k, s in r.wake(now)]
    assert [k for k, _, _ in events] == ["first", "done"]
    assert r.shared.slot_s == pytest.approx(r.shared.work_s / 8)  # one sequence of a batch of 8 all along
    first = events[0][2]
    # two prefill steps (512 + 88 tokens) then two decode steps
    assert first == pytest.approx(2 * t.step_overhead_s + 600 * t.prefill_per_token_s, rel=0.05)
    r.add(SimSeq("b", 600, 1, blocks), now)
    assert r.hit_tokens == 512  # the 8 cached blocks
    r.abort("b")
    assert r.load() == 0 and r.used == 0


def test_workload_errors_name_the_key():
    with pytest.raises(WorkloadError, match="streams\\[0\\].kind"):
        parse_workload({"streams": [{"model": "m", "kind": "poisson", "qps": 1}]})
    with pytest.raises(WorkloadError, match="faults\\[0\\].kind.*node_loss"):
        parse_workload({"streams": [{"model": "m", "qps": 1}], "faults": [{"at": 1, "kind": "meteor"}]})
    with pytest.raises(WorkloadError, match="no workload file"):
        load_workload("no-such-workload")


def test_capacity_answers_and_the_simulator_checks(tmp_path):
    answer = tmp_path / "capacity.json"
    code = cli.main(["capacity", "--site", SMALL, "--workload", "tiny", "--check", "--duration", "60",
                     "--json", str(answer)])
    data = json.loads(answer.read_text())
    models = {m["model"]: m for m in data["models"]}
    assert models["llama-3.1-8b-instruct"]["replicas"] >= 4
    assert data["check"]["lost"] == 0
    assert code == (0 if data["check"]["slo_held"] else 1)
    site = sized_site(small_site(), {"llama-3.1-8b-instruct": 7})
    assert site.initial_replicas(site.model("llama-3.1-8b-instruct")) == 7


def test_fault_group_and_controller_node_loss_requeue_decision():
    """A whole fault group lost, then rank 0's node: the controller re-places, the requeue policy decides."""
    wl = parse_workload({"duration": "90s", "streams": [{"model": "llama-3.1-8b-instruct", "qps": 30}],
                         "faults": [{"at": "10s", "kind": "fault_group_loss", "group": "rack03"},
                                    {"at": "40s", "kind": "controller_node_loss"}]})
    sim = Simulation(small_site(), wl)
    s = sim.run()
    assert s["lost"] == 0 and s["accepted"] > 2000
    assert set(s["nodes_lost"]) == {"gpu01", "gpu13", "gpu14", "gpu15", "gpu16"}
    assert s["requeue"]["reason"] == "controller-node-lost" and "gpu01" in s["requeue"]["exclude"]
    live = [r for r in sim.ctl.replicas.values() if r.assignment is not None]
    assert not any(set(r.assignment.nodes) & set(s["nodes_lost"]) for r in live)  # every replica re-placed


@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
def test_every_accepted_request_completes_through_exa256s_faults_at_small_scale(static):
    """bench_simulator's exa256 faults (a slow node, a node, a whole fault group, then the controller's node)
    on small16 under load: requests in flight on the lost nodes are retried by the real dispatcher, none
    is lost or failed; dynamic adds the autoscaler's scale-downs (drains) on top."""
    wl = parse_workload({"duration": "60s", "streams": [
        {"model": "llama-3.1-8b-instruct", "qps": 150, "prefix_groups": {"count": 50, "system_tokens": 256},
         "output_tokens": {"mean": 150, "sigma": 0.6, "max": 1024}},
        {"model": "mistral-7b-instruct", "qps": 60}],
        "faults": [{"at": "5s", "kind": "slow_node", "node": "gpu03", "factor": 3},
                   {"at": "10s", "kind": "node_loss", "node": "gpu06"},
                   {"at": "20s", "kind": "fault_group_loss", "group": "rack02"},
                   {"at": "40s", "kind": "controller_node_loss"}]})
    sim = Simulation(small_site(), wl, static=static)
    s = sim.run()
    assert s["accepted"] > 10_000 and s["retries"] > 50  # the lost nodes held requests, which moved
    assert s["lost"] == 0 and s["failed"] == 0 and s["completed"] == s["accepted"], s["errors"]
    assert set(s["nodes_lost"]) == {"gpu01", "gpu06", "gpu09", "gpu10", "gpu11", "gpu12"}


def test_changing_the_spread_rule_changes_the_simulation(monkeypatch):
    """The simulator places with the controller's own Placer: a patched group order (pack a model into the
    group already holding most of it, instead of spreading it) shows in where the replicas run and in how
    many of them the loss of that fault group takes down."""
    from exaserve_hpc.controller import placement
    model = "llama-3.1-8b-instruct"

    def run():
        """Replicas of the model in its fullest fault group, and how many serving the loss of that group cost."""
        quiet = parse_workload({"duration": "5s", "streams": [{"model": model, "qps": 5}]})
        sim = Simulation(small_site(), quiet, static=True)
        sim.run()
        groups = sim.ctl.fleet.group_of()
        per_group = {}
        for r in sim.ctl.replicas.values():
            if r.model == model and r.agent_id:
                per_group[groups[r.agent_id]] = per_group.get(groups[r.agent_id], 0) + 1
        fullest = max(per_group, key=per_group.get)
        wl = parse_workload({"duration": "30s", "streams": [{"model": model, "qps": 20}],
                             "faults": [{"at": "10s", "kind": "fault_group_loss", "group": fullest}]})
        sim = Simulation(small_site(), wl, static=True)
        s = sim.run()
        assert s["lost"] == 0
        serving = [x.replicas[model] for x in sim.rec.samples]
        return per_group[fullest], serving[0] - min(serving)

    assert run() == (32, 32)  # 128 replicas spread over 4 groups: a group's loss costs its share
    spread = placement.Placer._group_key

    def pack(self, model, g):
        key = spread(self, model, g)
        return (-key[0],) + key[1:]
    monkeypatch.setattr(placement.Placer, "_group_key", pack)
    held, cost = run()
    assert held > 40 and cost == held, (held, cost)


def test_a_long_decode_reports_progress_within_the_stall_limit():
    """A replica that reported only the first and the last token of a 70 s decode would look stalled to the
    router (stall_timeout 60 s) and the request would move three times and fail: the small16-diurnal
    hour lost requests so. Progress comes every progress_every seconds and no decode segment is longer."""
    t = timings_for("a100-80gb")
    r = SimReplica("m/r0", "m", t, max_batch=8, kv_tokens=1_000_000, block_tokens=64, chunk_tokens=512,
                   step_tokens=8192, gpus=(("n", 0),), shared=SharedGpus(), slow=200.0, progress_every=10.0)
    r.add(SimSeq("a", 100, 1000, ()), 0.0)
    reports, now = [], 0.0
    while r.busy:
        assert r.busy_until - now <= 10.0 + 1e-9 or r.steps == 0
        now = r.busy_until
        reports += [(now, k, s.progress if k == "progress" else 0) for k, s in r.wake(now)]
    kinds = [k for _, k, _ in reports]
    assert kinds[0] == "first" and kinds[-1] == "done" and kinds.count("progress") >= 5
    assert now > 60  # the decode outlasted the stall limit
    times = [at for at, _, _ in reports]
    assert max(b - a for a, b in zip(times, times[1:])) < 21  # never silent for long
    assert 1 + sum(n for _, k, n in reports if k == "progress") < 1000  # the finish carries the rest


def test_a_slow_replica_reports_its_step_time_and_runs_repeat():
    """Replicas report an EWMA of their step time as real ones do (the router's cost weighs it, so a slow
    node gets less work); the policy's random draws come from the seed, so a run repeats exactly."""
    t = timings_for("a100-80gb")
    ewma = {}
    for slow in (1.0, 3.0):
        r = SimReplica("m/r0", "m", t, max_batch=8, kv_tokens=100_000, block_tokens=64, chunk_tokens=512,
                       step_tokens=8192, gpus=(("n", 0),), shared=SharedGpus(), slow=slow)
        r.add(SimSeq("a", 600, 50, ()), 0.0)
        while r.busy:
            r.wake(r.busy_until)
        ewma[slow] = r.latency_ewma_ms
    assert ewma[3.0] == pytest.approx(3 * ewma[1.0]) and ewma[1.0] > 0
    wl = parse_workload({"duration": "20s", "streams": [{"model": "llama-3.1-8b-instruct", "qps": 30,
                                                         "prefix_groups": {"count": 5, "system_tokens": 256}}]})
    runs = [Simulation(small_site(policy="power_of_two"), wl, seed=3).run() for _ in range(2)]
    assert runs[0]["accepted"] > 400
    assert [r["ttft_mean_s"] for r in runs] == [runs[0]["ttft_mean_s"]] * 2


def test_replica_model_caches_a_prompt_when_its_prefill_ends_and_decodes_take_the_step_budget_first():
    """A prompt's blocks are reusable once its prefill is done (not when the request ends), pinned while it
    runs; the decoding sequences take their tokens of the step budget before any prefill chunk."""
    t = timings_for("a100-80gb")
    r = SimReplica("m/r0", "m", t, max_batch=8, kv_tokens=100_000, block_tokens=64, chunk_tokens=1024,
                   step_tokens=520, gpus=(("n", 0),), shared=SharedGpus())
    blocks = tuple(range(8))
    r.add(SimSeq("a", 512, 1000, blocks), 0.0)
    kinds = []
    while "first" not in kinds:
        kinds += [k for k, _ in r.wake(r.busy_until)]
    assert r.n_decoding == 1 and set(r.pinned) == set(blocks)  # decoding: its blocks are cached and pinned
    r.add(SimSeq("b", 2000, 5, blocks + (100, 101)), r.busy_until)
    r.wake(r.busy_until)  # the decode step under way when "b" came; then "b" is admitted
    assert r.hit_tokens == 512  # reused while "a" still decodes
    r.wake(r.busy_until)  # "b"'s first chunk: the budget of 520 less "a"'s decode token
    assert r.prefilling[0].done == 512 + 519
    r.abort("a")
    assert set(r.pinned) == set(blocks)  # still "b"'s
    r.abort("b")
    assert r.pinned == {} and r.used == 0
