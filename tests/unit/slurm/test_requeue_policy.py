"""The requeue policy (pure) and rank 0's requeue watch against a fake job environment and controller."""

from __future__ import annotations

import os
import time

import pytest

from exaserve_hpc.app.requeue_watch import REQUEST_FILE, STOP_FILE, RequeueWatch, snapshot_from_status
from exaserve_hpc.app.state_keeper import StateKeeper
from exaserve_hpc.controller_state import CHECKPOINT_FILE, ControllerState, RolloutState, load_state
from exaserve_hpc.batch import JobEnvError, JobEnvironment, RequeueOutcome
from exaserve_hpc.controller.requeue_policy import RequeuePolicy, RequeueReason, RequeueSnapshot, requeue_decision

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


class FakeJob(JobEnvironment):
    """A job environment that records what it is asked (the real ones: tests/slurm/test_jobenv.py)."""
    name = "fake"

    def __init__(self, fail: bool = False, end_time=None, successor: bool = False):
        super().__init__({})
        self.calls, self.fail, self._end, self.successor, self.end_asked = [], fail, end_time, successor, 0

    @classmethod
    def detects(cls, env):
        return False

    def task(self):
        return 0, 1, "n1", "77", 0

    @property
    def can_requeue(self):
        return True

    def end_time(self):
        self.end_asked += 1
        if isinstance(self._end, Exception):
            raise self._end
        return self._end

    def requeue(self, exclude, job_dir):
        self.calls.append(list(exclude))
        if self.fail:
            raise JobEnvError("requeue of job 77 failed: Requested operation is disabled")
        if self.successor:
            return RequeueOutcome("successor", "78", "successor job 78", stop_now=True)
        return RequeueOutcome("requeued", "77", "job 77 requeued")


def watch_for(tmp_path, controller, job, policy=RequeuePolicy(), clock=lambda: 1234.5, save=None, **kw):
    keeper = StateKeeper(controller, tmp_path / CHECKPOINT_FILE, "77", 1, clock=clock, sleep=lambda s: None,
                         **({"save": save} if save else {}))
    stops = []
    watch = RequeueWatch(controller, job, keeper, tmp_path, list(NODES), "n1", policy, clock=clock,
                         request_stop=stops.append, **kw)
    return watch, stops


def test_watch_checkpoints_then_requeues_excluding_lost_nodes(tmp_path):
    previous = ControllerState("77", 0, 1.0, quota={"physics": (10, 2)},
                               rollout={"m": RolloutState("v2", "canary", 0.1)}, excluded_nodes=["n9"])
    controller = FakeController({"n1": "alive", "n2": "lost", "n3": "alive", "n4": "lost"}, previous)
    job = FakeJob()
    (tmp_path / REQUEST_FILE).touch()
    watch, stops = watch_for(tmp_path, controller, job, RequeuePolicy(capacity_floor=0.9))
    decision = watch.check()
    assert decision.reason is RequeueReason.REQUESTED and decision.exclude == ("n2", "n4")
    assert job.calls == [["n2", "n4", "n9"]] and stops == []  # a requeue ends the run itself
    assert not (tmp_path / REQUEST_FILE).exists()
    state = load_state(tmp_path / CHECKPOINT_FILE)
    assert state == ControllerState("77", 1, 1234.5, placement={"m/r0000": ("m", "n1"), "m/r0001": ("m", "")},
                                    quota=previous.quota, rollout=previous.rollout, excluded_nodes=["n2", "n4", "n9"])


def test_a_successor_job_means_this_run_stops_by_itself(tmp_path):
    controller = FakeController({"n1": "alive", "n2": "lost", "n3": "lost", "n4": "lost"})
    watch, stops = watch_for(tmp_path, controller, FakeJob(successor=True))
    assert watch.check().reason is RequeueReason.CAPACITY_BELOW_FLOOR
    assert stops == ["successor job 78"]


def test_watch_does_nothing_while_healthy_and_survives_a_failed_requeue(tmp_path):
    job = FakeJob(fail=True)
    controller = FakeController({n: "alive" for n in NODES})
    watch, _ = watch_for(tmp_path, controller, job)
    assert watch.check() is None and job.calls == []
    controller.states["n2"] = controller.states["n3"] = controller.states["n4"] = "lost"
    assert watch.check().reason is RequeueReason.CAPACITY_BELOW_FLOOR  # the error is logged, not raised
    assert job.calls == [["n2", "n3", "n4"]] and (tmp_path / CHECKPOINT_FILE).exists()


def test_a_failed_checkpoint_write_is_retried_and_logged(tmp_path, caplog):
    attempts = []

    def flaky(path, state):
        attempts.append(path)
        if len(attempts) < 3:
            raise OSError(5, "Input/output error")
        from exaserve_hpc.controller_state import save_state
        return save_state(path, state)

    controller = FakeController({"n1": "alive", "n2": "lost", "n3": "lost", "n4": "lost"})
    job = FakeJob()
    watch, _ = watch_for(tmp_path, controller, job, save=flaky)
    watch.check()
    assert len(attempts) == 3 and (tmp_path / CHECKPOINT_FILE).exists() and job.calls
    assert [r.message.count("attempt") for r in caplog.records if "Input/output" in r.message] == [1, 1]


