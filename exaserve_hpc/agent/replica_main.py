"""One replica: its own process, started by the node agent.

    python -m exaserve_hpc.agent.replica_main --spec HEX --status-fd N [--weights-dir DIR --weights-source l2|l3]

`--spec` is the controller's StartReplica message (MessagePack, hex). The
agent has reserved its memory and, normally, put the weights in the node's
L2 cache (--weights-dir, source l2); without --weights-dir the process reads
spec.model_dir from L3 with checksums. Steps, each reported to the agent:
loading (weights L2 -> L1, with "progress <done> <total>" lines) ->
initializing (the engine over those weights) -> warming (a real inference,
output checked) -> registering (DEALER, identity = replica id, to the router
backend, or one to each router's when several share the fleet (router_links.py),
a CURVE client when the agent names the job directory in
$EXASERVE_CURVE_JOB_DIR; hello) -> serving (receive requests -> engine.step()
-> token chunks). State lines on --status-fd: "<state> <seconds in previous state> <detail>".

SIGTERM drains: no new requests, in-flight ones finish (bounded by the drain
timeout), then the replica says bye and exits 0.

KV snapshot migration (optional, ``engine/kv_snapshot.py``): with
spec.kv_snapshot_in the prefix cache is loaded after warm-up, before
registering; with spec.kv_snapshot_out the hottest prefix blocks are written
while draining, before the bye. A snapshot that cannot be read or written, or
belongs to another model, costs only the cache: logged, and the replica goes on.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Mapping, Optional

import zmq

from exaserve_hpc.agent import faults, stage_process
from exaserve_hpc.agent.lifecycle import ReplicaState
from exaserve_hpc.agent.router_links import RouterLinks
from exaserve_hpc.cache.tiers import load_weights
from exaserve_hpc.engine.base import EngineError, EngineRequest
from exaserve_hpc.engine.block_manager import install_block_hash_salt
from exaserve_hpc.engine.kv_publisher import kv_events_announced, kv_events_bind, secure_publishers
from exaserve_hpc.engine.kv_snapshot import KVSnapshotError, load_kv_snapshot, write_kv_snapshot
from exaserve_hpc.engine.registry import build_engine, engine_spec
from exaserve_hpc.jobdir import JobDir
from exaserve_hpc.observability.logs import configure_logging
from exaserve_hpc.protocol import (
    Abort, Drain, GenerateRequest, ReplicaBye, ReplicaHello, ReplicaStats, RequestError, StartReplica, TokenChunk,
    decode
)
from exaserve_hpc.transport import CURVE_JOB_DIR_VARIABLE, CurveKeys, load_client_keys, replica_client_keys

log = logging.getLogger("exaserve.replica")
_INJECTABLE = (ReplicaState.LOADING, ReplicaState.INITIALIZING, ReplicaState.WARMING, ReplicaState.REGISTERING,
               ReplicaState.SERVING)  # failure injection after reporting these steps (tests)


class StatusReporter:
    """Writes lifecycle transitions to the agent's pipe (or nowhere)."""

    def __init__(self, fd: Optional[int]):
        self._file = os.fdopen(fd, "w", buffering=1) if fd is not None else None
        self._since = time.monotonic()

        self._last_progress = 0.0

    def state(self, state: ReplicaState, detail: str = "") -> None:
        now = time.monotonic()
        line = f"{state.value} {now - self._since:.3f} {detail}".rstrip()
        self._since = now
        log.info("replica state %s", line)
        self._write(line)
        if state in _INJECTABLE:
            faults.check(state.value)

    def progress(self, done: int, total: int) -> None:
        """Bytes of weights loaded; at most ~5 lines a second."""
        now = time.monotonic()
        if done >= total or now - self._last_progress >= 0.2:
            self._last_progress = now
            self._write(f"progress {done} {total}")

    def _write(self, line: str) -> None:
        if self._file is not None:
            try:
                self._file.write(line.replace("\n", " ") + "\n")
            except OSError:  # the agent is gone; PDEATHSIG will end us
                pass


