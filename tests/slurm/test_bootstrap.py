"""Bootstrap: role by rank, inventory exchange through the job directory (and MPI), the controller's
address and CURVE keys published privately, and a stale controller.json never taken for the current run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time

import pytest
import zmq

from exaserve_hpc.jobdir import BootstrapError, JobDir
from exaserve_hpc.bootstrap import ControllerInfo, NodeInventory, detect_rank, exchange_inventories, publish_controller, wait_for_controller
from exaserve_hpc.batch.base import RankInfo, Role, role_for
from exaserve_hpc.transport import load_client_keys, make_curve_keys, secure_client, secure_server


def test_rank_from_slurm_then_local():
    rank = detect_rank({"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURMD_NODENAME": "n3", "SLURM_JOB_ID": "9",
                        "SLURM_RESTART_COUNT": "1"})
    assert rank == RankInfo(2, 4, "n3", "9", 1, "slurm")
    assert detect_rank({}).rank == 0 and detect_rank({}).source == "local"
    assert role_for(0) is Role.CONTROLLER and role_for(3) is Role.AGENT


def test_rank_from_an_mpi_communicator_wins_over_slurm():
    class Comm:
        def Get_rank(self):
            return 1

        def Get_size(self):
            return 2

    rank = detect_rank({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, comm=Comm())
    assert (rank.rank, rank.size, rank.source) == (1, 2, "mpi")


def ranks(size: int, job: str = "5", restart: int = 0) -> list[RankInfo]:
    return [RankInfo(r, size, f"n{r + 1}", job, restart, "slurm") for r in range(size)]


def test_file_exchange_gathers_every_inventory_and_agents_find_the_controller(tmp_path):
    jobdir = JobDir(tmp_path / "job").ensure()
    infos = ranks(4)
    seen: dict[int, ControllerInfo] = {}

    def agent(rank: RankInfo) -> None:
        exchange_inventories(rank, jobdir, NodeInventory(rank.rank, rank.node, "h", 100 + rank.rank))
        seen[rank.rank] = wait_for_controller(rank, jobdir, timeout=20, poll=0.02)

    threads = [threading.Thread(target=agent, args=(r,)) for r in infos[1:]]
    for t in threads:
        t.start()
    gathered = exchange_inventories(infos[0], jobdir, NodeInventory(0, "n1", "h", 100), timeout=20, poll=0.02)
    assert [g.node for g in gathered] == ["n1", "n2", "n3", "n4"]
    publish_controller(infos[0], jobdir, ControllerInfo("5", 0, "tcp://n1:1234", nodes=[g.node for g in gathered]))
    for t in threads:
        t.join(20)
    assert {r: i.endpoint for r, i in seen.items()} == {1: "tcp://n1:1234", 2: "tcp://n1:1234", 3: "tcp://n1:1234"}
    for path in [jobdir.controller_file, *jobdir.path.glob("inventory/*.json")]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE(jobdir.path.stat().st_mode) == 0o700


def test_rank_zero_goes_on_without_a_rank_that_never_reports(tmp_path):
    jobdir = JobDir(tmp_path).ensure()
    r0, r1, _ = ranks(3)
    exchange_inventories(r1, jobdir, NodeInventory(1, "n2", "h", 2))
    started = time.monotonic()
    gathered = exchange_inventories(r0, jobdir, NodeInventory(0, "n1", "h", 1), timeout=0.5, poll=0.05)
    assert [g.rank for g in gathered] == [0, 1] and time.monotonic() - started < 5


def test_a_controller_file_from_before_the_requeue_is_ignored(tmp_path):
    jobdir = JobDir(tmp_path).ensure()
    publish_controller(ranks(2, restart=0)[0], jobdir, ControllerInfo("5", 0, "tcp://old:1"))
    with pytest.raises(BootstrapError, match="restart 1"):
        wait_for_controller(ranks(2, restart=1)[1], jobdir, timeout=0.3, poll=0.05)
    publish_controller(ranks(2, restart=1)[0], jobdir, ControllerInfo("5", 1, "tcp://new:2"))
    assert wait_for_controller(ranks(2, restart=1)[1], jobdir, timeout=2).endpoint == "tcp://new:2"


def test_curve_keys_admit_the_job_client_and_refuse_others(tmp_path):
    jobdir = JobDir(tmp_path).ensure()
    keys = make_curve_keys(jobdir)
    assert {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "keys").iterdir()} == {0o600}
    context = zmq.Context()
    server = context.socket(zmq.ROUTER)
    auth = secure_server(server, keys, context)
    port = server.bind_to_random_port("tcp://127.0.0.1")

    def client(job_keys: bool) -> zmq.Socket:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if job_keys:
            secure_client(sock, load_client_keys(jobdir, keys.server_public.decode()))
        else:
            public, secret = zmq.curve_keypair()
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys.server_public, public, secret
        sock.connect(f"tcp://127.0.0.1:{port}")
        return sock

    sockets = []
    try:
        stranger, member = client(False), client(True)
        sockets = [stranger, member]
        stranger.send(b"stranger")
        member.send(b"member")
        received = []
        deadline = time.monotonic() + 15  # the handshake is slow on a busy machine
        while b"member" not in received and time.monotonic() < deadline:
            if server.poll(200):
                received.append(server.recv_multipart()[1])
        while server.poll(1000):  # give the stranger every chance to get through
            received.append(server.recv_multipart()[1])
        assert received == [b"member"]
    finally:
        for sock in sockets:
            sock.close(0)
        auth.stop()
        server.close(0)
        context.destroy(linger=0)


MPI_SCRIPT = r"""
import json, sys
from mpi4py import MPI
from exaserve_hpc.bootstrap import (ControllerInfo, JobDir, NodeInventory, detect_rank, exchange_inventories,
                                    publish_controller, wait_for_controller)
