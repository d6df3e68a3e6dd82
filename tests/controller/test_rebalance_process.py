"""A rebalance round through real processes: the controller and router in this process, two real node
agents (`python -m exaserve_hpc.agent`), real replica processes of the CPU reference engine.

Both replicas of a model start on node a (the only agent at first); node b joins; the next rebalance round
moves one replica to b (max_moves_per_round 1). A request stream runs through the router the whole time,
one request at a time: none fails, and the first request the moved replica serves hits the prefix cache it
loaded from the old replica's KV snapshot, where the first request of a replica started cold hits nothing.
"""

from __future__ import annotations

import subprocess
import threading
import time
import uuid

import yaml
import zmq

from exaserve_hpc.config.schema import parse_site
from exaserve_hpc.app.control_plane import ensure_checkpoints
from exaserve_hpc.app.routing import dispatch_settings, router_policy
from exaserve_hpc.engine.tokenizer import ByteTokenizer
from exaserve_hpc.protocol import GenerateRequest, RequestError, TokenChunk, decode, encode
from exaserve_hpc.router.dispatch import Dispatcher
from exaserve_hpc.router.zmq_router import ZmqRouter
from exaserve_hpc.controller.loop import Controller

from tests.serve_harness import ROOT, alive
from tests.waiting import wait_for

MODEL = "tiny-llama"
TOK = ByteTokenizer()
SYSTEM = "You are a helpful assistant on a supercomputer. Answer briefly, precisely and politely. " * 2


def site_for(tmp_path):
    data = yaml.safe_load((ROOT / "site-configs" / "local.yaml").read_text())
    data["cluster"] = {"name": "two", "nodes": 2, "nodelist": "a,b"}
    data["run_dir"] = str(tmp_path / "run")
    data["weight_cache"].update(l3_path=str(tmp_path / "models"), l2_capacity="256MiB")
    data["scheduler"].update(tick_interval=0.2, rebalance_interval=2, max_moves_per_round=1,
                             max_replicas_per_node=4, cooldown_period=3600)
    data["heartbeat"] = {"interval": 0.5, "misses": 6, "controller_timeout": 30}
    data["router"].update(replica_heartbeat=0.1, replica_misses=30)
    data["models"][0].update(replicas=2, min_replicas=2, max_seq_len=512)
    data["models"][0]["tiny"].update(max_position=512, shards=1)
    return parse_site(data)


def start_agent(endpoint: str, node: str, site, tmp_path) -> subprocess.Popen:
    import sys
    return subprocess.Popen([sys.executable, "-m", "exaserve_hpc.agent", "--controller", endpoint, "--agent-id", node,
                             "--heartbeat", str(site.heartbeat.interval), "--die-with-parent",
                             "--controller-timeout", "30", "--l2-capacity", str(256 << 20),
                             "--l2-dir", str(tmp_path / f"l2-{node}"), "--memory-pool", "4GiB"],
                            stdin=subprocess.DEVNULL)


class Stream(threading.Thread):
    """One request at a time through the router's frontend; per replica, the prefix stats its engine reported
    after the first request it served (read from the router's snapshot before the next request goes out)."""

    def __init__(self, endpoint: str, router: ZmqRouter):
        super().__init__(daemon=True)
        self.router = router
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.ok, self.failed = 0, []
        self.first: dict[str, tuple[int, int]] = {}  # replica id -> (prefix hit tokens, prefix query tokens)
        self.stop = threading.Event()

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            rid = f"req-{i}-{uuid.uuid4().hex[:6]}"
            self.socket.send(encode(GenerateRequest(request_id=rid, model=MODEL, max_tokens=4,
                                                    prompt_token_ids=TOK.encode(SYSTEM + f"Question {i}?"))))
            served = self._finish(rid)
            if served and served not in self.first:
                self.first[served] = self._stats_after_first(served)
            time.sleep(0.05)
        self.socket.close()

    def _finish(self, rid: str) -> str:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if not self.socket.poll(100):
                continue
            message = decode(self.socket.recv())
            if isinstance(message, RequestError) and message.request_id == rid:
                self.failed.append(f"{rid}: {message.code} {message.message}")
                return ""
            if isinstance(message, TokenChunk) and message.request_id == rid and message.finished:
                self.ok += 1
                return message.replica_id
        self.failed.append(f"{rid}: no answer in 60 s")
        return ""

    def _stats_after_first(self, replica: str) -> tuple[int, int]:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for entry in self.router.snapshot().get("replicas", []):
                if entry["replica_id"] == replica and entry["prefix_query_tokens"] > 0:
                    return entry["prefix_hit_tokens"], entry["prefix_query_tokens"]
            time.sleep(0.02)
        return -1, -1




def test_a_rebalance_round_moves_one_replica_under_load_and_the_moved_replica_hits_its_prefix(tmp_path):
    site = site_for(tmp_path)
    ensure_checkpoints(site, show_progress=False)
    router = ZmqRouter(Dispatcher(router_policy(site), dispatch_settings(site), {MODEL})).start()
    controller = Controller(site, router, expected_agents=["a"], placement_grace=0.0, run_dir=tmp_path / "run").start()
    agents = [start_agent(controller.endpoint, "a", site, tmp_path)]
    stream = Stream(router.frontend_endpoint, router)
    try:
        def serving():
            replicas = controller.status()["replicas"]
            return len(replicas) == 2 and all(r["state"] == "serving" for r in replicas) and replicas
        first = wait_for(serving, 90, "two replicas serving on a")
        assert {r["node"] for r in first} == {"a"}
        stream.start()
        wait_for(lambda: len(stream.first) == 2, 30, "a request on each replica")
        agents.append(start_agent(controller.endpoint, "b", site, tmp_path))

        def moved():
            status = controller.status()
            rounds = status["placement"]["rebalance_rounds"]
            done = rounds and not status["placement"]["moves"] and serving()
            return done and rounds
        (round_,) = wait_for(moved, 120, "a rebalance round carried out")
        (move,) = round_["moves"]  # max_moves_per_round 1
        assert (move["from_node"], move["to_node"], move["order"]) == ("a", "b", "drain-first")
        wait_for(lambda: move["to"] in stream.first, 30, "a request on the moved replica")
        time.sleep(1.0)
        stream.stop.set()
        stream.join(70)
        assert stream.failed == [] and stream.ok > 10
        nodes = {r["replica_id"]: r["node"] for r in controller.status()["replicas"]}
        assert nodes[move["to"]] == "b" and move["from"] not in nodes
        assert len(controller.status()["placement"]["rebalance_rounds"]) == 1  # balanced now: no further moves
        snapshots = tmp_path / "run" / "kv-snapshots"
        assert not (snapshots / f"{move['from'].replace('/', '.')}.h5").exists()  # read, then removed
        cold = [stream.first[r["replica_id"]] for r in first if r["replica_id"] in stream.first]
        assert cold and all(hits == 0 for hits, _ in cold)  # a replica started cold: its first request misses
        hits, queries = stream.first[move["to"]]
        print(f"requests {stream.ok}, first-request prefix stats {stream.first}, move {move}")
        assert hits > 0, f"the moved replica's first request hit {hits} of {queries} prompt tokens"
    finally:
        stream.stop.set()
        controller.shutdown(drain_timeout=2.0, wait=15.0)
        controller.stop()
        router.stop()
        for agent in agents:
            agent.terminate()
        for agent in agents:
            try:
                agent.wait(15)
            except subprocess.TimeoutExpired:
                agent.kill()
        assert not any(alive(a.pid) for a in agents)
