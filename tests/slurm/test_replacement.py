"""Replacement nodes: the pure policy, the companion job script, and rank 0's edge with a fake Slurm."""

from __future__ import annotations

from exaserve_hpc.scheduler.replacement import replacement_decision
from exaserve_hpc.scheduler.requeue import RequeuePolicy
from exaserve_hpc.slurm.parse import JobInfo
from exaserve_hpc.slurm.replacement import CompanionJobs, render_companion
from exaserve_hpc.slurm.requeue import Requeuer
from exaserve_hpc.slurm.states import JobState


def test_replacement_decision_asks_once_per_hole():
    assert replacement_decision(4, 4, (), 0).nodes == 0
    d = replacement_decision(4, 3, ("n3",), 0)
    assert (d.nodes, d.exclude) == (1, ("n3",)) and d.why.startswith("replace-lost-nodes")
    assert replacement_decision(4, 3, ("n3",), 1).nodes == 0  # already on the way
    assert replacement_decision(4, 2, ("n2", "n3"), 1).nodes == 1
    assert replacement_decision(4, 4, ("n3",), 0).nodes == 0  # a replacement joined
    assert replacement_decision(4, 3, (), 0).nodes == 0  # a node that never joined is not "lost"


def test_companion_script_joins_the_main_job_as_agents(tmp_path):
    text = render_companion("42", tmp_path / "42", "/p/site.yaml", 2, ["n3", "n4"], 900, "exaserve launch")
    assert "#SBATCH --job-name=exaserve-replace-42" in text
    assert "#SBATCH --nodes=2" in text and "#SBATCH --exclude=n[3-4]" in text and "#SBATCH --time=15:00" in text
    assert f"exaserve launch --join --site /p/site.yaml --job-dir {tmp_path / '42'}" in text
    assert "srun --no-kill --kill-on-bad-exit=0" in text


class FakeSlurm:
    def __init__(self):
        self.submitted, self.cancelled, self.requeued, self.running = [], [], [], set()

    def submit(self, script, options=()):
        self.submitted.append(script.read_text())
        job = 100 + len(self.submitted)
        self.running.add(job)
        return job

    def jobs(self, job_ids=(), user=None):
        return [JobInfo(j, "c", JobState.RUNNING, "RUNNING") for j in job_ids if j in self.running]

    def cancel(self, job_id, signal=None, batch_only=False):
        self.cancelled.append(job_id)
        self.running.discard(job_id)

    def requeue(self, job_id, exclude=()):
        self.requeued.append(job_id)


class FakeController:
    restored = None

    def __init__(self, states):
        self.states = states

    def status(self):
        return {"agents": [{"agent_id": a, "state": s} for a, s in self.states.items()], "replicas": []}


def test_requeuer_asks_for_a_replacement_once_and_cancels_companions_at_the_end(tmp_path):
    slurm = FakeSlurm()
    controller = FakeController({"n1": "alive", "n2": "alive", "n3": "lost"})
    companions = CompanionJobs(slurm, "7", tmp_path, "/p/site.yaml")
    watch = Requeuer(controller, tmp_path, "7", 0, slurm, ["n1", "n2", "n3"], "n1", RequeuePolicy(capacity_floor=0.5),
                     companions=companions)
    assert watch.check() is None
    assert len(slurm.submitted) == 1 and "--exclude=n3" in slurm.submitted[0]
    watch.check()
    assert len(slurm.submitted) == 1, "asked twice for one lost node"
    controller.states["n4"] = "alive"  # the replacement joined
    watch.check()
    assert len(slurm.submitted) == 1 and not slurm.requeued
    watch.stop()
    assert slurm.cancelled == [101]
