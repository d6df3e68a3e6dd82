"""One malformed controller message is no outage, through a real `exaserve serve`: a peer holding the run's
key (a buggy agent, or anything of the same user) sends a heartbeat naming a real replica in a state no
replica can be in, an undecodable frame and a message of the wrong types. The controller drops them (status
counts them), keeps its agent and replicas, /health stays 200 and requests are served. (It used to raise in
the handler and end the controller thread; 60 s later the agent stopped every replica.)"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import msgspec
import openai
import pytest
import zmq

from exaserve_hpc.jobdir import JobDir
from exaserve_hpc.transport import load_client_keys, secure_client
from exaserve_hpc.protocol import AgentHeartbeat, AgentHello, HeartbeatAck, ReplicaStatus, decode, encode

from serve_harness import start_serve, stop_serve, write_local_site

pytestmark = pytest.mark.process


def status(tmp_path) -> dict:
    run = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "status", "--json", "--run-dir",
                          str(tmp_path / "run")], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)


def test_a_malformed_heartbeat_to_a_real_serve_is_dropped_and_it_keeps_serving(tmp_path):
    process, url, lines = start_serve(write_local_site(tmp_path))
    context = zmq.Context()
    rogue = context.socket(zmq.DEALER)
    try:
        deadline = time.monotonic() + 60
        while True:
            state = status(tmp_path)
            if sum(r["state"] == "serving" for r in state["replicas"]) == 2:
                break
            assert time.monotonic() < deadline, state
            time.sleep(0.5)
        endpoint = state["controller"]["endpoint"]
        if (tmp_path / "run" / "keys").is_dir():
            secure_client(rogue, load_client_keys(JobDir(tmp_path / "run")))
        rogue.setsockopt(zmq.IDENTITY, b"buggy-agent")
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(endpoint)
        rid = state["replicas"][0]["replica_id"]
        rogue.send(encode(AgentHello(agent_id="buggy-agent", hostname="x", pid=1)))
        for _ in range(3):
            rogue.send(encode(AgentHeartbeat(agent_id="buggy-agent", seq=1, replicas=[
                ReplicaStatus(replica_id=rid, model="tiny-llama", state="exploded")])))
        rogue.send(b"\xc1 garbage")
        rogue.send(msgspec.msgpack.encode({"t": "agent_hb", "agent_id": 5, "seq": "x"}))
        # the controller still answers: a good heartbeat after the bad ones is acknowledged
        rogue.send(encode(AgentHeartbeat(agent_id="buggy-agent", seq=7)))
        assert rogue.poll(10_000), "no answer from the controller after a malformed message"
        assert isinstance(decode(rogue.recv()), HeartbeatAck)
        deadline = time.monotonic() + 20
        while (state := status(tmp_path))["controller"].get("dropped_messages", 0) < 5:
            assert time.monotonic() < deadline, state["controller"]
            time.sleep(0.3)
        time.sleep(3)  # several heartbeat intervals: a dead controller would show by now
        state = status(tmp_path)
        assert state["controller"]["liveness"] == "ok"
        assert [r["state"] for r in state["replicas"]] == ["serving", "serving"]
        assert all(a["state"] == "alive" for a in state["agents"] if a["agent_id"] != "buggy-agent")
        with urllib.request.urlopen(f"{url}/health", timeout=10) as health:
            assert health.status == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        assert client.completions.create(model="tiny-llama", prompt="Hello", max_tokens=4).usage.completion_tokens
    except BaseException:
        process.kill()
        raise
    finally:
        rogue.close(linger=0)
        context.term()
    stop_serve(process, lines)
    assert sum("bad message" in line and "exploded" in line for line in lines) <= 1  # logged once
