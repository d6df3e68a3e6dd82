"""The Slurm parsers on output captured from the local Slurm 22.05 cluster (samples/)."""

from __future__ import annotations

from pathlib import Path

import pytest

from exaserve_hpc.batch.slurm.parse import (
    SlurmParseError, job_from_scontrol, node_from_scontrol, parse_sbatch_parsable, parse_scontrol_show,
    parse_sinfo_json, parse_squeue_json,
)
from exaserve_hpc.batch.slurm.states import JobState, NodeState, job_state, node_state

SAMPLES = Path(__file__).resolve().parents[2] / "slurm" / "samples"


def sample(name: str) -> str:
    return (SAMPLES / name).read_text()


def test_squeue_running_job_on_four_nodes():
    [job] = parse_squeue_json(sample("squeue_running.json"))
    assert (job.job_id, job.state, job.nodes, job.node_count) == (1, JobState.RUNNING, ("n1", "n2", "n3", "n4"), 4)
    assert job.requeue and job.batch_host == "n1" and job.reason == ""


def test_squeue_after_a_node_loss_shows_the_job_shrunk_to_the_survivors():
    [job] = parse_squeue_json(sample("squeue_after_node_loss.json"))
    assert job.state is JobState.RUNNING and job.nodes == ("n1", "n2", "n4") and job.node_count == 3


def test_squeue_requeued_job_is_pending_with_a_restart_counted():
    [job] = parse_squeue_json(sample("squeue_requeued.json"))
    assert job.state is JobState.PENDING and job.restarts == 1 and job.nodes == ()


def test_squeue_terminal_states_and_exit_code():
    jobs = {j.job_id: j for j in parse_squeue_json(sample("squeue_pending.json"))}
    assert jobs[1].state is JobState.CANCELLED and jobs[1].state.terminal
    assert jobs[2].state is JobState.FAILED and jobs[2].exit_code == 3  # 22.05 prints the wait status (768)
    assert jobs[3].state is JobState.PENDING and not jobs[3].state.terminal and jobs[3].reason == "BeginTime"


def test_sinfo_marks_a_killed_node_down_and_the_others_allocated():
    nodes = {n.name: n for n in parse_sinfo_json(sample("sinfo_node_down.json"))}
    assert nodes["n3"].state is NodeState.DOWN and nodes["n3"].reason == "Not responding"
    assert nodes["n3"].raw_state == "down+NOT_RESPONDING"
    assert [nodes[n].state for n in ("n1", "n2", "n4")] == [NodeState.ALLOCATED] * 3
    assert nodes["n1"].port == 16821 and nodes["n1"].cpus == 4


def test_sinfo_idle_cluster():
    nodes = parse_sinfo_json(sample("sinfo_idle.json"))
    assert [(n.name, n.state) for n in nodes] == [(f"n{i}", NodeState.IDLE) for i in range(1, 5)]
    assert all(n.state.usable for n in nodes)


def test_scontrol_show_job_and_node_lines():
    job = job_from_scontrol(parse_scontrol_show(sample("scontrol_show_job_running.txt"))[0])
    assert job.state is JobState.RUNNING and job.nodes == ("n1", "n2", "n3", "n4") and job.time_limit_s is None
    failed = job_from_scontrol(parse_scontrol_show(sample("scontrol_show_job_failed.txt"))[0])
    assert failed.state is JobState.FAILED and failed.exit_code == 3
    down = node_from_scontrol(parse_scontrol_show(sample("scontrol_show_node_down.txt"))[0])
    assert down.state is NodeState.DOWN and down.reason.startswith("Not responding [root@")
    record = parse_scontrol_show(sample("scontrol_show_node_down.txt"))[0]
    assert record["OS"].startswith("Linux ") and " SMP " in record["OS"]  # values with spaces survive


def test_sbatch_parsable_with_and_without_cluster():
    assert parse_sbatch_parsable("1234\n") == 1234
    assert parse_sbatch_parsable("sbatch: warning: x\n77;exaserve-test\n") == 77
    with pytest.raises(SlurmParseError, match="no job id"):
        parse_sbatch_parsable("sbatch: error: Batch job submission failed\n")


def test_bad_json_and_slurm_errors_are_reported():
    with pytest.raises(SlurmParseError, match="did not print JSON"):
        parse_squeue_json("squeue: error: oops")
    with pytest.raises(SlurmParseError, match="reported errors"):
        parse_sinfo_json('{"errors": [{"error": "Unable to contact slurm controller"}], "nodes": []}')


def test_newer_slurm_spellings_translate_too():
    assert job_state(["RUNNING"]) is JobState.RUNNING  # 23.02+: a list
    assert job_state("CANCELLED by 0") is JobState.CANCELLED
    assert job_state("PD") is JobState.PENDING and job_state("NF") is JobState.FAILED
    assert job_state("SOMETHING_NEW") is JobState.UNKNOWN
    assert node_state(["IDLE", "DRAIN"]) is NodeState.DRAINED
    assert node_state("MIXED+DRAIN") is NodeState.DRAINING
    assert node_state("idle*") is NodeState.DOWN
    assert node_state("mix") is NodeState.ALLOCATED
    [job] = parse_squeue_json('{"jobs": [{"job_id": 5, "job_state": ["TIMEOUT"], "nodes": "n[1-2]", '
                              '"time_limit": {"set": true, "infinite": false, "number": 30}, '
                              '"exit_code": {"status": ["SIGNALED"], "return_code": {"set": true, "number": 0}}}]}')
    assert job.state is JobState.TIMEOUT and job.time_limit_s == 1800 and job.nodes == ("n1", "n2")
