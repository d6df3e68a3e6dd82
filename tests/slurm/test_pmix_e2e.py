"""Why the batch script may start its ranks with `srun --mpi=pmix`: on the local Slurm cluster (one
network and mount namespace per node, PMIx), an mpi4py world spans the job's nodes, and losing a node
under `--no-kill --kill-on-bad-exit=0` does not take the surviving ranks down: they run on, finalize
and exit 0, as exaserve's ranks must (after the bootstrap they use no MPI collective). Marked slurm
and mpi: under CI=true it must run."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.waiting import wait_for

from .fleet import cluster, task_exits

pytestmark = [pytest.mark.slurm, pytest.mark.mpi, pytest.mark.process]

RANK = """
import socket, sys, time
from mpi4py import MPI
world = MPI.COMM_WORLD
names = world.allgather(socket.gethostname())  # a collective across the nodes, as the bootstrap does
out = open(f"{sys.argv[1]}/rank{world.Get_rank()}.log", "a", buffering=1)
out.write(f"rank {world.Get_rank()} of {world.Get_size()} on {socket.gethostname()}: {','.join(names)}\\n")
for beat in range(int(sys.argv[2])):
    out.write(f"beat {beat}\\n")
    time.sleep(1)
out.write("done\\n")
"""


def state(job: int) -> str:
    return subprocess.run(["squeue", "-h", "-j", str(job), "-o", "%T"], capture_output=True, text=True,
                          timeout=30).stdout.strip()


def test_pmix_world_spans_the_nodes_and_survivors_outlive_a_lost_node(slurm_cluster, shared_tmp):
    pytest.importorskip("mpi4py")
    (shared_tmp / "rank.py").write_text(RANK)
    script = shared_tmp / "job.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --nodes=3 --ntasks-per-node=1 --no-kill --exclusive --output={shared_tmp}/job.out
srun --no-kill --kill-on-bad-exit=0 --mpi=pmix {sys.executable} {shared_tmp}/rank.py {shared_tmp} 40
echo "srun exited with $?"
""")
    job = int(subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True,
                             check=True, timeout=30).stdout.strip().split(";")[0])
    victim = None
    try:
        logs = [shared_tmp / f"rank{r}.log" for r in range(3)]
        # Nodes an earlier test's job still holds (COMPLETING on a node it killed) may keep this one pending:
        # the 60 s for the ranks to start count from when it runs.
        wait_for(lambda: state(job) not in ("PENDING", "CONFIGURING", ""), 240, f"job {job} to start", interval=1.0)
        wait_for(lambda: all(p.exists() and "beat 2" in p.read_text() for p in logs), 60, "every rank's beat 2",
                 interval=0.5)
        first = [p.read_text().splitlines()[0] for p in logs]
        assert all(line.startswith(f"rank {r} of 3 on ") for r, line in enumerate(first)), first
        hosts = [line.split(" on ")[1].split(":")[0] for line in first]
        assert len(set(hosts)) == 3 and all(line.endswith(",".join(hosts)) for line in first), first
        victim = hosts[2]
        cluster("kill-node", victim)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and "srun exited" not in (shared_tmp / "job.out").read_text():
            time.sleep(1)
        output = (shared_tmp / "job.out").read_text()
        # The survivors ran their 40 beats and finalized; the lost node's rank never came back.
        assert all(logs[r].read_text().endswith("done\n") for r in (0, 1)), [p.read_text()[-200:] for p in logs]
        assert not logs[2].read_text().endswith("done\n")
        exits = task_exits(job)
        assert exits.get(0) == "exit 0" and exits.get(1) == "exit 0", (exits, output)
        assert "srun exited with 0" in output, output
    finally:
        subprocess.run(["scancel", str(job)], capture_output=True, timeout=30)
        if victim:
            cluster("revive-node", victim, check=False)
