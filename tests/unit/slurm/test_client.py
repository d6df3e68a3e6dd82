"""The CLI Slurm client against a recording fake runner: commands built, failures raised with their details."""

from __future__ import annotations

from pathlib import Path

import pytest

from exaserve_hpc.batch.slurm.backend import slurm_client
from exaserve_hpc.batch.slurm.client import CliSlurmClient, CommandResult, SlurmCommandError, SlurmError, pyslurm_matches
from exaserve_hpc.batch.slurm.states import JobState, NodeState

SAMPLES = Path(__file__).resolve().parents[2] / "slurm" / "samples"


class FakeRunner:
    def __init__(self, answers: dict[str, CommandResult]):
        self.answers = answers
        self.calls: list[list[str]] = []

    def __call__(self, command, timeout):
        self.calls.append(list(command))
        for prefix, result in self.answers.items():
            if " ".join(command).startswith(prefix):
                return result
        return CommandResult(0, "", "")


def ok(text: str) -> CommandResult:
    return CommandResult(0, text, "")


def test_submit_passes_options_before_the_script_and_reads_the_id(tmp_path):
    runner = FakeRunner({"sbatch": ok("42;exaserve-test\n")})
    client = CliSlurmClient(runner)
    assert client.submit(tmp_path / "job.sbatch", ["--exclude=n3"]) == 42
    assert runner.calls == [["sbatch", "--parsable", "--exclude=n3", str(tmp_path / "job.sbatch")]]


def test_failure_carries_command_exit_code_and_stderr(tmp_path):
    runner = FakeRunner({"sbatch": CommandResult(1, "", "sbatch: error: invalid partition specified: gpu\n")})
    with pytest.raises(SlurmCommandError) as info:
        CliSlurmClient(runner).submit(tmp_path / "x", ["--partition=gpu"])
    error = info.value
    assert error.returncode == 1 and error.command[:3] == ["sbatch", "--parsable", "--partition=gpu"]
    assert "invalid partition" in error.stderr and "exited with 1" in str(error)


def test_requeue_is_one_command_with_nothing_left_to_run_after_it():
    # The requeue ends every process of the job, the caller's too: nothing may need to run after it
    # (under proctrack/cgroup not even a detached shell survives). Exclusion is jobenv's successor job.
    runner = FakeRunner({})
    CliSlurmClient(runner).requeue(7)
    assert runner.calls == [["scontrol", "requeue", "7"]]


def test_job_queries_name_the_user_and_the_jobs():
    runner = FakeRunner({"squeue": ok((SAMPLES / "squeue_time_limit.json").read_text())})
    jobs = CliSlurmClient(runner).jobs([5, 4])
    assert runner.calls == [["squeue", "--json", "--me", "--jobs=5,4"]]
    assert sorted(j.job_id for j in jobs) == [4, 5]  # 22.05 prints every job whatever the filters


def test_job_query_falls_back_to_the_users_jobs_when_one_id_is_forgotten():
    class Forgetful(FakeRunner):
        def __call__(self, command, timeout):
            self.calls.append(list(command))
            if any(c.startswith("--jobs=") for c in command):
                return CommandResult(1, "", "slurm_load_jobs error: Invalid job id specified")
            return ok((SAMPLES / "squeue_time_limit.json").read_text())

    runner = Forgetful({})
    assert [j.job_id for j in CliSlurmClient(runner).jobs([5, 77])] == [5]
    assert runner.calls[-1] == ["squeue", "--json", "--me"]


def test_batch_script_and_job_record():
    runner = FakeRunner({"scontrol write batch_script": ok("#!/bin/bash\n#SBATCH --nodes=2\nsrun x\n"),
                         "scontrol show job": ok((SAMPLES / "scontrol_show_job_time_limit.txt").read_text())})
    client = CliSlurmClient(runner)
    assert client.batch_script(5).startswith("#!/bin/bash")
    assert runner.calls[0] == ["scontrol", "write", "batch_script", "5", "-"]
    assert client.job_record(5)["EndTime"] == "2026-11-30T21:11:39"


def test_jobs_and_nodes_come_back_as_our_enums():
    runner = FakeRunner({"squeue --json --me": ok((SAMPLES / "squeue_after_node_loss.json").read_text()),
                         "sinfo --json": ok((SAMPLES / "sinfo_node_down.json").read_text())})
    client = CliSlurmClient(runner)
    [job] = client.jobs([1])
    assert job.state is JobState.RUNNING and job.nodes == ("n1", "n2", "n4")
    assert client.jobs([99]) == []
    down = [n.name for n in client.nodes() if n.state is NodeState.DOWN]
    assert down == ["n3"]
    assert runner.calls[-1] == ["sinfo", "--json"]


def test_unknown_job_is_a_clear_error():
    runner = FakeRunner({"scontrol show job": CommandResult(1, "", "slurm_load_jobs error: Invalid job id specified")})
    with pytest.raises(SlurmError, match="unknown to slurmctld"):
        CliSlurmClient(runner).job(99)


def test_cancel_with_signal_to_the_batch_shell():
    runner = FakeRunner({})
    CliSlurmClient(runner).cancel(5, signal="USR1", batch_only=True)
    assert runner.calls == [["scancel", "--signal=USR1", "--batch", "5"]]


def test_backend_choice():
    assert pyslurm_matches("22.5.1", "22.05.8") and not pyslurm_matches("25.11.0", "22.05.8")
    runner = FakeRunner({"sinfo --version": ok("slurm-wlm 22.05.8\n")})
    assert slurm_client("cli", runner).backend == "cli"
    assert slurm_client("auto", runner).backend == "cli"  # pyslurm is absent or does not match here
    with pytest.raises(SlurmError, match="pyslurm"):
        slurm_client("pyslurm", runner)
    with pytest.raises(ValueError, match="auto, cli, pyslurm"):
        slurm_client("slurmrestd", runner)
