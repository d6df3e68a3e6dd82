"""A pipeline stage's process: the stage mode of ``replica_main`` (spec.stage is set).

A pipeline-parallel replica is one process per stage, each started by its node's agent from its
own StartReplica (``controller/stage_rendezvous.py``). Every stage loads the checkpoint and keeps only its
layers (``engine/stage_worker.stage_checkpoint``), binds its link (``engine/stage_link.py``),
and finds the others through the controller (StageHello until the StageTable is complete).

- Stage 0 (``build_head``) is the replica: its reference engine runs stage 0's layers and the
  rest of the ring behind ``PipelineHead``; then ``replica_main`` warms it up (through every
  stage), registers it with the router and serves as for any replica. If a peer stage is lost the
  replica fails at once, serving or idle (the link's watchdog), and its agent reports it: the
  controller restarts it with the lost stage re-placed.
- Stages 1.. (``run_stage``) never talk to the router: they run their layers on what arrives and
  pass it on, report "serving" once stage 0's setup message has come round, exit 0 when stage 0
  stops the ring, 1 when stage 0 (or another peer) is lost. SIGTERM alone does not stop them once
  serving, since stage 0 still drains through them: they exit when the ring stops, after the drain
  timeout, or at once if their agent is gone (never an orphan).

Not yet: KV snapshots are off for pipeline replicas (one would hold stage 0's layers only); each
stage reads the whole checkpoint before keeping its layers; the reference engine only.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from typing import Callable, Optional

import zmq

from exaserve_hpc.agent.lifecycle import ReplicaState
from exaserve_hpc.cache.tiers import load_weights
from exaserve_hpc.engine.kv_publisher import kv_events_announced, kv_events_bind
from exaserve_hpc.engine.model import LlamaModel
from exaserve_hpc.engine.parallel import stage_layers
from exaserve_hpc.engine.stage_worker import StageWorker, attach_head, stage_checkpoint
from exaserve_hpc.engine.stage_link import LinkError, address_towards, stage_name
from exaserve_hpc.engine.stage_transports import ZmqStageLink
from exaserve_hpc.protocol import PipelineStage, StageHello, StageTable, StartReplica, decode, encode
from exaserve_hpc.transport import replica_client_keys, secure_client

log = logging.getLogger("exaserve.stage")

HELLO_INTERVAL = 1.0  # seconds between StageHellos while peers are missing


class StageError(RuntimeError):
    """The stage cannot link up with its peers; the message names the stage(s) and node(s)."""


def rendezvous(stage: PipelineStage, endpoint: str, node: str, keys=None) -> list[str]:
    """Every stage's link endpoint by rank, from the controller at stage.rendezvous (bounded wait)."""
    context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # An identity of its own per call: a ROUTER refuses a second peer under an identity it still holds.
    sock.setsockopt(zmq.IDENTITY, f"stage/{stage.key}/{stage.rank}/{uuid.uuid4().hex[:8]}".encode())
    if keys is not None:
        secure_client(sock, keys)
    sock.connect(stage.rendezvous)
    hello = encode(StageHello(key=stage.key, rank=stage.rank, endpoint=endpoint, node=node))
    deadline = time.monotonic() + stage.rendezvous_timeout
    table: Optional[StageTable] = None
    try:
        while time.monotonic() < deadline:
            sock.send(hello, zmq.NOBLOCK)
            if not sock.poll(int(HELLO_INTERVAL * 1000)):
                continue
            message = decode(sock.recv())
            if not isinstance(message, StageTable) or message.key != stage.key:
                continue
            table = message
            if table.failed:
                raise StageError(f"pipeline attempt {stage.key} failed: {table.failed}")
            if len(table.endpoints) == stage.size and all(table.endpoints):
                return list(table.endpoints)
    finally:
        sock.close(linger=0)
    if table is None:
        raise StageError(f"stage {stage.rank}: the controller at {stage.rendezvous} did not answer within "
                         f"{stage.rendezvous_timeout:g}s")
    missing = [stage_name(rank, stage.nodes) for rank, ep in enumerate(table.endpoints) if not ep]
    raise StageError(f"stage {stage.rank}: {', '.join(missing)} did not appear within "
                     f"{stage.rendezvous_timeout:g}s (see `exaserve status` and that node agent's log)")


def open_link(stage: PipelineStage, node: str, on_lost: Optional[Callable[[str], None]] = None) -> ZmqStageLink:
    """Bind this stage's link where it reaches the controller, meet the others, connect to the next."""
    keys = replica_client_keys(os.environ)
    host = stage.rendezvous.removeprefix("tcp://").rpartition(":")[0]
    link = ZmqStageLink(stage.rank, stage.size, stage.nodes, address_towards(host), timeout=stage.timeout,
                        curve=keys, on_lost=on_lost)
    try:
        endpoints = rendezvous(stage, link.endpoint, node, keys)
        link.connect(endpoints[(stage.rank + 1) % stage.size])
    except Exception:
        link.close()
        raise
    return link


