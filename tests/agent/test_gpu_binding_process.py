"""GPU binding through a real node agent process and real replica processes.

The agent runs as `python -m exaserve_hpc.agent --gpus-per-node N` with the variables Slurm sets for a
step granted GPUs; a test socket plays the controller. Each replica's environment is read from
/proc/PID/environ and compared with what the agent reports for it. No GPU exists here: the devices
are stand-ins (the echo engine computes nothing on them), so what is checked is exactly what a
GPU's driver would receive: CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER and the CPU affinity.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from agent_harness import AgentUnderTest, alive
from exaserve_hpc.agent.gpu_binding import detect_grant
from exaserve_hpc.agent.node_agent import EXIT_BAD_GRANT
from exaserve_hpc.agent.nvml_probe import NvmlDevice
from exaserve_hpc.protocol import (
    AgentHeartbeat, AgentHello, EngineSettings, ReplicaEvent, Shutdown, StartReplica, decode, encode,
)

pytestmark = pytest.mark.process

GiB, MiB = 1 << 30, 1 << 20
STEP = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_STEP_GPUS": "0,1,2,3", "SLURM_JOB_GPUS": "0,1,2,3",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3"}  # what Slurm sets for a step granted gpu:4 on a node


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


class AgentProcess:
    """`python -m exaserve_hpc.agent` with a chosen environment, driven from a test ROUTER socket."""

    def __init__(self, tmp_path: Path, env: dict[str, str], *args: str):
        self.context = zmq.Context()
        self.controller = self.context.socket(zmq.ROUTER)
        self.router = self.context.socket(zmq.ROUTER)  # the replicas' router backend: they say hello there
        for sock in (self.controller, self.router):
            sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.controller.bind_to_random_port('tcp://127.0.0.1')}"
        self.backend = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CUDA_"))}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "exaserve_hpc.agent", "--controller", self.endpoint, "--agent-id", "gpu-node",
             "--heartbeat", "0.2", "--controller-timeout", "0", "--l2-dir", str(tmp_path / "l2"),
             "--memory-pool", "1GiB", "--memory-block", "1MiB", *args],
            env={**clean, **env}, stderr=subprocess.PIPE, text=True)
        self.peer = b""
        self.messages: list = []

    def pump(self, timeout: float = 0.05) -> None:
        while self.controller.poll(int(timeout * 1000)):
            self.peer, frame = self.controller.recv_multipart()
            self.messages.append(decode(frame))
            timeout = 0.0
        while self.router.poll(0):
            self.router.recv_multipart()

    def start(self, replica_id: str, memory_bytes: int, gpu_indices: list[int] = (), devices: int = 1) -> None:
        self.controller.send_multipart([self.peer, encode(StartReplica(
            replica_id=replica_id, model="echo", model_dir="-", router_backend=self.backend,
            settings=EngineSettings(engine="echo", max_batch_size=4, max_seq_len=64), drain_timeout=2.0,
            memory_bytes=memory_bytes, devices=devices, gpu_indices=list(gpu_indices)))])

    def wait_for(self, predicate, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.pump()
            found = [m for m in self.messages if predicate(m)]
            if found:
                return found[-1]
            assert self.process.poll() is None, self.process.stderr.read()
        raise AssertionError(f"timed out; got {[type(m).__name__ for m in self.messages][-20:]}")

    def close(self) -> None:
        if self.peer and self.process.poll() is None:
            self.controller.send_multipart([self.peer, encode(Shutdown(drain_timeout=2.0))])
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                pass
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.context.destroy(linger=0)


def test_each_replica_holds_exactly_the_granted_devices_status_shows(tmp_path):
    agent = AgentProcess(tmp_path, STEP, "--gpus-per-node", "4")
    try:
        hello = agent.wait_for(lambda m: isinstance(m, AgentHello))
        assert hello.memory.device_ids == ["0", "1", "2", "3"]  # the pool's devices are the grant
        agent.start("whole/r0", GiB)  # a whole device each: the agent picks the freest
        agent.start("whole/r1", GiB)
        agent.start("half/r0", GiB // 2, [3])  # the controller planned both halves on device 3
        agent.start("half/r1", GiB // 2, [3])
        agent.start("outside/r0", MiB, [5])  # not granted: refused, never bound elsewhere
        refused = agent.wait_for(lambda m: isinstance(m, ReplicaEvent) and m.replica_id == "outside/r0"
                                 and m.state == "failed")
        assert "not granted" in refused.detail

        names = {"whole/r0", "whole/r1", "half/r0", "half/r1"}
        beat = agent.wait_for(lambda m: isinstance(m, AgentHeartbeat) and {
            r.replica_id for r in m.replicas if r.pid and r.devices and r.state != "failed"} >= names)
        statuses = {r.replica_id: r for r in beat.replicas if r.replica_id in names}
        seen = {}
        for rid, status in statuses.items():
            env = environ_of(status.pid)
            assert env["CUDA_VISIBLE_DEVICES"].split(",") == status.devices, rid
            assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" and env["SLURM_STEP_GPUS"] == "0,1,2,3"
            assert set(status.devices) <= set(STEP["SLURM_STEP_GPUS"].split(",")), rid  # within the grant
            pool_devices = beat.memory.devices[rid]
            assert [beat.memory.device_ids[i] for i in pool_devices] == status.devices
            seen[rid] = (set(status.devices), beat.memory.reservations[rid] // len(pool_devices))
        assert statuses["half/r0"].devices == statuses["half/r1"].devices == ["3"]
        for a in seen:
            for b in seen:
                if a < b and seen[a][0] & seen[b][0]:  # an overlap only where both hold part of a GPU
                    assert max(seen[a][1], seen[b][1]) < GiB, (a, b, seen)
        assert seen["whole/r0"][0] != seen["whole/r1"][0]
        pids = [s.pid for s in statuses.values()]
    finally:
        agent.close()
    assert agent.process.returncode == 0
    assert not any(alive(pid) for pid in pids)


def test_a_site_asking_more_gpus_than_the_step_was_granted_is_refused_at_start(tmp_path):
    agent = AgentProcess(tmp_path, STEP, "--gpus-per-node", "8")
    try:
        assert agent.process.wait(timeout=30) == EXIT_BAD_GRANT
        error = agent.process.stderr.read()
        assert "cluster.gpus_per_node is 8" in error and "granted 4 GPU(s)" in error
        assert "SLURM_STEP_GPUS=0,1,2,3" in error and "Traceback" not in error
        assert not agent.controller.poll(0)  # it never said hello
        assert not (tmp_path / "l2").exists()  # refused before it made anything
    finally:
        agent.close()


@pytest.mark.parametrize("env, args", [(STEP, ("--gpus-per-node", "0")), ({}, ())],
                         ids=["cpu-site-on-a-gpu-step", "laptop"])
def test_replicas_of_a_cpu_node_see_no_gpu(tmp_path, env, args):
    agent = AgentProcess(tmp_path, env, *args)
    try:
        hello = agent.wait_for(lambda m: isinstance(m, AgentHello))
        assert hello.memory.device_ids == [] and len(hello.memory.total) == 1  # the host, one device
        agent.start("cpu/r0", MiB)
        beat = agent.wait_for(lambda m: isinstance(m, AgentHeartbeat) and any(r.pid for r in m.replicas))
        status = beat.replicas[0]
        assert status.devices == [] and environ_of(status.pid)["CUDA_VISIBLE_DEVICES"] == ""
    finally:
        agent.close()
    assert agent.process.returncode == 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to tell affinities apart")
def test_a_replica_is_pinned_to_the_cpus_nvml_calls_near_its_gpu(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))[:2]
    # stand-in NVML readings (no GPU here): what read_devices() would return on a two-socket node
    nvml = [NvmlDevice(0, "GPU-stand-in-0", 0, GiB, frozenset({cpus[0]})),
            NvmlDevice(1, "GPU-stand-in-1", 1, GiB, frozenset({cpus[1]}))]
    before = os.sched_getaffinity(0)
    agent = AgentUnderTest(tmp_path, grant=detect_grant({}, nvml, 2))
    try:
        agent.start("pin/r0", "-", engine="echo", gpu_indices=[1])
        agent.start("pin/r1", "-", engine="echo", gpu_indices=[0])
        beat = agent.settle(lambda b: sum(bool(r.pid) for r in b.replicas) == 2)
        for status in beat.replicas:
            gpu = int(status.devices[0][-1])
            assert environ_of(status.pid)["CUDA_VISIBLE_DEVICES"] == f"GPU-stand-in-{gpu}"
            assert os.sched_getaffinity(status.pid) == {cpus[gpu]}, status.replica_id
        assert {r.replica_id: r.devices for r in beat.replicas} == {"pin/r0": ["GPU-stand-in-1"],
                                                                    "pin/r1": ["GPU-stand-in-0"]}
        assert os.sched_getaffinity(agent.thread.native_id) == before  # the agent's thread got its CPUs back
    finally:
        agent.close()


def test_controller_status_shows_each_replicas_devices_as_its_environment_holds_them(tmp_path):
    """A real controller thread, a real agent process granted gpu:4 by Slurm's variables, real replica
    processes: status()["replicas"][i]["devices"] (what `exaserve status --json` prints) is each replica's
    CUDA_VISIBLE_DEVICES, entry for entry, and the status table shows it. The router is the controller
    tests' stand-in (tests/unit/controller/test_controller.py) with a real socket where the replicas say hello."""
    import io

    import yaml
    from rich.console import Console

    from exaserve_hpc.cli import main as cli
    from exaserve_hpc.config.schema import parse_site
    from exaserve_hpc.controller.loop import Controller
    from tests.unit.controller.test_controller import FakeRouter

    data = yaml.safe_load((Path(__file__).resolve().parents[2] / "site-configs" / "local.yaml").read_text())
    data["cluster"].update(gpus_per_node=4, gpu_memory="1GiB")
    data["models"][0].update(engine="echo", replicas=3)
    data["models"][0].pop("tiny")
    data["weight_cache"]["l3_path"] = str(tmp_path / "models")
    site = parse_site(data)
    context = zmq.Context()
    backend = context.socket(zmq.ROUTER)
    backend.setsockopt(zmq.LINGER, 0)
    router = FakeRouter()
    router.backend_endpoint = f"tcp://127.0.0.1:{backend.bind_to_random_port('tcp://127.0.0.1')}"
    controller = Controller(site, router, host="127.0.0.1").start()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "CUDA_"))}
    agent = subprocess.Popen(
        [sys.executable, "-m", "exaserve_hpc.agent", "--controller", controller.endpoint, "--agent-id",
         site.cluster.hostnames()[0], "--heartbeat", "0.3", "--l2-dir", str(tmp_path / "l2"), "--gpus-per-node", "4",
         "--memory-pool", "1GiB"], env={**clean, **STEP}, stderr=subprocess.PIPE, text=True)
    try:
        # Status lags the processes by a heartbeat: a replica restarted under load may show its old pid
        # for a moment. Compare once every replica runs; a persistent difference fails at the deadline.
        deadline = time.monotonic() + 120
        while True:
            while backend.poll(0):
                backend.recv_multipart()
            status = controller.status()
            replicas, held = status.get("replicas", []), {}  # none while the controller is busy
            if len(replicas) == 3 and all(r["pid"] and r["devices"] for r in replicas):
                try:
                    held = {r["replica_id"]: environ_of(r["pid"])["CUDA_VISIBLE_DEVICES"].split(",")
                            for r in replicas}
                except OSError:  # that process is gone: a newer one will be reported
                    held = {}
                if held == {r["replica_id"]: r["devices"] for r in replicas}:
                    break
            assert time.monotonic() < deadline and agent.poll() is None, (replicas, held, agent.poll())
            time.sleep(0.2)
        assert all(set(r["devices"]) <= {"0", "1", "2", "3"} for r in replicas), replicas
        console = Console(file=io.StringIO(), width=250)
        cli.out, saved = console, cli.out
        try:
            cli.render_status(status, "http://test")
        finally:
            cli.out = saved
        rows = [line for line in console.file.getvalue().splitlines() if "tiny-llama/r000" in line]
        for r in replicas:
            assert any(r["replica_id"] in row and f" {','.join(r['devices'])} " in row for row in rows), rows
    finally:
        controller.shutdown(drain_timeout=2.0, wait=15.0)
        try:
            agent.wait(timeout=20)
        except subprocess.TimeoutExpired:
            agent.kill()
        controller.stop()
        context.destroy(linger=0)
