"""Stopping well, end to end on the local Slurm cluster: a job brought near its time limit, and a job
cancelled with scancel, each end with the controller's checkpoint written, every rank exited 0 and no
file left in any node's L2 directory (/dev/shm, private per node), without the admins' epilog having
had anything to remove. Marked slurm: under CI=true these must run.

How a stop reaches the ranks (sbatch/exaserve.sbatch): `--signal=USR1@120` sends USR1 to every rank
of the step (not to the batch shell) 120 s before the limit; scancel sends TERM to every rank; the
batch shell never signals srun (srun answers TERM by SIGKILLing every task).
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from exaserve_hpc.controller_state import CHECKPOINT_FILE, load_state
from exaserve_hpc.batch.slurm.client import CliSlurmClient, SlurmError

from .fleet import ROOT, Job, epilog_lines, shm_files, submit, task_exits, wait_serving

pytestmark = [pytest.mark.slurm, pytest.mark.process]

NODES = 2
REPLICAS = 2


PACED_TOKENS = 3000  # a timing-engine stream runs to max_tokens at GPU pace: longer than STOP_GRACE
STOP_GRACE = 5  # gateway.stop_grace in the test with open streams


def reference_site(directory: Path, paced: bool = False) -> Path:
    """slurm-local as shipped (tiny reference replicas, which load their weights through L2 in the
    node's /dev/shm), with its files in `directory` and the gateway reachable from this namespace.
    paced: also one replica of the timing engine (every request runs to max_tokens), and a short grace."""
    data = yaml.safe_load((ROOT / "site-configs" / "slurm-local.yaml").read_text())
    data["models"][0].update(replicas=REPLICAS, min_replicas=REPLICAS)
    if paced:
        data["models"].append({"model_name": "paced", "engine": "timing", "replicas": 1, "min_replicas": 1,
                               "max_seq_len": 4096})
        data.setdefault("gateway", {})["stop_grace"] = f"{STOP_GRACE}s"
    data["weight_cache"]["l3_path"] = str(directory / "models")
    data["run_dir"] = str(directory / "run")
    data.setdefault("gateway", {})["host"] = "0.0.0.0"
    path = directory / "site.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def job_record(job_id: int) -> dict[str, str]:
    text = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True,
                          timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", text))


def wait_ended(job: Job, timeout: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    record: dict[str, str] = {}
    while time.monotonic() < deadline:
        record = job_record(job.job_id)
        if record.get("JobState") not in (None, "RUNNING", "COMPLETING", "PENDING", "CONFIGURING"):
            # The epilog runs as the job completes: give it a moment to log.
            time.sleep(2)
            return record
        time.sleep(1)
    raise AssertionError(f"job {job.job_id} still {record.get('JobState')} after {timeout}s\n"
                         f"job output:\n{job.log()}")


def serving_job(directory: Path, paced: bool = False) -> tuple[Job, list[str]]:
    job = submit(reference_site(directory, paced), directory / "jobs", nodes=NODES)
    status = wait_serving(job, agents=NODES, replicas=REPLICAS + paced, timeout=180)
    nodes = sorted(a["agent_id"] for a in status["agents"])
    # The test can fail: every node's L2 holds the replica's weights while it serves.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(shm_files(n) for n in nodes):
        time.sleep(0.5)
    assert all(shm_files(n) for n in nodes), {n: shm_files(n) for n in nodes}
    return job, nodes


def assert_stopped_well(job: Job, nodes: list[str], stop_sent: float, signal_name: str, replicas: int = REPLICAS) -> None:
    output = job.log()
    assert f"{signal_name} received: checkpoint, drain, stop" in output, output
    checkpoint = job.job_dir / CHECKPOINT_FILE
    assert checkpoint.exists() and checkpoint.stat().st_mtime >= stop_sent - 1, output
    state = load_state(checkpoint)
    assert state.job_id == str(job.job_id) and len(state.placement) == replicas, state
    # Every rank exited 0 (slurmstepd's word, per task), and so did srun and the batch script.
    assert task_exits(job.job_id) == {rank: "exit 0" for rank in range(NODES)}, (task_exits(job.job_id), output)
    assert "exaserve: srun exited with 0" in output and "Exited with exit code" not in output, output
    # The agents removed their L2 files themselves: nothing under any node's /dev/shm, and the epilog
    # found nothing left over on any node.
    assert {n: shm_files(n) for n in nodes} == {n: [] for n in nodes}
    said = epilog_lines(job.job_id)
    assert len(said) >= len(nodes) and all(line.endswith("nothing left over") for line in said), said


def cancel_and_wait(job: Job) -> None:
    job.cancel()
    deadline = time.monotonic() + 60
    client = CliSlurmClient()
    while time.monotonic() < deadline:
        try:
            if client.job(job.job_id).state.terminal:
                return
        except SlurmError:
            return
        time.sleep(0.5)


def test_job_near_its_time_limit_checkpoints_drains_and_every_rank_exits_0(slurm_cluster, shared_tmp):
    job, nodes = serving_job(shared_tmp)
    try:
        # Bring the limit near: 60-120 s left, inside the 120 s of --signal=USR1@120, so slurmctld's next
        # time-limit pass (every ~30 s) signals the ranks well before it would kill them.
        hours, mins, secs = (int(x) for x in job_record(job.job_id)["RunTime"].split("-")[-1].split(":"))
        elapsed = hours * 3600 + mins * 60 + secs
        minutes = math.ceil((elapsed + 65) / 60)  # leaves 65-125 s
        stop_sent = time.time()
        result = subprocess.run(["scontrol", "update", f"JobId={job.job_id}", f"TimeLimit={minutes}"],
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        record = wait_ended(job, timeout=minutes * 60 + 60)
        print(f"\ntime-limit stop: limit set to {minutes} min; job ended {time.time() - stop_sent:.1f}s later "
              f"as {record.get('JobState')}")
        # It ended by itself (COMPLETED), before the limit (not TIMEOUT), with exit code 0.
        assert record.get("JobState") == "COMPLETED" and record.get("ExitCode") == "0:0", (record, job.log())
        assert_stopped_well(job, nodes, stop_sent, "SIGUSR1")
    finally:
        cancel_and_wait(job)


class RawStream(threading.Thread):
    """One streamed completion read as the raw SSE lines a client gets (to see how it ended)."""

    def __init__(self, url: str, index: int, model: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.index, self.model, self.max_tokens = url, index, model, max_tokens
        self.lines: list[str] = []
        self.error = ""

    def run(self) -> None:
        body = {"model": self.model, "prompt": f"stream {self.index}", "max_tokens": self.max_tokens,
                "stream": True, "temperature": 0}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120) as reply:
                for line in reply.iter_lines():
                    if line:
                        self.lines.append(line)
        except httpx.HTTPError as exc:
            self.error = repr(exc)

    @property
    def ending(self) -> str:
        """"completed", "server_stopping" (an error event, then [DONE]) or what cut it."""
        if self.error or not self.lines or self.lines[-1] != "data: [DONE]":
            return f"cut ({self.error or (self.lines[-1:] or ['no line'])[0]})"
        events = [json.loads(line[6:]) for line in self.lines[:-1] if line.startswith("data: {")]
        if events and "error" in events[-1]:
            return events[-1]["error"].get("code") or "error"
        return "completed" if events and events[-1]["choices"][0].get("finish_reason") else "no finish reason"


def test_scancel_within_the_grace_time_checkpoints_drains_and_every_rank_exits_0(slurm_cluster, shared_tmp):
    job, nodes = serving_job(shared_tmp, paced=True)
    try:
        # Streams open through rank 0's gateway when the job is cancelled: short ones finish within
        # gateway.stop_grace, long ones (timing engine, PACED_TOKENS at GPU pace) end with an error event
        # and [DONE]; none is cut.
        url = job.url()
        streams = [RawStream(url, i, "tiny-llama", 12) if i % 2 else RawStream(url, i, "paced", PACED_TOKENS)
                   for i in range(4)]
        for stream in streams:
            stream.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(s.lines for s in streams[::2]):
            time.sleep(0.1)
        assert all(s.lines for s in streams[::2]), [s.error for s in streams]
        stop_sent = time.time()
        job.cancel()
        record = wait_ended(job, timeout=90)
        took = time.time() - stop_sent
        for stream in streams:
            stream.join(30)
        endings = [s.ending for s in streams]
        print(f"\nscancel stop: job ended {took:.1f}s after scancel as {record.get('JobState')}; "
              f"streams open at the signal ended {endings}")
        assert record.get("JobState") == "CANCELLED" and record.get("ExitCode") == "0:0", (record, job.log())
        assert took < 30, f"the ranks took {took:.0f}s, more than the cluster's KillWait (30 s)"
        assert all(e in ("completed", "server_stopping") for e in endings), endings
        assert endings[1] == endings[3] == "completed", endings  # 12 tokens fit the grace
        assert endings[0] == endings[2] == "server_stopping", endings  # PACED_TOKENS do not
        assert_stopped_well(job, nodes, stop_sent, "SIGTERM", replicas=REPLICAS + 1)
    finally:
        cancel_and_wait(job)
