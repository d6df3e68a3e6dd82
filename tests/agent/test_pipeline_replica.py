"""A pipeline-parallel replica across two node agents, through real processes.

A real controller places a pipeline_parallel=2 model on a two-node CPU site; two real node agents
(named n1 and n2, threads of the test process) start its two stage processes (real replica
processes) which find each other through the controller and link over ZeroMQ; stage 0 registers
with a real router. A request through the router gets the greedy tokens of the unsplit (PP=1)
reference engine over the same checkpoint. Killing the stage-1 process fails the replica (stage 0
reports it, naming the stage and node) and the controller starts it again, serving the same tokens.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import pytest
import zmq

from exaserve_hpc.agent.node_agent import NodeAgent
from exaserve_hpc.transport import CURVE_JOB_DIR_VARIABLE, make_curve_keys, secure_client
from exaserve_hpc.jobdir import JobDir
from exaserve_hpc.agent.stage_process import StageError, rendezvous
from exaserve_hpc.cache.checkpoint import TinyModelSpec, create_tiny_checkpoint, load_checkpoint
from exaserve_hpc.config.schema import parse_site
from exaserve_hpc.engine.base import EngineRequest
from exaserve_hpc.engine.reference import ReferenceEngine
from exaserve_hpc.protocol import (
    GenerateRequest, PipelineStage, ReplicaEvent, RequestError, StageHello, StartReplica, TokenChunk, decode,
    encode,
)
from exaserve_hpc.router.balancing import RoundRobin
from exaserve_hpc.router.dispatch import Dispatcher, DispatchSettings
from exaserve_hpc.router.zmq_router import ZmqRouter
from exaserve_hpc.controller.loop import Controller
from exaserve_hpc.controller.stage_rendezvous import PipelineStages
from tests.waiting import wait_for

pytestmark = pytest.mark.process

MODEL = "tiny"
TINY = TinyModelSpec(layers=4, hidden=64, heads=4, kv_heads=2, intermediate=96, max_position=256, shards=2, seed=7)
PROMPT = [256] + list(b"Pipeline stages on two nodes, one replica.")
MAX_TOKENS = 12




def pp_site(tmp_path, nodes: int = 2):
    return parse_site({
        "site": "pp-nodes", "run_dir": str(tmp_path / "run"),
        "cluster": {"nodes": nodes, "nodelist": f"n[1-{nodes}]", "gpus_per_node": 0,
                    "fault_groups": {"rack0": f"n[1-{nodes}]"}},
        "scheduler": {"tick_interval": 0.1, "min_replicas_per_model": 1, "cooldown_period": 3600},
        "heartbeat": {"interval": 0.5, "misses": 6},
        "weight_cache": {"l3_path": str(tmp_path / "models"), "l2_capacity": "64MiB"},
        "batching": {"max_wait_ms": 0},
        "models": [{"model_name": MODEL, "engine": "reference", "replicas": 1, "min_replicas": 1,
                    "pipeline_parallel": 2, "max_seq_len": 128}],
    })


def unsplit_tokens(model_dir, site) -> list[int]:
    """What one process holding every layer answers (PP=1), with the site's KV dtype."""
    model = site.model(MODEL)
    engine = ReferenceEngine.from_weights(*load_checkpoint(model_dir), max_seq_len=model.max_seq_len,
                                          kv_cache_dtype=model.kv_cache_dtype, max_wait_ms=0)
    engine.add_request(EngineRequest("want", PROMPT, MAX_TOKENS, stop_token_ids=()))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    return tokens


def generate(router: ZmqRouter, keys=None, timeout: float = 30.0) -> list[int]:
    gateway = router.context.socket(zmq.DEALER)
    gateway.setsockopt(zmq.LINGER, 0)
    if keys is not None:  # a client of a CURVE router holds the job's key, as the gateway does
        secure_client(gateway, keys)
    gateway.connect(router.frontend_endpoint)
    try:
        gateway.send(encode(GenerateRequest(request_id=uuid.uuid4().hex, model=MODEL, prompt_token_ids=PROMPT,
                                            max_tokens=MAX_TOKENS)))
        tokens: list[int] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if gateway.poll(100):
                message = decode(gateway.recv())
                assert not isinstance(message, RequestError), message
                assert isinstance(message, TokenChunk)
                tokens += message.token_ids
                if message.finished:
                    return tokens
        raise AssertionError(f"no finished answer in {timeout}s; got {tokens}")
    finally:
        gateway.close()