def test_a_checkpoint_that_never_writes_does_not_stop_the_requeue_or_the_keeper(tmp_path):
    def broken(path, state):
        raise OSError(28, "No space left on device")

    controller = FakeController({"n1": "alive", "n2": "lost", "n3": "lost", "n4": "lost"})
    job = FakeJob()
    watch, _ = watch_for(tmp_path, controller, job, save=broken)
    watch.check()
    assert job.calls == [["n2", "n3", "n4"]] and watch.keeper.failures == 3
    assert watch.keeper.save() is False  # and it still answers


def test_periodic_checkpoints_go_on_after_a_failure(tmp_path):
    calls = []

    def flaky(path, state):
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise RuntimeError("transient")
        path.write_text("ok")
        return path

    keeper = StateKeeper(FakeController({"n1": "alive"}), tmp_path / "s.h5", "1", 0, interval=0.05, attempts=1,
                         save=flaky).start()
    deadline = time.monotonic() + 5
    while len(calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    keeper.stop()
    assert len(calls) >= 3 and (tmp_path / "s.h5").read_text() == "ok"


def test_time_margin_reads_the_end_time_and_refreshes_it_only_now_and_then(tmp_path):
    now = [1000.0]
    job = FakeJob(end_time=1000.0 + 600)
    controller = FakeController({n: "alive" for n in NODES})
    watch, _ = watch_for(tmp_path, controller, job, RequeuePolicy(time_margin=120), clock=lambda: now[0],
                         end_time_refresh=30)
    assert watch.check() is None
    now[0] += 10
    job._end = 1000.0 + 100  # `scontrol update TimeLimit=` moved the limit: seen at the next refresh
    assert watch.check() is None and job.end_asked == 1
    now[0] += 25
    assert watch.check().reason is RequeueReason.TIME_LIMIT_NEAR and job.end_asked == 2


def test_an_unreadable_end_time_keeps_the_last_known_one(tmp_path):
    now = [0.0]
    job = FakeJob(end_time=500.0)
    watch, _ = watch_for(tmp_path, FakeController({n: "alive" for n in NODES}), job, RequeuePolicy(time_margin=60),
                         clock=lambda: now[0], end_time_refresh=1)
    assert watch.check() is None
    job._end, now[0] = JobEnvError("slurmctld does not answer"), 450.0
    assert watch.check().reason is RequeueReason.TIME_LIMIT_NEAR


def test_a_stop_file_from_this_run_stops_it(tmp_path):
    watch, stops = watch_for(tmp_path, FakeController({n: "alive" for n in NODES}), FakeJob(), clock=time.time)
    stale = tmp_path / STOP_FILE
    stale.touch()
    os.utime(stale, (time.time() - 3600, time.time() - 3600))  # left by the run before a requeue
    watch.check()
    assert stops == []
    stale.touch()
    watch.check()
    assert stops == ["stop-requested in the job directory"]


def test_requeue_triggers_are_site_keys_that_the_launch_flags_override():
    import argparse

    from exaserve_hpc.app.rank import add_launch_arguments
    from exaserve_hpc.app.requeue_watch import requeue_policy
    from exaserve_hpc.config.schema import parse_site

    site = parse_site({"site": "t", "models": [{"model_name": "m"}],
                       "requeue": {"capacity_floor": 0.75, "time_margin": "10m", "checkpoint_interval": "1m"}})
    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    assert requeue_policy(site, parser.parse_args([])) == RequeuePolicy(capacity_floor=0.75, time_margin=600.0)
    assert requeue_policy(site, parser.parse_args(["--capacity-floor", "0", "--time-margin", "30"])) == \
        RequeuePolicy(capacity_floor=0.0, time_margin=30.0)
    assert site.requeue.checkpoint_interval == 60.0 and parser.parse_args([]).replace_lost_nodes is None
    with pytest.raises(Exception, match="capacity_floor"):
        parse_site({"site": "t", "models": [{"model_name": "m"}], "requeue": {"capacity_floor": 2}})


def test_with_requeue_off_only_the_stop_file_is_watched(tmp_path):
    controller = FakeController({"n1": "alive", "n2": "lost", "n3": "lost", "n4": "lost"})
    job = FakeJob()
    watch, stops = watch_for(tmp_path, controller, job, clock=time.time, requeue=False)
    assert watch.check() is None and job.calls == [] and not (tmp_path / CHECKPOINT_FILE).exists()
    (tmp_path / STOP_FILE).touch()
    watch.check()
    watch.check()
    assert stops == ["stop-requested in the job directory"]  # once