def die_with_parent() -> None:
    """Ask Linux to SIGTERM us when the agent dies, so no replica outlives its agent."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def make_engine(spec: StartReplica, weights=None, **extra):
    """The replica's engine, from the engine registry (engine/registry.py).

    ``weights``: for engines that load in process, the (config, arrays) already
    in this process; for those that read their checkpoint themselves, its
    directory; None for engines without weights. ``extra``: keywords only some
    engines take (``kv_events_endpoint``).
    """
    return build_engine(spec, weights, **extra)


def load_kv_snapshot_in(spec: StartReplica, engine) -> int:
    """Warm the prefix cache from spec.kv_snapshot_in; blocks installed (0 if refused)."""
    started = time.monotonic()
    try:
        n = load_kv_snapshot(engine, spec.kv_snapshot_in)
    except KVSnapshotError as exc:
        log.warning("replica %s: KV snapshot not loaded, serving with a cold cache: %s", spec.replica_id, exc)
        return 0
    except Exception:  # a bug here must not stop a replica that can serve cold
        log.exception("replica %s: KV snapshot %s not loaded", spec.replica_id, spec.kv_snapshot_in)
        return 0
    log.info("replica %s: loaded %d KV blocks from %s in %.3f s", spec.replica_id, n, spec.kv_snapshot_in,
             time.monotonic() - started)
    return n


def write_kv_snapshot_out(spec: StartReplica, engine) -> int:
    """Write the hottest prefix blocks to spec.kv_snapshot_out; blocks written (0 if it failed)."""
    started = time.monotonic()
    limit = spec.kv_snapshot_max_blocks or getattr(getattr(engine, "blocks", None), "num_blocks", 0)
    try:
        n = write_kv_snapshot(engine, spec.kv_snapshot_out, limit)
    except KVSnapshotError as exc:
        log.warning("replica %s: KV snapshot not written: %s", spec.replica_id, exc)
        return 0
    except Exception:  # the bye must still go out
        log.exception("replica %s: KV snapshot %s not written", spec.replica_id, spec.kv_snapshot_out)
        return 0
    log.info("replica %s: wrote %d KV blocks to %s in %.3f s", spec.replica_id, n, spec.kv_snapshot_out,
             time.monotonic() - started)
    return n


class ChunkCoalescer:
    """Groups a request's tokens so a stream costs one message per N tokens or per flush interval.

    The first chunk of each request goes out at once: time to first token is
    what users feel.
    """

    def __init__(self, flush_ms: float, max_tokens: int):
        self.flush_s = flush_ms / 1000
        self.max_tokens = max_tokens
        self._buffers: dict[str, tuple[list[int], float]] = {}
        self._started: set[str] = set()

    def add(self, output, now: float) -> Optional[TokenChunk]:
        tokens, since = self._buffers.pop(output.request_id, ([], now))
        tokens = tokens + list(output.new_token_ids)
        first = output.request_id not in self._started
        if output.finished or first or len(tokens) >= self.max_tokens or now - since >= self.flush_s:
            self._started.add(output.request_id)
            if output.finished:
                self._started.discard(output.request_id)
            return TokenChunk(request_id=output.request_id, token_ids=tokens, finished=output.finished,
                              finish_reason=output.finish_reason, prompt_tokens=output.prompt_tokens,
                              completion_tokens=output.completion_tokens)
        self._buffers[output.request_id] = (tokens, since)
        return None

    def due(self, now: float) -> list[TokenChunk]:
        chunks = []
        for rid, (tokens, since) in list(self._buffers.items()):
            if tokens and now - since >= self.flush_s:
                del self._buffers[rid]
                chunks.append(TokenChunk(request_id=rid, token_ids=tokens))
        return chunks

    def forget(self, request_id: str) -> None:
        self._buffers.pop(request_id, None)
        self._started.discard(request_id)


class ReplicaServer:
    def __init__(self, spec: StartReplica, engine, links: RouterLinks, reporter: StatusReporter,
                 coalesce_ms: float = 20.0, coalesce_tokens: int = 16):
        self.spec = spec
        self.engine = engine
        self.links = links  # the router(s): a request's answers go back where it came from
        self.reporter = reporter
        self.coalescer = ChunkCoalescer(coalesce_ms, coalesce_tokens)
        self.draining = False
        self.drain_signalled = False  # SIGTERM arrived; the loop starts the drain
        self.drain_deadline = 0.0
        self.latency_ewma_ms = 0.0
        self._running_ids: set[str] = set()

    def request_drain(self, timeout: float) -> None:
        if not self.draining:
            self.draining = True
            self.drain_deadline = time.monotonic() + timeout
            self.reporter.state(ReplicaState.DRAINING, f"{len(self._running_ids)} in flight")

    def run(self) -> None:
        next_stats = 0.0
        stepped = False
        chunks: list[TokenChunk] = []
        while True:
            # Poll without waiting while the engine produces tokens; wait 1 ms while it holds
            # requests back (its max_wait_ms batching window), 50 ms when idle.
            wait_ms = (0 if stepped else 1) if self.engine.has_unfinished() else 50
            if self.links.poll(wait_ms):
                self._receive()
            now = time.monotonic()
            if self.engine.has_unfinished():
                started = time.perf_counter()
                outputs = self.engine.step()
                stepped = bool(outputs)
                step_ms = (time.perf_counter() - started) * 1000
                self.latency_ewma_ms = 0.9 * self.latency_ewma_ms + 0.1 * step_ms if self.latency_ewma_ms else step_ms
                for output in outputs:
                    chunk = self.coalescer.add(output, now)
                    if output.finished:
                        self._running_ids.discard(output.request_id)
                    if chunk is not None:
                        chunks.append(chunk)
            else:
                stepped = False
            chunks += self.coalescer.due(now)
            if chunks:  # a step's chunks (one per running request) in one frame per router
                self.links.send_chunks(chunks)
                chunks = []
            if now >= next_stats:
                self._send_stats()
                next_stats = now + self.spec.stats_interval
            if self.drain_signalled:
                self.request_drain(self.spec.drain_timeout)
            if self.draining:
                faults.check("draining")
            if self.draining and (not self._running_ids or now > self.drain_deadline):
                self._finish_drain()
                return

    def _receive(self) -> None:
        for message in self.links.receive(256):
            if isinstance(message, GenerateRequest):
                self._admit(message)
            elif isinstance(message, Abort):
                self.engine.abort(message.request_id)
                self._running_ids.discard(message.request_id)
                self.coalescer.forget(message.request_id)
            elif isinstance(message, Drain):
                self.request_drain(message.timeout)

    def _admit(self, request: GenerateRequest) -> None:
        if self.draining:
            self._send(RequestError(request_id=request.request_id, status=503, code="draining",
                                    message=f"replica {self.spec.replica_id} is draining", retry_after=0.1))
            return
        try:
            self.engine.add_request(EngineRequest(
                request_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
                max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
                seed=request.seed, stop_token_ids=tuple(request.stop_token_ids) or None))
        except ValueError as exc:
            self._send(RequestError(request_id=request.request_id, status=400, code="invalid_request",
                                    message=str(exc)))
            return
        self._running_ids.add(request.request_id)

    def _send_stats(self) -> None:
        stats = self.engine.stats()
        ttft, tpot = stats.get("ttft_ms") or {}, stats.get("tpot_ms") or {}  # engines without latency stats: {}
        self._send(ReplicaStats(
            replica_id=self.spec.replica_id, queue_depth=int(stats.get("queue_depth", 0)),
            running=int(stats.get("running", 0)), kv_used=float(stats.get("kv_used", 0.0)),
            latency_ewma_ms=self.latency_ewma_ms, tokens_generated=int(stats.get("tokens_generated", 0)),
            requests_finished=int(stats.get("requests_finished", 0)),
            prefix_hit_tokens=int(stats.get("prefix_hit_tokens", 0)),
            prefix_query_tokens=int(stats.get("prefix_query_tokens", 0)),
            kv_blocks_cached=int(stats.get("kv_blocks_cached", 0)),
            ttft_ms_p50=float(ttft.get("p50", 0.0)), ttft_ms_p99=float(ttft.get("p99", 0.0)),
            tpot_ms_p50=float(tpot.get("p50", 0.0)), tpot_ms_p99=float(tpot.get("p99", 0.0))))

    def _finish_drain(self) -> None:
        for rid in list(self._running_ids):  # drain timed out: hand these back for retry elsewhere
            self.engine.abort(rid)
            self._send(RequestError(request_id=rid, status=503, code="drain_timeout",
                                    message=f"replica {self.spec.replica_id} stopped before finishing"))
        if self.spec.kv_snapshot_out:
            write_kv_snapshot_out(self.spec, self.engine)
        self._send(ReplicaBye(replica_id=self.spec.replica_id, reason="drained"))
        self.reporter.state(ReplicaState.STOPPED)

    def _send(self, message) -> None:
        self.links.send(message)


def build_replica_engine(spec: StartReplica, args: argparse.Namespace, reporter: StatusReporter):
    """Loading -> initializing: the weights the engine needs, then the engine (engine/registry.py).

    Returns the engine and the KV-event endpoint to announce ("" for engines that publish none).
    """
    engine_kind = engine_spec(spec.settings.engine)
    if not engine_kind.available():  # before loading gigabytes for an engine that cannot start here
        raise EngineError(engine_kind.missing_package_message() + "; or choose another engine for this model")
    weights_dir = args.weights_dir or spec.model_dir
    reporter.state(ReplicaState.LOADING, f"{args.weights_source}: {weights_dir}")
    weights = None
    if engine_kind.needs_weights:
        weights = load_weights(weights_dir, args.weights_source, progress=reporter.progress) \
            if engine_kind.loads_in_process else weights_dir
    reporter.state(ReplicaState.INITIALIZING)
    if not engine_kind.kv_events:
        return make_engine(spec, weights), ""
    # Announced in the hello (with the PUB's CURVE key); a router in precise prefix mode subscribes with the
    # run's client key. Salted hashes only: prompts never leave the replica through this socket.
    engine = make_engine(spec, weights, kv_events_endpoint=kv_events_bind(spec.router_backend),
                         kv_events_tokens=False)
    return engine, kv_events_announced(engine.kv_events_endpoint)

def replica_kv_event_keys(env: Mapping[str, str]) -> Optional[CurveKeys]:
    """A replica's KV-event publisher keys: a key pair of its own (its public key goes out in its hello,
    over the router's CURVE backend) admitting only the run's client key, which the router holds; with the
    run's block-hash salt installed in this process. None (and unsalted hashes) without the run's keys."""
    path = env.get(CURVE_JOB_DIR_VARIABLE)
    if not path:
        return None
    jobdir = JobDir(Path(path))
    client = load_client_keys(jobdir)
    install_block_hash_salt(jobdir)
    public, secret = zmq.curve_keypair()
    return CurveKeys(public, secret, client.client_public, b"")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="exaserve-replica", description="Run one model replica (started by the node agent).")
    parser.add_argument("--spec", required=True, help="StartReplica message, MessagePack as hex")
    parser.add_argument("--status-fd", type=int, default=None)
    parser.add_argument("--node", default=os.uname().nodename)
    parser.add_argument("--weights-dir", help="L2 entry (or L3 checkpoint) to load; default: the spec's model_dir")
    parser.add_argument("--weights-source", choices=("l2", "l3"), default="l3")
    args = parser.parse_args(argv)
    configure_logging(text_format="%(asctime)s replica %(levelname)s %(message)s", role="replica")  # EXASERVE_LOG_*
    die_with_parent()
    spec = decode(bytes.fromhex(args.spec))
    if not isinstance(spec, StartReplica):
        parser.error(f"--spec holds a {type(spec).__name__}, expected StartReplica")
    reporter = StatusReporter(args.status_fd)
    server: Optional[ReplicaServer] = None

    def on_term(signum, frame):
        if server is not None:  # only a flag: the handler may interrupt a write to the status pipe
            server.drain_signalled = True
        else:
            sys.exit(0)  # still loading: nothing in flight to finish

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the agent decides
    # Slurm's time-limit warning (--signal=USR1@T) reaches every process of the step; its default action
    # would kill the replica with requests in flight. The agent orders the drain instead.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        if spec.stage is not None and spec.stage.rank > 0:  # a later pipeline stage: no router, no engine loop
            return stage_process.run_stage(spec, args, reporter)
        # The run's keys (from the job directory the agent names, never the command line): the engine's KV-event
        # PUB becomes a CURVE server admitting only the router's key, and block hashes take the run's salt.
        kv_keys = replica_kv_event_keys(os.environ)
        secure_publishers(kv_keys)
        engine, kv_events_endpoint = (stage_process.build_head(spec, args, reporter, make_engine)
                                      if spec.stage is not None else build_replica_engine(spec, args, reporter))
        reporter.state(ReplicaState.WARMING)
        engine.warmup()
        if spec.kv_snapshot_in:
            load_kv_snapshot_in(spec, engine)
        reporter.state(ReplicaState.REGISTERING, spec.router_backend)
        context = zmq.Context()
        # under `exaserve launch` the routers admit only the job's key
        links = RouterLinks(context, spec.replica_id, spec.router_backends or [spec.router_backend],
                            replica_client_keys(os.environ))
        links.broadcast(ReplicaHello(replica_id=spec.replica_id, model=spec.model, pid=os.getpid(),
                                     max_batch_size=spec.settings.max_batch_size,
                                     max_seq_len=spec.settings.max_seq_len, node=args.node,
                                     version=spec.version, kv_events_endpoint=kv_events_endpoint,
                                     kv_events_key=kv_keys.server_public.decode()
                                     if kv_keys is not None and kv_events_endpoint else ""))
        server = ReplicaServer(spec, engine, links, reporter, spec.coalesce_ms, spec.coalesce_tokens)
        reporter.state(ReplicaState.SERVING)
        server.run()
        engine.shutdown()
        if spec.stage is not None:
            stage_process.close_head(engine)  # the other stages exit once the ring says stop
        links.close()
        context.term()
        return 0
    except Exception as exc:  # report the cause to the agent, then exit non-zero
        log.exception("replica %s failed", spec.replica_id)
        reporter.state(ReplicaState.FAILED, f"{type(exc).__name__}: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