@pytest.fixture(params=["plain", "curve"])
def fleet(tmp_path, request):
    """Plain TCP as `exaserve serve` runs; or CURVE as under `exaserve launch`: the controller, the router
    and every stage link admit only the job's key, which the replicas read from the job directory."""
    site = pp_site(tmp_path)
    model_dir = create_tiny_checkpoint(site.model_dir(site.model(MODEL)), TINY)
    context = zmq.Context()
    keys, replica_env = None, None
    if request.param == "curve":
        jobdir = JobDir(tmp_path / "job").ensure()
        keys = make_curve_keys(jobdir)
        replica_env = {CURVE_JOB_DIR_VARIABLE: str(jobdir.path)}
    dispatcher = Dispatcher(RoundRobin(), DispatchSettings(max_attempts=3, first_token_timeout=30,
                                                           replica_expiry=3.0, request_timeout=60), {MODEL})
    router = ZmqRouter(dispatcher, context=context, curve=keys).start()
    controller = Controller(site, router, context=context, expected_agents=["n1", "n2"], placement_grace=10.0,
                            curve=keys)
    controller.start()
    agents, threads = {}, []
    for name in ("n1", "n2"):
        agents[name] = NodeAgent(controller.endpoint, name, 0.5, hostname=name, l2_root=str(tmp_path / f"l2-{name}"),
                                 pool_bytes=1 << 30, l2_capacity=64 << 20, replica_env=replica_env)
        if keys is not None:
            secure_client(agents[name].socket, keys)
        threads.append(threading.Thread(target=agents[name].run, daemon=True))
        threads[-1].start()
    yield site, model_dir, router, controller, agents, keys
    controller.shutdown(drain_timeout=2.0, wait=15.0)
    for thread in threads:
        thread.join(20)
    controller.stop()
    router.stop()
    context.destroy(linger=0)
    for agent in agents.values():  # no stage process outlives the test
        for slot in agent.replicas.values():
            assert slot.process is None or slot.process.poll() is not None, slot.replica_id


def serving(controller: Controller) -> bool:
    return controller.serving_count() == 1


def stage_slots(agents) -> dict[str, object]:
    """Live stage processes by node: replica id -> slot."""
    return {name: {rid: slot for rid, slot in agent.replicas.items()
                   if slot.process is not None and slot.process.poll() is None}
            for name, agent in agents.items()}


def test_a_pp2_replica_across_two_agents_serves_pp1_tokens_and_a_lost_stage_restarts_it(fleet):
    site, model_dir, router, controller, agents, keys = fleet
    want = unsplit_tokens(model_dir, site)
    wait_for(lambda: serving(controller), 90, "the PP=2 replica to serve")
    live = stage_slots(agents)
    stage0_node = controller.replicas[f"{MODEL}/r0000"].agent_id
    stage1_node = ({"n1", "n2"} - {stage0_node}).pop()
    assert list(live[stage0_node]) == [f"{MODEL}/r0000"]  # stage 0: the replica the router knows
    ((stage1_id, stage1),) = live[stage1_node].items()
    assert stage1_id == f"{MODEL}/r0000~s1@1" and stage1.spec.stage.rank == 1
    assert stage1.spec.stage.nodes == [stage0_node, stage1_node]

    assert generate(router, keys) == want and len(want) == MAX_TOKENS

    os.kill(stage1.process.pid, signal.SIGKILL)  # stage 1's process dies: the whole replica fails
    record = controller.replicas[f"{MODEL}/r0000"]
    wait_for(lambda: record.restarts == 1, 30, "stage 0 to report the lost stage")
    assert "stage 1 on node " + stage1_node in record.detail, record.detail  # stage 0 named what it lost
    wait_for(lambda: serving(controller) and stage_slots(agents)[stage1_node], 90,
             "the replica to serve again with a new stage 1")
    assert generate(router, keys) == want
    ((new_id, _),) = stage_slots(agents)[stage1_node].items()
    assert new_id == f"{MODEL}/r0000~s1@2"


