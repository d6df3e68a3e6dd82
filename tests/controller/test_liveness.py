"""The node-loss rule (controller/liveness.py) and the CPU bound on replicas per node (controller/cpu_bound.py):
pure functions, then the controller feeding them (a starved heartbeat thread whose replicas still stream is not
a lost node) and placement honouring the bound (no 16 CPU replicas on 2 cores)."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml  # noqa: E402

from exaserve_hpc.agent.replica_process import replica_threads
from exaserve_hpc.app.agent_supervisor import process_running
from exaserve_hpc.config.schema import parse_site  # noqa: E402
from exaserve_hpc.protocol import AgentHeartbeat, AgentHello  # noqa: E402
from exaserve_hpc.router.port import RouterPortStub
from exaserve_hpc.controller.core import ControllerCore  # noqa: E402
from exaserve_hpc.controller.cpu_bound import cpu_replica_slots, node_replica_cap
from exaserve_hpc.controller.liveness import ALIVE, LOST, SUSPECT, Evidence, Lateness, adaptive_grace, judge

# ---------------------------------------------------------------- judge

def test_heard_within_expiry_is_alive_then_suspect_for_the_grace_then_lost():
    assert judge(10.0, Evidence(heard_at=8.0), expiry=3, grace=1).state == ALIVE
    assert judge(11.5, Evidence(heard_at=8.0), expiry=3, grace=1).state == SUSPECT
    lost = judge(12.5, Evidence(heard_at=8.0), expiry=3, grace=1)
    assert lost.state == LOST and lost.silent == 4.5 and "every channel" in lost.why


def test_a_replica_heard_at_the_router_keeps_a_node_with_a_starved_agent_alive():
    # the agent's heartbeats are 20 s old, but one of its replicas streamed a token 0.5 s ago
    verdict = judge(100.0, Evidence(heard_at=80.0, other_at=99.5), expiry=3, grace=1)
    assert verdict.state == ALIVE and "replicas" in verdict.why
    # ...and once every channel is silent, the usual rule applies to the latest of them
    assert judge(103.2, Evidence(heard_at=80.0, other_at=99.5), expiry=3, grace=1).state == SUSPECT
    assert judge(104.6, Evidence(heard_at=80.0, other_at=99.5), expiry=3, grace=1).state == LOST


def test_a_running_agent_process_is_alive_however_late_and_a_gone_one_gets_no_grace():
    assert judge(1000.0, Evidence(heard_at=0.0, process=True), expiry=3, grace=1).state == ALIVE
    assert judge(3.5, Evidence(heard_at=0.0, process=False), expiry=3, grace=30).state == LOST
    assert judge(2.0, Evidence(heard_at=0.0, process=False), expiry=3, grace=30).state == ALIVE  # heard lately
    # unknown (a remote node, a stopped process): the channels decide
    assert judge(3.5, Evidence(heard_at=0.0, process=None), expiry=3, grace=1).state == SUSPECT


# ---------------------------------------------------------------- the adaptive grace

def test_grace_widens_with_observed_heartbeat_lateness_up_to_a_cap():
    beats = Lateness(interval=1.0)
    for t in (0.0, 1.0, 2.0, 3.05):
        beats.arrived(t)
    assert abs(beats.worst() - 0.05) < 1e-9
    assert adaptive_grace(1.0, beats.worst(), expiry=3.0) == 1.0  # a quiet machine keeps the configured grace
    beats.arrived(7.05)  # a beat 3 s late: the scheduler is starving the agent
    assert abs(beats.worst() - 3.0) < 1e-9
    assert adaptive_grace(1.0, beats.worst(), expiry=3.0) == 9.0  # 3 x the worst lateness
    assert adaptive_grace(1.0, 60.0, expiry=3.0) == 30.0  # at most 10 expiries
    assert adaptive_grace(45.0, 60.0, expiry=3.0) == 45.0  # never below what the site configured


def test_the_window_forgets_old_lateness():
    beats = Lateness(interval=1.0, window=4)
    beats.arrived(0.0)
    beats.arrived(6.0)  # 5 s late
    for i in range(4):
        beats.arrived(7.0 + i)
    assert beats.worst() == 0.0


def test_process_running_reads_proc():
    assert process_running(os.getpid()) is True
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert process_running(child.pid) is False  # reaped: gone
    assert process_running(0) is None


# ---------------------------------------------------------------- the CPU bound

def test_cpu_slots_are_cores_over_threads_at_least_one_and_unbounded_when_unknown():
    assert cpu_replica_slots(2, 1) == 2
    assert cpu_replica_slots(16, 4) == 4
    assert cpu_replica_slots(2, 8) == 1  # a node too small for one still runs one
    assert cpu_replica_slots(0, 1) == 0  # cores unknown: no bound
    assert node_replica_cap(16, 2) == 2 and node_replica_cap(16, 0) == 16 and node_replica_cap(3, 8) == 3


def test_replica_threads_reads_the_blas_variables():
    assert replica_threads({}) == 1
    assert replica_threads({"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "4"}) == 4
    assert replica_threads({"OMP_NUM_THREADS": "many"}) == 1


# ---------------------------------------------------------------- the controller feeding them



ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


class Router(RouterPortStub):
    """The controller's view of the router: replica_silent_s is the second channel."""
    backend_endpoint, frontend_endpoint = "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"

    def __init__(self):
        self.silent: dict[str, float] = {}
        self.lost: list[str] = []

    def snapshot(self) -> dict:
        return {"replicas": [], "replica_silent_s": dict(self.silent)}

    def replica_lost(self, replica_id: str, why: str) -> None:
        self.lost.append(replica_id)

    def drain(self, replica_id: str) -> None:
        pass


