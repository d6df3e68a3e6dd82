"""The job-environment seam: which one a process is in, its ranks, the end time parsed from real Slurm
output (tests/slurm/samples), and requeue as Slurm is asked for it (a recording fake Slurm client)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from exaserve_hpc.batch import (
    JobEnvError, LocalJobEnvironment, RESUME_VARIABLE, SlurmJobEnvironment, detect_job_environment,
)
from exaserve_hpc.batch.slurm.job import end_time_from_scontrol, end_time_from_squeue_json, successor_script
from exaserve_hpc.batch.slurm.client import CliSlurmClient, CommandResult
from exaserve_hpc.batch.slurm.parse import parse_scontrol_show

SAMPLES = Path(__file__).resolve().parents[2] / "slurm" / "samples"


def local_epoch(text: str) -> float:
    return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))


def test_the_environment_is_detected_from_the_process_environment():
    assert isinstance(detect_job_environment({}), LocalJobEnvironment)
    slurm = detect_job_environment({"SLURM_JOB_ID": "42", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
                                    "SLURMD_NODENAME": "n4", "SLURM_RESTART_COUNT": "2"})
    assert isinstance(slurm, SlurmJobEnvironment)
    rank = slurm.rank_info()
    assert (rank.rank, rank.size, rank.node, rank.job_id, rank.restart, rank.source) == (3, 4, "n4", "42", 2, "slurm")
    local = detect_job_environment({"EXASERVE_NODE_NAME": "box"}).rank_info()
    assert (local.rank, local.size, local.node, local.job_id, local.source) == (0, 1, "box", "local", "local")


def test_local_environment_cannot_requeue_or_ask_for_nodes(tmp_path):
    job = LocalJobEnvironment({})
    assert not job.can_requeue and job.end_time() is None and job.requested_nodes() == 0
    with pytest.raises(JobEnvError, match="not a batch job"):
        job.requeue(["n3"], tmp_path)
    with pytest.raises(JobEnvError, match="outside a batch system"):
        job.request_nodes(1, [])
    assert LocalJobEnvironment({"EXASERVE_JOB_END_TIME": "1800000000"}).end_time() == 1800000000.0


def test_end_time_from_scontrol_samples():
    [limited] = parse_scontrol_show((SAMPLES / "scontrol_show_job_time_limit.txt").read_text())
    assert end_time_from_scontrol(limited) == local_epoch("2026-11-30T21:11:39")  # TimeLimit=00:07:00
    [unlimited] = parse_scontrol_show((SAMPLES / "scontrol_show_job_running.txt").read_text())
    assert end_time_from_scontrol(unlimited) is None  # TimeLimit=UNLIMITED, EndTime=Unknown
    assert end_time_from_scontrol({"TimeLimit": "01:00:00", "EndTime": "Unknown"}) is None


def test_end_time_from_squeue_json_samples():
    text = (SAMPLES / "squeue_time_limit.json").read_text()  # 22.05: every job, whatever --jobs said
    assert end_time_from_squeue_json(text, 5) == 1796073099.0
    assert end_time_from_squeue_json(text, 3) is None  # time_limit unset: unlimited
    assert end_time_from_squeue_json(text, 99) is None
    newer = '{"jobs": [{"job_id": 7, "time_limit": {"set": true, "infinite": false, "number": 30}, ' \
            '"end_time": {"set": true, "infinite": false, "number": 1800000000}}]}'
    assert end_time_from_squeue_json(newer, 7) == 1800000000.0  # 23.02+ number objects


class Runner:
    def __init__(self, answers):
        self.answers, self.calls = answers, []

    def __call__(self, command, timeout):
        self.calls.append(list(command))
        for prefix, result in self.answers.items():
            if " ".join(command).startswith(prefix):
                return result
        return CommandResult(0, "", "")


def slurm_job(runner, **env) -> SlurmJobEnvironment:
    return SlurmJobEnvironment({"SLURM_JOB_ID": "5", **env}, client=CliSlurmClient(runner))


def test_slurm_end_time_asks_slurmctld_and_falls_back_to_the_variable():
    sample = (SAMPLES / "scontrol_show_job_time_limit.txt").read_text()
    runner = Runner({"scontrol show job": CommandResult(0, sample, "")})
    assert slurm_job(runner, SLURM_JOB_END_TIME="1").end_time() == local_epoch("2026-11-30T21:11:39")
    assert runner.calls == [["scontrol", "show", "job", "5", "-o"]]
    down = Runner({"scontrol": CommandResult(1, "", "slurm_load_jobs error: Socket timed out")})
    assert slurm_job(down, SLURM_JOB_END_TIME="1800000000").end_time() == 1800000000.0
    with pytest.raises(JobEnvError, match="end time"):
        slurm_job(down).end_time()


def test_slurm_requeue_without_exclusion_is_one_command(tmp_path):
    runner = Runner({})
    outcome = slurm_job(runner).requeue([], tmp_path)
    assert runner.calls == [["scontrol", "requeue", "5"]]
    assert (outcome.how, outcome.job_id, outcome.stop_now) == ("requeued", "5", False)


def test_slurm_requeue_with_exclusion_submits_a_successor_after_this_job(tmp_path):
    script = "#!/bin/bash\n# comment\n#SBATCH --nodes=4\n#SBATCH --exclude=n9\n\nset -u\nsrun launch\n"
    runner = Runner({"scontrol write batch_script": CommandResult(0, script, ""),
                     "sbatch": CommandResult(0, "6\n", "")})
    outcome = slurm_job(runner).requeue(["n3", "n4"], tmp_path)
    assert runner.calls[0] == ["scontrol", "write", "batch_script", "5", "-"]
    assert runner.calls[1] == ["sbatch", "--parsable", "--dependency=afterany:5", "--exclude=n[3-4,9]",
                               str(tmp_path / "successor.sbatch")]  # the script's own n9 kept
    assert (outcome.how, outcome.job_id, outcome.stop_now) == ("successor", "6", True)
    text = (tmp_path / "successor.sbatch").read_text().splitlines()
    at = text.index(next(line for line in text if line.startswith(f"export {RESUME_VARIABLE}=")))
    assert text[:at] == script.splitlines()[:5] and text[at + 1:] == ["set -u", "srun launch"]
    assert str(tmp_path) in text[at]
    assert no_requeue_left(runner)


def no_requeue_left(runner) -> bool:
    """Nothing may need to run after a requeue from inside the job (no detached shell, no update after)."""
    return not any(c[:2] == ["scontrol", "requeue"] for c in runner.calls) and \
        not any("ExcNodeList" in " ".join(c) for c in runner.calls)


def test_a_refused_requeue_is_a_job_env_error(tmp_path):
    runner = Runner({"scontrol requeue": CommandResult(1, "", "Requested operation is disabled")})
    with pytest.raises(JobEnvError, match="requeue of job 5 failed"):
        slurm_job(runner).requeue([], tmp_path)


def test_successor_script_keeps_every_directive_before_the_export():
    text = successor_script("#!/bin/sh\n#SBATCH -N 2\necho hi\n", Path("/jobs/5"))
    assert text.splitlines() == ["#!/bin/sh", "#SBATCH -N 2",
                                 f"export {RESUME_VARIABLE}=/jobs/5  # exaserve: restore from the "
                                 f"predecessor's checkpoint", "echo hi"]


def test_resume_dir_comes_from_the_successors_environment():
    assert SlurmJobEnvironment({"SLURM_JOB_ID": "6", RESUME_VARIABLE: "/jobs/5"}).resume_dir() == Path("/jobs/5")
    assert LocalJobEnvironment({}).resume_dir() is None