def test_stage_zero_fails_naming_the_stage_and_node_that_never_appears():
    """The rendezvous against the controller's directory over real ZeroMQ: stage 1 never says hello."""
    context = zmq.Context()
    directory = PipelineStages(rendezvous="")
    controller = context.socket(zmq.ROUTER)
    port = controller.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            if controller.poll(50):
                peer, frame = controller.recv_multipart()
                message = decode(frame)
                assert isinstance(message, StageHello)
                controller.send_multipart([peer, encode(directory.on_hello(message))])

    spec = StartReplica(replica_id="m/r0000", model="m", model_dir="-", router_backend="tcp://127.0.0.1:1")
    (_, first), _ = directory.stage_starts([("n1", spec), ("n2", spec)])
    stage = PipelineStage(**{**{f: getattr(first.stage, f) for f in first.stage.__struct_fields__},
                             "rendezvous": f"tcp://127.0.0.1:{port}", "rendezvous_timeout": 1.5})
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        started = time.monotonic()
        with pytest.raises(StageError, match=r"stage 1 on node n2 did not appear within 1.5s"):
            rendezvous(stage, "tcp://127.0.0.1:9", "n1")
        assert time.monotonic() - started < 5
        # A later stage that its agent reports failed fails the attempt at once, with the reason.
        directory.on_stage_event(ReplicaEvent(agent_id="n2", replica_id="m/r0000~s1@1", state="failed",
                                              detail="reserve failed: 2 GiB asked, 1 GiB free"))
        with pytest.raises(StageError, match=r"stage 1 on node n2 failed: reserve failed"):
            rendezvous(stage, "tcp://127.0.0.1:9", "n1")
    finally:
        stop.set()
        thread.join(2)
        controller.close(linger=0)
        context.term()


@pytest.fixture
def three_node_fleet(tmp_path):
    """The same site on three nodes, each agent its own process (so a node can be killed outright)."""
    import subprocess
    import sys

    site = pp_site(tmp_path, nodes=3)
    model_dir = create_tiny_checkpoint(site.model_dir(site.model(MODEL)), TINY)
    context = zmq.Context()
    dispatcher = Dispatcher(RoundRobin(), DispatchSettings(max_attempts=3, first_token_timeout=30,
                                                           replica_expiry=3.0, request_timeout=60), {MODEL})
    router = ZmqRouter(dispatcher, context=context).start()
    controller = Controller(site, router, context=context, expected_agents=["n1", "n2", "n3"],
                            placement_grace=10.0).start()
    agents = {name: subprocess.Popen(
        [sys.executable, "-m", "exaserve_hpc.agent", "--controller", controller.endpoint, "--agent-id", name,
         "--heartbeat", "0.5", "--l2-dir", str(tmp_path / f"l2-{name}"), "--l2-capacity", "64MiB",
         "--memory-pool", "1GiB", "--controller-timeout", "30"], stdin=subprocess.DEVNULL)
        for name in ("n1", "n2", "n3")}
    yield site, model_dir, router, controller, agents
    controller.shutdown(drain_timeout=2.0, wait=15.0)
    for process in agents.values():
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    controller.stop()
    router.stop()
    context.destroy(linger=0)


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
        except OSError:
            continue
    return found


def alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_losing_a_stage_node_moves_the_whole_replica_and_it_serves_the_same_tokens(three_node_fleet):
    site, model_dir, router, controller, agents = three_node_fleet
    want = unsplit_tokens(model_dir, site)
    wait_for(lambda: serving(controller), 90, "the PP=2 replica to serve")
    record = controller.replicas[f"{MODEL}/r0000"]
    first = record.assignment.nodes
    assert len(set(first)) == 2 and generate(router) == want
    (stage1_pid,) = children(agents[first[1]].pid)
    agents[first[1]].kill()  # stage 1's node dies: its agent at once, its stage process with it
    agents[first[1]].wait()
    wait_for(lambda: not alive(stage1_pid), 10, "the orphaned stage-1 process to exit")
    wait_for(lambda: controller.agents[first[1]].lost, 30, "the node to be declared lost")
    wait_for(lambda: serving(controller) and first[1] not in record.assignment.nodes, 90,
             "the replica to serve again on live nodes")
    assert len(set(record.assignment.nodes)) == 2
    assert generate(router) == want
