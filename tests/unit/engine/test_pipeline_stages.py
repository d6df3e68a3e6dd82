"""Pipeline stages over real ZeroMQ links (loopback, one thread per stage): the same greedy tokens as
one unsplit engine, and a lost stage is an error naming it, never a hang."""

import threading
import time

import numpy as np
import pytest

from exaserve_hpc.cache.checkpoint import TinyModelSpec, create_tiny_checkpoint, load_checkpoint
from exaserve_hpc.engine.model import LlamaModel
from exaserve_hpc.engine.parallel import stage_layers
from exaserve_hpc.engine.stage_worker import StageWorker, attach_head, stage_checkpoint
from exaserve_hpc.engine.reference import ReferenceEngine
from exaserve_hpc.engine.stage_link import LinkError
from exaserve_hpc.engine.stage_transports import ZmqStageLink
from tests.engine import mpi_parallel_check as check

SPEC = TinyModelSpec(layers=4, hidden=64, heads=8, kv_heads=4, intermediate=176,
                     max_position=128, shards=1, seed=4)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return create_tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny", SPEC)


def link_ring(pp: int, timeout: float = 5.0) -> list[ZmqStageLink]:
    nodes = [f"node{s}" for s in range(pp)]
    links = [ZmqStageLink(s, pp, nodes, timeout=timeout) for s in range(pp)]
    for s, link in enumerate(links):
        link.connect(links[(s + 1) % pp].endpoint)
    return links


def test_stage_checkpoint_renumbers_layers_and_keeps_embedding_and_head(ckpt):
    config, weights = load_checkpoint(ckpt)
    sub_config, sub = stage_checkpoint(config, weights, range(2, 4))
    assert sub_config["layers"] == 2
    np.testing.assert_array_equal(sub["layers.0.attn.wq"], weights["layers.2.attn.wq"])
    assert "layers.2.attn.wq" not in sub and "embed" in sub and "norm" in sub
    LlamaModel(sub_config, sub)  # a valid checkpoint of its own


@pytest.mark.parametrize("pp", [2, 3])
def test_pipeline_over_zeromq_gives_the_unsplit_engines_greedy_tokens(ckpt, pp):
    config, weights = load_checkpoint(ckpt)
    want = check.run(ReferenceEngine.from_weights(config, weights, **check.engine_kwargs()))
    links = link_ring(pp)
    workers = [StageWorker(LlamaModel(*stage_checkpoint(config, weights, stage_layers(4, pp, s))), s, pp, links[s])
               for s in range(1, pp)]
    threads = [threading.Thread(target=w.serve, daemon=True) for w in workers]
    for t in threads:
        t.start()
    engine = ReferenceEngine.from_weights(*stage_checkpoint(config, weights, stage_layers(4, pp, 0)),
                                          **check.engine_kwargs())
    head = attach_head(engine, links[0], pp, timeout=5.0)
    engine.warmup()  # the engine's own warm-up, through every stage
    got = check.run(engine)
    stats = engine.stats()
    engine.shutdown()
    head.stop()
    for t in threads:
        t.join(5)
        assert not t.is_alive()
    for link in links:
        link.close()
    assert got == want and all(len(t) == 12 for t in want.values())
    assert stats["prefix_hit_tokens"] > 0  # stage 0's prefix cache skipped blocks every stage holds
    assert all(w.passes > 0 for w in workers)


def test_a_stage_that_goes_away_is_an_error_naming_it():
    links = link_ring(2, timeout=2.0)
    links[0].send({"op": "ping"}, np.zeros(3, np.float32))
    header, array = links[1].receive(2.0)
    assert header == {"op": "ping"} and array.shape == (3,)
    links[1].close()  # stage 1's process is gone: its sockets close
    deadline = time.monotonic() + 5
    while not links[0].lost and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "stage 1 on node node1" in links[0].lost
    with pytest.raises(LinkError, match="stage 1 on node node1"):
        links[0].receive(1.0)
    links[0].close()


def test_a_silent_stage_fails_a_bounded_receive_naming_it():
    links = link_ring(2, timeout=2.0)
    started = time.monotonic()
    with pytest.raises(LinkError, match="nothing from stage 1 on node node1 within 0.3s"):
        links[0].receive(0.3)
    assert time.monotonic() - started < 2
    for link in links:
        link.close()


def test_with_the_jobs_keys_a_stage_link_admits_only_peers_holding_them(tmp_path):
    import zmq

    from exaserve_hpc.jobdir import JobDir
    from exaserve_hpc.transport import load_client_keys, make_curve_keys

    jobdir = JobDir(tmp_path / "job").ensure()
    make_curve_keys(jobdir)
    keys = load_client_keys(jobdir)  # what a replica reads: no server secret
    nodes = ["a", "b"]
    links = [ZmqStageLink(s, 2, nodes, timeout=5.0, curve=keys) for s in range(2)]
    for s, link in enumerate(links):
        link.connect(links[1 - s].endpoint)
    links[0].send({"op": "x"}, np.ones(2, np.float32))
    assert links[1].receive(5.0)[0] == {"op": "x"}
    context = zmq.Context()
    rogues = []
    for curve in (True, False):  # a key of its own, and no CURVE at all
        rogue = context.socket(zmq.PUSH)
        rogue.setsockopt(zmq.LINGER, 0)
        if curve:
            rogue.curve_publickey, rogue.curve_secretkey = zmq.curve_keypair()
            rogue.curve_serverkey = keys.client_public
        rogue.connect(links[1].endpoint)
        rogues.append(rogue)
    time.sleep(0.3)  # time for the handshakes (refused)
    for rogue in rogues:
        try:
            rogue.send_multipart([b"junk", b"\0\0\0\0"], zmq.NOBLOCK)
        except zmq.Again:
            pass  # not even connected: refused at the handshake
    with pytest.raises(LinkError, match="nothing from stage 0 on node a"):
        links[1].receive(1.0)
    for rogue in rogues:
        rogue.close()
    context.term()
    for link in links:
        link.close()