comm = MPI.COMM_WORLD
rank = detect_rank(comm=comm)
jobdir = JobDir(sys.argv[1]).ensure()
got = exchange_inventories(rank, jobdir, NodeInventory(rank.rank, f"node{rank.rank}", "h", rank.rank), comm)
if rank.rank == 0:
    publish_controller(rank, jobdir, ControllerInfo(rank.job_id, rank.restart, "tcp://rank0:1", nodes=[g.node for g in got]), comm)
    info = None
else:
    info = wait_for_controller(rank, jobdir, comm)
# One file per rank: mpirun interleaves the ranks' stdout.
with open(f"{sys.argv[2]}/rank-{rank.rank}.json", "w") as f:
    json.dump({"rank": rank.rank, "size": rank.size, "source": rank.source,
               "endpoint": info.endpoint if info else None, "gathered": [g.node for g in got]}, f)
"""


@pytest.mark.mpi
def test_bootstrap_under_mpirun_uses_gather_and_bcast(tmp_path):
    pytest.importorskip("mpi4py", reason="pip install mpi4py")
    if not shutil.which("mpirun"):
        pytest.skip("OpenMPI's mpirun is not installed (apt-get install openmpi-bin)")
    script = tmp_path / "boot.py"
    script.write_text(MPI_SCRIPT)
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_btl": "self,vader", "OMPI_MCA_rmaps_base_oversubscribe": "1",
           "OMPI_MCA_mpi_yield_when_idle": "1"}  # 3 ranks on 2 shared cores: do not spin
    # Its own session, output to a file: on a timeout we kill mpirun *and* its ranks, and nothing
    # holds a pipe open (subprocess.run(timeout=) would wait forever on an orphaned rank's stdout).
    log = tmp_path / "mpirun.log"
    with log.open("w") as out:
        process = subprocess.Popen(["mpirun", "-np", "3", sys.executable, str(script), str(tmp_path / "job"),
                                    str(tmp_path)], stdout=out, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
        try:
            returncode = process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            pytest.fail(f"mpirun did not finish in 90 s:\n{log.read_text()}")
    assert returncode == 0, log.read_text()
    lines = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(3)]
    assert [d["source"] for d in lines] == ["mpi"] * 3 and [d["size"] for d in lines] == [3] * 3
    assert lines[0]["gathered"] == ["node0", "node1", "node2"]
    assert [d["endpoint"] for d in lines[1:]] == ["tcp://rank0:1", "tcp://rank0:1"]
    # Only the gather and the bcast were collective: no inventory files needed under MPI.
    assert not list((tmp_path / "job" / "inventory").iterdir())