def load_stage(spec: StartReplica, args, reporter) -> tuple[dict, dict]:
    """Loading: the checkpoint, of which this stage keeps its own layers."""
    weights_dir = args.weights_dir or spec.model_dir
    reporter.state(ReplicaState.LOADING, f"{args.weights_source}: {weights_dir}")
    config, weights = load_weights(weights_dir, args.weights_source, progress=reporter.progress)
    layers = stage_layers(config["layers"], spec.stage.size, spec.stage.rank)
    reporter.state(ReplicaState.INITIALIZING, f"stage {spec.stage.rank} of {spec.stage.size}: "
                                              f"layers {layers.start}-{layers.stop - 1}")
    return stage_checkpoint(config, weights, layers)


def build_head(spec: StartReplica, args, reporter, make_engine) -> tuple[object, str]:
    """Stage 0: the engine over its layers, linked to the other stages; (engine, KV-event endpoint)."""
    stage = spec.stage
    if spec.settings.engine != "reference":
        raise StageError(f"pipeline stages across processes run the reference engine only, not "
                         f"{spec.settings.engine!r}; set pipeline_parallel: 1 or engine: reference")
    if spec.kv_snapshot_in or spec.kv_snapshot_out:  # a snapshot would hold stage 0's layers only
        log.warning("replica %s: KV snapshots are off for pipeline replicas", spec.replica_id)
        spec.kv_snapshot_in = spec.kv_snapshot_out = ""
    # KV events are stage 0's block manager's: every stage holds those blocks, so they describe the replica.
    engine = make_engine(spec, load_stage(spec, args, reporter), kv_events_endpoint=kv_events_bind(spec.router_backend),
                         kv_events_tokens=False)

    def lost(why: str) -> None:  # on the link's watchdog thread: the replica cannot serve any more
        reporter.state(ReplicaState.FAILED, f"pipeline: {why}")
        os._exit(1)

    link = open_link(stage, args.node, on_lost=lost)
    attach_head(engine, link, stage.size, timeout=max(stage.timeout, 10.0), step_timeout=4 * stage.timeout)
    return engine, kv_events_announced(engine.kv_events_endpoint)


def close_head(engine) -> None:
    """After the engine's shutdown: stop the other stages, then close the link."""
    head = engine.model
    head.stop()  # the stages leaving now is the plan, not a failure
    head.link.close()


def run_stage(spec: StartReplica, args, reporter) -> int:
    """Stages 1..: serve the ring until stage 0 stops it (0) or a peer is lost (1)."""
    stage = spec.stage
    model = LlamaModel(*load_stage(spec, args, reporter))
    link = open_link(stage, args.node)
    reporter.state(ReplicaState.WARMING, f"waiting for {stage_name(0, stage.nodes)}")
    parent = os.getppid()

    def outlive_no_agent(deadline: float) -> None:
        """After SIGTERM: stage 0 drains through us, then stops the ring; but never outlive our agent
        (a reparented process) nor the drain timeout (+2 s) it gave."""
        while time.monotonic() < deadline and os.getppid() == parent:
            time.sleep(0.2)
        log.warning("stage %d: %s; exiting", stage.rank, "our agent is gone" if os.getppid() != parent
                    else "stage 0 did not stop the pipeline within the drain timeout")
        os._exit(1)

    def on_term(signum, frame):
        log.info("stage %d: SIGTERM; serving until stage 0 stops the pipeline", stage.rank)
        threading.Thread(target=outlive_no_agent, args=(time.monotonic() + spec.drain_timeout + 2.0,),
                         daemon=True).start()

    def linked() -> None:
        signal.signal(signal.SIGTERM, on_term)
        reporter.state(ReplicaState.REGISTERING, f"linked to {stage_name((stage.rank + 1) % stage.size, stage.nodes)}")
        reporter.state(ReplicaState.SERVING, f"stage {stage.rank} of {stage.size}")

    try:
        StageWorker(model, stage.rank, stage.size, link).serve(first_timeout=stage.rendezvous_timeout,
                                                               on_setup=linked)
    except LinkError as exc:
        reporter.state(ReplicaState.FAILED, f"pipeline: {exc}")
        return 1
    finally:
        link.close()
    reporter.state(ReplicaState.DRAINING, "stage 0 stopped the pipeline")
    reporter.state(ReplicaState.STOPPED)
    return 0
