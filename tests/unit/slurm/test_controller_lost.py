"""Rank 0's node lost without HA, and a job whose batch host is lost (app/controller_lost.py): the pure
decision, the one surviving rank that acts (an exclusive file in the job directory), a successor then this
job cancelled, or only the cancel; Slurm asked as the real commands are (recorded runner, real samples).
Through a real Slurm cluster: tests/slurm/test_controller_lost_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

from exaserve_hpc.jobdir import JobDir
from exaserve_hpc.batch.base import RankInfo
from exaserve_hpc.controller_state import CHECKPOINT_FILE
from exaserve_hpc.batch import JobEnvError, JobEnvironment, RequeueOutcome, SlurmJobEnvironment
from exaserve_hpc.app.controller_lost import (
    CLAIM_FILE, ENDED_FILE, after_controller_lost, end_if_batch_host_lost,
)
from exaserve_hpc.controller.requeue_policy import controller_lost_decision
from exaserve_hpc.batch.slurm.client import CliSlurmClient, CommandResult

from tests.unit.slurm.test_jobenv import Runner  # a recording runner answering by command prefix

SAMPLES = Path(__file__).resolve().parents[2] / "slurm" / "samples"


def test_the_decision_is_a_successor_excluding_the_controllers_node_else_a_cancel():
    d = controller_lost_decision("n1", True, True, 12.4)
    assert (d.action, d.exclude) == ("successor", ("n1",)) and "checkpoint written 12s before" in d.why
    assert "site's plan" in controller_lost_decision("n1", True, True, None).why
    off = controller_lost_decision("n1", False, True, 3.0)
    assert off.action == "cancel" and "requeue.enabled" in off.why
    assert controller_lost_decision("n1", True, False, 3.0).action == "cancel"


class FakeJob(JobEnvironment):
    name = "fake"

    def __init__(self, requeue_fails: bool = False, how: str = "successor", host_lost: bool = False):
        super().__init__({})
        self.calls: list = []
        self.requeue_fails, self.how, self.host_lost = requeue_fails, how, host_lost

    @classmethod
    def detects(cls, env):
        return False

    def task(self):
        return 0, 1, "n2", "7", 0

    @property
    def can_requeue(self):
        return True

    def requeue(self, exclude, job_dir):
        self.calls.append(("requeue", list(exclude)))
        if self.requeue_fails:
            raise JobEnvError("requeue of job 7 failed: sbatch: error: Batch job submission failed")
        return RequeueOutcome(self.how, "8", f"successor job 8 starts when job 7 ends, excluding {exclude[0]}",
                              stop_now=True)

    def end_job(self, why):
        self.calls.append(("end", why))

    def batch_host_lost(self):
        return self.host_lost


def rank(r: int, node: str) -> RankInfo:
    return RankInfo(r, 3, node, "7", 0, "slurm")


def test_one_surviving_rank_submits_the_successor_then_cancels_the_job_the_others_do_nothing(tmp_path):
    jobdir = JobDir(tmp_path).ensure()
    (tmp_path / CHECKPOINT_FILE).write_bytes(b"x")
    first, second = FakeJob(), FakeJob()
    decision = after_controller_lost(first, rank(2, "n3"), jobdir, "n1", True)
    assert decision.action == "successor" and first.calls[0] == ("requeue", ["n1"])
    assert first.calls[1][0] == "end" and "successor job 8" in first.calls[1][1]
    assert after_controller_lost(second, rank(1, "n2"), jobdir, "n1", True) is None and second.calls == []
    record = json.loads((tmp_path / CLAIM_FILE).read_text())
    assert (record["rank"], record["action"]) == (2, "successor") and "successor job 8" in record["why"]


def test_a_failed_successor_still_cancels_and_requeue_off_only_cancels(tmp_path):
    failing = FakeJob(requeue_fails=True)
    after_controller_lost(failing, rank(1, "n2"), JobDir(tmp_path / "a").ensure(), "n1", True)
    assert [c[0] for c in failing.calls] == ["requeue", "end"] and "could not be submitted" in failing.calls[1][1]
    off = FakeJob()
    assert after_controller_lost(off, rank(1, "n2"), JobDir(tmp_path / "b").ensure(), "n1", False).action == "cancel"
    assert [c[0] for c in off.calls] == ["end"]


def test_a_requeue_of_the_same_job_is_not_cancelled_after(tmp_path):
    job = FakeJob(how="requeued")
    after_controller_lost(job, rank(1, "n2"), JobDir(tmp_path).ensure(), "n1", True)
    assert [c[0] for c in job.calls] == ["requeue"]


def test_a_stopped_run_whose_batch_host_is_down_is_cancelled_once(tmp_path):
    jobdir = JobDir(tmp_path).ensure()
    assert not end_if_batch_host_lost(FakeJob(host_lost=False), rank(1, "n2"), jobdir, "the run stopped")
    assert not (tmp_path / ENDED_FILE).exists()
    job = FakeJob(host_lost=True)
    assert end_if_batch_host_lost(job, rank(1, "n2"), jobdir, "the run stopped")
    assert job.calls[0][0] == "end" and "batch host is down" in job.calls[0][1]
    again = FakeJob(host_lost=True)
    assert not end_if_batch_host_lost(again, rank(2, "n3"), jobdir, "the run stopped") and again.calls == []


def test_slurm_reads_the_batch_host_and_its_node_state_and_ends_the_job_with_scancel():
    record = (SAMPLES / "scontrol_show_job_running.txt").read_text()
    sinfo = CommandResult(0, (SAMPLES / "sinfo_node_down.json").read_text(), "")  # n3 down, n1 allocated
    for host, lost in (("n1", False), ("n3", True)):
        runner = Runner({"scontrol show job": CommandResult(0, record.replace("BatchHost=n1", f"BatchHost={host}"), ""),
                         "sinfo --json": sinfo})
        job = SlurmJobEnvironment({"SLURM_JOB_ID": "5"}, client=CliSlurmClient(runner))
        assert job.batch_host_lost() is lost
        assert runner.calls[1] == ["sinfo", "--json", f"--nodes={host}"]
    down = Runner({"scontrol": CommandResult(1, "", "slurm_load_jobs error: Socket timed out")})
    assert SlurmJobEnvironment({"SLURM_JOB_ID": "5"}, client=CliSlurmClient(down)).batch_host_lost() is False
    runner = Runner({})
    SlurmJobEnvironment({"SLURM_JOB_ID": "5"}, client=CliSlurmClient(runner)).end_job("test")
    assert runner.calls == [["scancel", "5"]]