def controller(tmp_path, replicas: int = 2, max_per_node: int = 16, grace=None):
    data = yaml.safe_load((ROOT / "site-configs" / "local.yaml").read_text())
    data["run_dir"], data["weight_cache"]["l3_path"] = str(tmp_path / "run"), str(tmp_path / "models")
    data["scheduler"].update(max_replicas_per_node=max_per_node, min_replicas_per_model=1, cooldown_period=3600)
    data["models"][0].update(replicas=replicas, min_replicas=1)
    data["heartbeat"] = {"interval": 1.0, "misses": 3, **({"grace": grace} if grace is not None else {})}
    now = [0.0]
    ctl = ControllerCore(parse_site(data), Router(), clock=lambda: now[0], placement_grace=0)
    return ctl, now


def hello(ctl, now, cpus: int = 0):
    with ctl.fleet.lock:
        ctl.handle("n0", AgentHello(agent_id="n0", hostname="n0", pid=1, host_memory_total=64 << 30, cpus=cpus,
                                    replica_threads=1 if cpus else 0))


def tick(ctl, now, t):
    now[0] = t
    with ctl.fleet.lock:
        ctl.tick(t)


def test_a_starved_agent_whose_replicas_stream_is_not_lost_and_one_silent_everywhere_is(tmp_path):
    ctl, now = controller(tmp_path)
    hello(ctl, now)
    placed = [r.replica_id for r in ctl.replicas.values() if r.agent_id == "n0"]
    assert placed
    for t in range(5, 30):  # heartbeats stopped at 0; the router hears a replica all along
        ctl.router.silent = {placed[0]: 0.2}
        tick(ctl, now, float(t))
    assert not ctl.agents["n0"].lost and not ctl.router.lost
    ctl.router.silent = {placed[0]: 100.0}  # now silent at the router too
    tick(ctl, now, 30.0)
    tick(ctl, now, 35.0)
    assert ctl.agents["n0"].lost


def test_a_running_local_agent_process_is_never_lost_and_a_gone_one_is(tmp_path):
    ctl, now = controller(tmp_path)
    hello(ctl, now)
    state = {"n0": True}
    ctl.process_check = lambda node: state.get(node)
    for t in range(1, 60, 5):
        tick(ctl, now, float(t))
    assert not ctl.agents["n0"].lost
    state["n0"] = False
    tick(ctl, now, 61.0)
    assert ctl.agents["n0"].lost


def test_late_heartbeats_widen_the_grace(tmp_path):
    ctl, now = controller(tmp_path)  # 1 s x 3, grace 1 s: lost after 4 s of silence on a quiet machine
    hello(ctl, now)
    for t in (1.0, 2.0, 6.0):  # one beat arrived 3 s late
        now[0] = t
        with ctl.fleet.lock:
            ctl.handle("n0", AgentHeartbeat(agent_id="n0", seq=int(t)))
    tick(ctl, now, 11.0)  # 5 s of silence: past 3 + 1, within 3 + 3 x 3
    assert not ctl.agents["n0"].lost and ctl.agents["n0"].silent_since
    tick(ctl, now, 18.5)  # past 3 + 9
    assert ctl.agents["n0"].lost


def test_a_two_core_node_runs_two_reference_replicas_whatever_max_replicas_per_node_says(tmp_path):
    ctl, now = controller(tmp_path, replicas=8, max_per_node=16)
    hello(ctl, now, cpus=2)
    placed = [r for r in ctl.replicas.values() if r.assignment is not None]
    assert len(placed) == 2
    waiting = [r.detail for r in ctl.replicas.values() if r.assignment is None]
    assert len(waiting) == 6 and all("CPU cores" in d for d in waiting), waiting
    # an agent that does not report its cores (older) is not bounded
    ctl2, now2 = controller(tmp_path / "b", replicas=8, max_per_node=16)
    hello(ctl2, now2)
    assert sum(r.assignment is not None for r in ctl2.replicas.values()) == 8


def test_a_silent_node_takes_no_new_replica_until_heard_again(tmp_path):
    """Failover once re-placed a replica onto a node of the same fault group that was already silent."""
    from exaserve_hpc.controller.placement_control import closed_nodes
    ctl, now = controller(tmp_path, grace=30.0)
    hello(ctl, now)
    tick(ctl, now, 5.0)  # past 1 s x 3 unheard, within the grace: suspected, not lost
    agent = ctl.agents["n0"]
    assert agent.silent_since and not agent.lost
    assert closed_nodes([agent]) == {"n0": "silent: suspected lost"}
    with ctl.fleet.lock:
        ctl.handle("n0", AgentHeartbeat(agent_id="n0", seq=5))
    assert not agent.silent_since and closed_nodes([agent]) == {}
