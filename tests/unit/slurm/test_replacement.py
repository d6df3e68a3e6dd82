"""Replacement nodes: the pure policy, the companion job script, and rank 0's watch with a fake Slurm."""

from __future__ import annotations

from pathlib import Path

from exaserve_hpc.config.schema import load_site, resolve_site
from exaserve_hpc.batch import SlurmJobEnvironment
from exaserve_hpc.app.requeue_watch import RequeueWatch
from exaserve_hpc.controller.replacement_policy import replacement_decision
from exaserve_hpc.controller.requeue_policy import RequeuePolicy
from exaserve_hpc.batch.slurm.companion_jobs import CompanionJobs, render_companion
from exaserve_hpc.batch.slurm.parse import JobInfo
from exaserve_hpc.batch.slurm.sbatch import options_from_site
from exaserve_hpc.batch.slurm.states import JobState
from exaserve_hpc.app.state_keeper import StateKeeper


def test_replacement_decision_asks_once_per_hole():
    assert replacement_decision(4, 4, (), 0).nodes == 0
    d = replacement_decision(4, 3, ("n3",), 0)
    assert (d.nodes, d.exclude) == (1, ("n3",)) and d.why.startswith("replace-lost-nodes")
    assert replacement_decision(4, 3, ("n3",), 1).nodes == 0  # already on the way
    assert replacement_decision(4, 2, ("n2", "n3"), 1).nodes == 1
    assert replacement_decision(4, 4, ("n3",), 0).nodes == 0  # a replacement joined
    assert replacement_decision(4, 3, (), 0).nodes == 0  # a node that never joined is not "lost"


def site_options(tmp_path: Path, name: str = "small16-a100") -> dict:
    site_file = resolve_site(name)
    return options_from_site(load_site(site_file), site_file, job_root=tmp_path)


def test_companion_script_is_the_main_jobs_script_for_joining_nodes(tmp_path):
    options = site_options(tmp_path)
    main = [line for line in __import__("exaserve_hpc.batch.slurm.sbatch", fromlist=["x"]).render_sbatch(
        **options).splitlines() if line.startswith("#SBATCH")]
    text = render_companion("42", tmp_path / "42", options, 2, ["n3", "n4"], 900, "exaserve launch")
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --job-name=exaserve-replace-42" in directives
    assert "#SBATCH --nodes=2" in directives and "#SBATCH --exclude=n[3-4]" in directives
    assert "#SBATCH --time=15:00" in directives
    assert f"exaserve launch --join-job-dir {tmp_path / '42'}" in text
    # every other directive of the main job (partition, account, QOS, GPUs, memory, ...) and its modules
    different = ("--job-name", "--nodes", "--time", "--exclude")
    assert [d for d in main if not d.startswith(tuple(f"#SBATCH {k}" for k in different))] == \
        [d for d in directives if not d.startswith(tuple(f"#SBATCH {k}" for k in different))]
    assert any(d.startswith("#SBATCH --partition=") for d in directives)
    assert "module load" in text


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

    def requeue(self, job_id):
        self.requeued.append(job_id)


class FakeController:
    restored = None

    def __init__(self, states):
        self.states = states

    def status(self):
        return {"agents": [{"agent_id": a, "state": s} for a, s in self.states.items()], "replicas": []}


def test_watch_asks_for_a_replacement_once_and_cancels_companions_at_the_end(tmp_path):
    slurm = FakeSlurm()
    controller = FakeController({"n1": "alive", "n2": "alive", "n3": "lost"})
    job = SlurmJobEnvironment({"SLURM_JOB_ID": "7"}, client=slurm)
    (tmp_path / "7").mkdir()
    job.companions = CompanionJobs(slurm, "7", tmp_path / "7", site_options(tmp_path, "slurm-local"),
                                   poll_interval=0.0)
    keeper = StateKeeper(controller, tmp_path / "state.h5", "7", 0)
    watch = RequeueWatch(controller, job, keeper, tmp_path, ["n1", "n2", "n3"], "n1",
                         RequeuePolicy(capacity_floor=0.5), replace_lost_nodes=True)
    assert watch.check() is None
    assert len(slurm.submitted) == 1 and "--exclude=n3" in slurm.submitted[0]
    watch.check()
    assert len(slurm.submitted) == 1, "asked twice for one lost node"
    controller.states["n4"] = "alive"  # the replacement joined
    watch.check()
    assert len(slurm.submitted) == 1 and not slurm.requeued
    watch.stop()
    assert slurm.cancelled == [101]


def test_companion_queries_are_rate_limited(tmp_path):
    slurm = FakeSlurm()
    asked = []
    slurm.jobs = lambda job_ids=(), user=None: asked.append(list(job_ids)) or []
    now = [0.0]
    (tmp_path / "7").mkdir()
    companions = CompanionJobs(slurm, "7", tmp_path / "7", site_options(tmp_path, "slurm-local"),
                               poll_interval=5.0, clock=lambda: now[0])
    companions.submit(1, ["n3"])
    for step in range(10):  # ten checks over 9 s: Slurm is asked twice
        companions.asked()
        now[0] += 1.0
    assert asked == [[101], [101]]
