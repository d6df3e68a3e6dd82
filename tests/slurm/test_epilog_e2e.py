"""The admins' epilog (sbatch/exaserve-epilog.sh), as the local Slurm cluster runs it after every job
on every node (slurm.conf Epilog=): it removes the L2 a job left in the node's /dev/shm, but not while
another job of the same user still runs on that node. Marked slurm: under CI=true it must run."""

from __future__ import annotations

import subprocess

import pytest

from tests.waiting import wait_for

from .fleet import epilog_lines, node_shm

pytestmark = [pytest.mark.slurm]

NODE = "n2"


def sbatch_sleeper() -> int:
    """A small job on NODE that shares it (one CPU, a little memory, not exclusive)."""
    result = subprocess.run(["sbatch", "--parsable", f"--nodelist={NODE}", "--ntasks=1", "--cpus-per-task=1",
                             "--mem=64M", "--output=/dev/null", "--wrap", "sleep 300"],
                            capture_output=True, text=True, timeout=30, check=True)
    return int(result.stdout.strip().split(";")[0])


def running(job: int) -> bool:
    out = subprocess.run(["squeue", "-h", "-j", str(job), "-o", "%T"], capture_output=True, text=True,
                         timeout=30).stdout.strip()
    return out == "RUNNING"




def test_epilog_removes_a_jobs_leftover_l2_unless_the_user_still_runs_a_job_there(slurm_cluster):
    first, second = sbatch_sleeper(), sbatch_sleeper()
    try:
        wait_for(lambda: running(first) and running(second), 60, "both jobs running on " + NODE, interval=0.5)
        # What an agent killed past its grace time leaves: its L2 under the node's /dev/shm.
        leftover = node_shm(NODE) / "exaserve-l2-0" / NODE
        leftover.mkdir(parents=True, exist_ok=True)
        (leftover / "weights.bin").write_bytes(b"\0" * 4096)
        # and an etcd member's data of each job (ha.etcd.members), under the node's own /tmp
        etcd = node_shm(NODE).parent / "tmp" / "exaserve-etcd-0"
        for job in (first, second):
            (etcd / f"{job}-0" / "etcd-1" / "member" / "wal").mkdir(parents=True, exist_ok=True)
            (etcd / f"{job}-0" / "etcd-1" / "member" / "wal" / "0.wal").write_bytes(b"\0" * 8192)

        subprocess.run(["scancel", str(first)], check=True, timeout=30)
        said = wait_for(lambda: len(epilog_lines(first)) >= 2 and epilog_lines(first), 60,
                        f"the epilog of job {first}", interval=0.5)
        assert any("kept L2 of uid 0: other jobs on this node" in line and str(second) in line for line in said), said
        assert any(f"removed leftover etcd data /tmp/exaserve-etcd-0/{first}-0" in line for line in said), said
        assert (leftover / "weights.bin").exists()
        assert not (etcd / f"{first}-0").exists() and (etcd / f"{second}-0").exists()  # only its own job's

        subprocess.run(["scancel", str(second)], check=True, timeout=30)
        said = wait_for(lambda: len(epilog_lines(second)) >= 2 and epilog_lines(second), 60,
                        f"the epilog of job {second}", interval=0.5)
        assert any("removed leftover L2 /dev/shm/exaserve-l2-0 (1 files" in line for line in said), said
        assert not (node_shm(NODE) / "exaserve-l2-0").exists()
        assert not etcd.exists()
    finally:
        subprocess.run(["scancel", str(first), str(second)], capture_output=True, timeout=30)
