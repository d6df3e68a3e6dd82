"""`exaserve launch` ranks stopped as Slurm stops them, without Slurm: two ranks on this machine (srun's
variables set by hand, so the job directory carries the bootstrap), each with its own L2 directory.
SIGUSR1 to every task (Slurm's warning before the time limit), or the batch shell's stop-requested file:
rank 0 writes the checkpoint before the drain, every agent empties its L2, every rank exits 0. The gateway URL published in the job directory
is the node's address (gateway.host unset, or a wildcard), and `exaserve status --run-dir JOBDIR`
reaches it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serve_harness import write_local_site

from exaserve_hpc.controller_state import CHECKPOINT_FILE, load_state

pytestmark = pytest.mark.process


def start_rank(site_file: Path, job_dir: Path, rank: int, node: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "SLURM_JOB_ID": "t1", "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2",
           "SLURMD_NODENAME": node}
    return subprocess.Popen([sys.executable, "-m", "exaserve_hpc.launcher", "--site", str(site_file),
                             "--job-dir", str(job_dir), "--port", "0", "--no-curve"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


@pytest.mark.parametrize("how", ["SIGUSR1 to every task", "stop-requested file"])
def test_every_rank_stops_gracefully(tmp_path, how):
    l2 = tmp_path / "shm"
    site_file = write_local_site(tmp_path, weight_cache={"l2_path": str(l2)},
                                 cluster={"nodes": 2, "nodelist": "nodea,nodeb"},
                                 gateway={"host": None if how.startswith("SIGUSR1") else "0.0.0.0"})
    job_dir = tmp_path / "job"
    logs = [tmp_path / "rank0.log", tmp_path / "rank1.log"]
    ranks = [start_rank(site_file, job_dir, 0, "nodea", logs[0]), start_rank(site_file, job_dir, 1, "nodeb", logs[1])]
    try:
        deadline = time.monotonic() + 90
        status = {}
        while time.monotonic() < deadline:
            if any(r.poll() is not None for r in ranks):
                break
            result = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "status", "--json", "--run-dir",
                                     str(job_dir)], capture_output=True, text=True, timeout=30)
            if result.returncode == 0:
                status = json.loads(result.stdout)
                if sum(r["state"] == "serving" for r in status["replicas"]) >= 2:
                    break
            time.sleep(0.5)
        output = lambda: "\n".join(f"--- {p.name}\n{p.read_text()}" for p in logs)  # noqa: E731
        assert sum(r["state"] == "serving" for r in status.get("replicas", [])) >= 2, output()
        url = json.loads((job_dir / "serve.json").read_text())["url"]
        assert "0.0.0.0" not in url and "127.0.0.1" not in url and json.loads((job_dir / "controller.json").read_text())["gateway_url"] == url
        assert [p for p in l2.rglob("*") if p.is_file()], "the replicas' weights were not staged in L2"
        if how.startswith("SIGUSR1"):
            for r in ranks:
                os.kill(r.pid, signal.SIGUSR1)
        else:  # what the batch shell's trap writes when a signal reached it but not the tasks
            (job_dir / "stop-requested").touch()
        codes = [r.wait(timeout=60) for r in ranks]
        assert codes == [0, 0], output()
    finally:
        for r in ranks:
            if r.poll() is None:
                os.killpg(r.pid, signal.SIGKILL)
    state = load_state(job_dir / CHECKPOINT_FILE)
    assert state.job_id == "t1" and len(state.placement) == 2 and all(n for _, n in state.placement.values())
    assert [p for p in l2.rglob("*") if p.is_file()] == [], "an agent left L2 files behind"
    # The usage ledger lives beside the job directory, where a requeued or successor job appends too.
    assert (job_dir.parent / "usage").is_dir() and not (job_dir / "usage").exists()


def test_an_agent_rank_stops_by_itself_when_rank_0_gives_no_order():
    from exaserve_hpc.app.agents import stop_gracefully_on_signals
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGALRM, signal.SIGINT)}
    stopped = []
    try:
        stop_gracefully_on_signals(lambda: stopped.append(time.monotonic()), grace=0.3)
        sent = time.monotonic()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.1)
        assert stopped == [], "stopped before rank 0 had its chance"
        deadline = time.monotonic() + 5
        while not stopped and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(stopped) == 1 and stopped[0] - sent >= 0.3
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in saved.items():
            signal.signal(sig, handler)
