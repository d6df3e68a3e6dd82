"""The requeue policy (pure) and rank 0's requeue edge against a fake Slurm client and controller."""

from __future__ import annotations

import pytest

from exaserve_hpc.checkpoint import ControllerState, RolloutState, load_state
from exaserve_hpc.scheduler.requeue import RequeuePolicy, RequeueReason, RequeueSnapshot, requeue_decision
from exaserve_hpc.slurm.client import SlurmCommandError
from exaserve_hpc.slurm.requeue import CHECKPOINT_FILE, REQUEST_FILE, Requeuer, snapshot_from_status

NODES = ("n1", "n2", "n3", "n4")


def snap(live=NODES, lost=(), **kw) -> RequeueSnapshot:
    return RequeueSnapshot(planned_nodes=4, live_nodes=tuple(live), lost_nodes=tuple(lost), controller_node="n1", **kw)


@pytest.mark.parametrize("snapshot, policy, reason, exclude", [
    (snap(), RequeuePolicy(), None, ()),
    (snap(("n1", "n2", "n4"), ("n3",)), RequeuePolicy(capacity_floor=0.5), None, ()),
    (snap(("n1", "n2", "n4"), ("n3",)), RequeuePolicy(capacity_floor=0.8), RequeueReason.CAPACITY_BELOW_FLOOR, ("n3",)),
    (snap(("n1",), ("n4", "n2", "n3")), RequeuePolicy(), RequeueReason.CAPACITY_BELOW_FLOOR, ("n2", "n3", "n4")),
    (snap(("n1",), ("n2", "n3", "n4")), RequeuePolicy(capacity_floor=0), None, ()),
    (snap(("n2", "n3", "n4"), ("n1",)), RequeuePolicy(), RequeueReason.CONTROLLER_NODE_LOST, ("n1",)),
    (snap(seconds_left=30.0), RequeuePolicy(time_margin=60), RequeueReason.TIME_LIMIT_NEAR, ()),
    (snap(seconds_left=90.0), RequeuePolicy(time_margin=60), None, ()),
    (snap(seconds_left=5.0), RequeuePolicy(time_margin=0), None, ()),
    (snap(("n1", "n2", "n4"), ("n3",), requested=True), RequeuePolicy(), RequeueReason.REQUESTED, ("n3",)),
])
def test_requeue_decision(snapshot, policy, reason, exclude):
    decision = requeue_decision(snapshot, policy)
    assert decision.requeue is (reason is not None)
    assert decision.reason is reason
    assert decision.exclude == exclude
    if reason is not None:
        assert decision.why.startswith(reason.value)


def test_controller_node_lost_wins_over_other_reasons():
    decision = requeue_decision(snap(("n2",), ("n1", "n3", "n4"), seconds_left=1.0, requested=True),
                                RequeuePolicy(time_margin=60))
    assert decision.reason is RequeueReason.CONTROLLER_NODE_LOST


def status(states: dict[str, str]) -> dict:
    return {"agents": [{"agent_id": a, "state": s} for a, s in states.items()],
            "replicas": [{"replica_id": "m/r0000", "model": "m", "node": "n1"},
                         {"replica_id": "m/r0001", "model": "m", "node": None}]}


def test_snapshot_from_status_counts_replacement_nodes_as_live():
    s = snapshot_from_status(status({"n1": "alive", "n2": "lost", "n9": "alive"}), ["n1", "n2", "n3"], "n1", None,
                             False)
    assert (s.planned_nodes, s.live_nodes, s.lost_nodes) == (3, ("n1", "n9"), ("n2",))


class FakeController:
    def __init__(self, states, restored=None):
        self.states, self.restored = states, restored

    def status(self):
        return status(self.states)


class FakeSlurm:
    def __init__(self, fail: bool = False):
        self.calls, self.fail = [], fail

    def requeue(self, job_id, exclude=()):
        self.calls.append((job_id, list(exclude)))
        if self.fail:
            raise SlurmCommandError(["scontrol", "requeue", str(job_id)], 1, "Requested operation is disabled")


def test_requeuer_checkpoints_then_requeues_excluding_lost_nodes(tmp_path):
    previous = ControllerState("77", 0, 1.0, quota={"physics": (10, 2)},
                               rollout={"m": RolloutState("v2", "canary", 0.1)}, excluded_nodes=["n9"])
    controller = FakeController({"n1": "alive", "n2": "lost", "n3": "alive", "n4": "lost"}, previous)
    slurm = FakeSlurm()
    (tmp_path / REQUEST_FILE).touch()
    requeuer = Requeuer(controller, tmp_path, "77", 1, slurm, list(NODES), "n1", RequeuePolicy(capacity_floor=0.9),
                        clock=lambda: 1234.5)
    decision = requeuer.check()
    assert decision.reason is RequeueReason.REQUESTED and decision.exclude == ("n2", "n4")
    assert slurm.calls == [(77, ["n2", "n4", "n9"])]
    assert not (tmp_path / REQUEST_FILE).exists()
    state = load_state(tmp_path / CHECKPOINT_FILE)
    assert state == ControllerState("77", 1, 1234.5, placement={"m/r0000": ("m", "n1"), "m/r0001": ("m", "")},
                                    quota=previous.quota, rollout=previous.rollout, excluded_nodes=["n2", "n4", "n9"])


def test_requeuer_does_nothing_while_healthy_and_survives_a_failed_requeue(tmp_path):
    slurm = FakeSlurm(fail=True)
    requeuer = Requeuer(FakeController({n: "alive" for n in NODES}), tmp_path, "5", 0, slurm, list(NODES), "n1")
    assert requeuer.check() is None and slurm.calls == []
    requeuer.controller.states["n2"] = requeuer.controller.states["n3"] = requeuer.controller.states["n4"] = "lost"
    assert requeuer.check().reason is RequeueReason.CAPACITY_BELOW_FLOOR  # the error is logged, not raised
    assert slurm.calls == [(5, ["n2", "n3", "n4"])] and (tmp_path / CHECKPOINT_FILE).exists()
