"""A node agent whose controller goes silent stops its replicas and exits, instead of serving nobody."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import zmq

from exaserve_hpc.agent.node_agent import EXIT_CONTROLLER_LOST
from exaserve_hpc.protocol import (
    AgentHeartbeat, AgentHello, EngineSettings, HeartbeatAck, ReplicaHello, StartReplica, decode, encode,
)

pytestmark = pytest.mark.process


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie child of the agent still answers kill(0) until the agent reaps it
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_an_agent_stops_its_replicas_and_exits_when_the_controller_goes_silent(tmp_path):
    context = zmq.Context()
    controller = context.socket(zmq.ROUTER)
    router = context.socket(zmq.ROUTER)  # where the replica registers, as with the real router
    for sock in (controller, router):
        sock.setsockopt(zmq.LINGER, 0)
    endpoint = f"tcp://127.0.0.1:{controller.bind_to_random_port('tcp://127.0.0.1')}"
    backend = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    agent = subprocess.Popen([sys.executable, "-m", "exaserve_hpc.agent", "--controller", endpoint,
                              "--agent-id", "silent-test", "--heartbeat", "0.2", "--controller-timeout", "2",
                              "--l2-dir", str(tmp_path / "l2")], stderr=subprocess.PIPE, text=True)
    try:
        peer, frame = controller.recv_multipart()
        assert isinstance(decode(frame), AgentHello)
        controller.send_multipart([peer, encode(StartReplica(
            replica_id="echo/r0", model="echo", model_dir="-", router_backend=backend,
            settings=EngineSettings(engine="echo", max_batch_size=4, max_seq_len=64)))])
        replica_pid = 0
        acked_until = time.monotonic() + 4.0  # twice the timeout: acknowledged heartbeats keep it alive
        while time.monotonic() < acked_until:
            if controller.poll(50):
                peer, frame = controller.recv_multipart()
                message = decode(frame)
                if isinstance(message, AgentHeartbeat):
                    controller.send_multipart([peer, encode(HeartbeatAck(seq=message.seq))])
            if router.poll(0):
                _, frame = router.recv_multipart()
                hello = decode(frame)
                if isinstance(hello, ReplicaHello):
                    replica_pid = hello.pid
        assert agent.poll() is None, "the agent left although its controller answered"
        assert replica_pid and alive(replica_pid)

        silent_since = time.monotonic()  # from now on nobody answers
        status = agent.wait(timeout=20)
        waited = time.monotonic() - silent_since
        log = agent.stderr.read()
        assert status == EXIT_CONTROLLER_LOST, log
        assert 1.5 < waited < 15, waited
        assert "no word from the controller" in log and "heartbeat.controller_timeout" in log
        assert not alive(replica_pid)
        assert not (tmp_path / "l2").exists() or not any((tmp_path / "l2").iterdir())
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        context.destroy(linger=0)
