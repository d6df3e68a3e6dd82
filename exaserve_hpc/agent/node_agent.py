"""The node agent: one per node; runs the replicas the controller asks for.

    python -m exaserve_hpc.agent --controller tcp://HOST:PORT --agent-id NAME

`NodeAgent` is the agent's core (core.py: commands in, decisions and reports out) plus its edges: the
node's GPU grant, memory pool, L2 cache and weight loader, built here; a DEALER socket (identity = agent id)
to the controller; replica processes with status pipes (replica_process.PipeProcesses); and a heartbeat
thread. It says hello with its inventory, then loops: poll the controller socket and every replica's status
pipe, hand commands and status lines to the core, advance weight loads, reap exited replicas, send what
the core reports, and heartbeat every interval with telemetry, the memory pool, the L2 cache and each
replica's state and load progress.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import shutil
import signal
import socket as pysocket
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

import msgspec
import zmq

from exaserve_hpc.agent.core import EXIT_CONTROLLER_LOST, AgentCore
from exaserve_hpc.agent.gpu_binding import GpuGrant, GpuGrantError, granted_telemetry, node_grant, node_pool
from exaserve_hpc.agent.lifecycle import Lifecycle
from exaserve_hpc.agent.memory_pool import DEFAULT_BLOCK_SIZE
from exaserve_hpc.agent.nvml_probe import host_memory, read_gpus
from exaserve_hpc.agent.replica_main import die_with_parent
from exaserve_hpc.agent.replica_process import (
    PipeProcesses, ReplicaSlot, replica_env, replica_threads, spawn, usable_cores
)
from exaserve_hpc.agent.weight_loader import WeightLoader
from exaserve_hpc.cache.l2_shm import L2Cache, make_l2_root, read_l2_page_note
from exaserve_hpc.observability.logs import configure_logging
from exaserve_hpc.protocol import AgentHeartbeat, DecodeError, Message, StartReplica, decode, encode
from exaserve_hpc.transport import replica_client_keys, secure_client
from exaserve_hpc.units import format_size, parse_size

log = logging.getLogger("exaserve.agent")

DEFAULT_L2_CAPACITY = 8 << 30  # WeightCacheConfig.l2_capacity's default
EXIT_BAD_GRANT = 2  # the site asks for more GPUs per node than this node was granted


def spawn_replica(spec: StartReplica, node: str) -> ReplicaSlot:
    """Start one replica process outside any agent's bookkeeping (router tests, tools); it reads L3 itself."""
    slot = ReplicaSlot(spec, Lifecycle(time.monotonic()))
    spawn(slot, node, "", "")
    return slot


L2_RUN_VARIABLE = "EXASERVE_L2_RUN"  # the run's identity in its L2 directory's name (app/serve.py, app/rank.py)


def default_l2_root(agent_id: str, l2_path: str = "/dev/shm", run: Optional[str] = None) -> Path:
    """This agent's L2 directory under weight_cache.l2_path: exaserve-l2-UID/AGENT_ID@RUN.

    RUN (default $EXASERVE_L2_RUN, which `exaserve serve` and `exaserve launch` set) names the run, so two
    servers of one user on one node never share, adopt or clear each other's L2 files; the same server
    started again (same run directory, or same Slurm job after a requeue) finds its own."""
    run = os.environ.get(L2_RUN_VARIABLE, "") if run is None else run
    name = agent_id.replace("/", "_") + (f"@{re.sub(r'[^A-Za-z0-9._-]', '_', run)[:64]}" if run else "")
    return Path(os.path.expandvars(l2_path)).expanduser() / f"exaserve-l2-{os.getuid()}" / name



def receive_pending(socket, limit: int, log) -> Iterator[Message]:
    """Decode the frames already waiting on a DEALER socket, at most `limit` (no waiting).

    A frame that does not decode is logged and skipped: one bad peer must not
    stop a process that serves others.
    """

    for _ in range(limit):
        try:
            frame = socket.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        try:
            yield decode(frame)
        except DecodeError as exc:
            log.warning("dropping an undecodable message: %s", exc)


class NodeAgent:
    def __init__(self, controller: str, agent_id: str, heartbeat_interval: float = 5.0, node_index: int = 0,
                 hostname: Optional[str] = None, *, l2_capacity: int = DEFAULT_L2_CAPACITY,
                 l2_root: Optional[str] = None, pool_bytes: Optional[int] = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, keep_l2: bool = False, load_retries: int = 3,
                 controller_timeout: float = 0.0, replica_env: Optional[dict[str, str]] = None,
                 gpus_per_node: Optional[int] = None, grant: Optional[GpuGrant] = None):
        # First, before anything is created: the GPUs granted here (GpuGrantError when the site asks for
        # more than that; gpus_per_node None: the site is not known). `grant`: tests' stand-in NVML.
        grant = grant if grant is not None else node_grant(gpus_per_node)
        self.controller = controller
        self.agent_id = agent_id
        self.heartbeat_interval = heartbeat_interval
        self.keep_l2 = keep_l2
        root = Path(l2_root) if l2_root else default_l2_root(agent_id)
        make_l2_root(root)  # another agent of ours removing the per-user directory meanwhile is retried
        shm_free = shutil.disk_usage(root).free
        if l2_capacity > shm_free:
            log.warning("L2 capacity %s is more than %s free in %s; using %s", format_size(l2_capacity),
                        format_size(shm_free), root, format_size(int(shm_free * 0.9)))
            l2_capacity = int(shm_free * 0.9)
        cache = L2Cache(root, l2_capacity)
        note = read_l2_page_note(root)
        if note:  # a warning where L2 is big enough for the copy speed to matter (not a laptop's 1 GiB)
            log.log(logging.WARNING if l2_capacity >= 16 << 30 else logging.INFO, "%s", note)
        cache.adopt(time.monotonic())
        self.core = AgentCore(agent_id, hostname or pysocket.gethostname(), node_index=node_index,
                              pool=node_pool(l2_capacity, pool_bytes, block_size, grant), cache=cache,
                              loader=WeightLoader(cache, retries=load_retries), grant=grant,
                              processes=PipeProcesses(), allowed_cpus=frozenset(os.sched_getaffinity(0)),
                              replica_env=replica_env, controller_timeout=controller_timeout)
        self._seq = 0
        # Heartbeats go out from their own thread (_beat_loop): a busy loop (a replica being spawned, a slow
        # pool or NVML call) delays commands, never the controller's proof that this node lives.
        self._socket_lock = threading.RLock()  # the socket is shared with that thread: every use holds it
        self._beat: Optional[AgentHeartbeat] = None  # the latest heartbeat the loop composed
        self._beat_at = 0.0
        self._beat_now = threading.Event()
        self._beat_stop = threading.Event()
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, agent_id.encode())
        self.socket.setsockopt(zmq.LINGER, 1000)

    # the core's state, for readers that knew it here
    @property
    def replicas(self) -> dict[str, ReplicaSlot]:
        return self.core.replicas

    @property
    def cache(self) -> L2Cache:
        return self.core.cache

    @property
    def pool(self):
        return self.core.pool

    @property
    def exit_code(self) -> int:
        return self.core.exit_code

    def run(self) -> int:
        self.socket.connect(self.controller)
        self.core.controller_heard = time.monotonic()  # the controller's silence counts from here
        self._hello()
        next_heartbeat = 0.0
        beats = threading.Thread(target=self._beat_loop, name="exaserve-agent-heartbeat", daemon=True)
        self._heartbeat()  # the thread has a beat to send even if the loop's first round hangs
        beats.start()
        core = self.core
        try:
            while True:
                poller = zmq.Poller()
                poller.register(self.socket, zmq.POLLIN)
                for slot in core.replicas.values():
                    if slot.status_fd >= 0:
                        poller.register(slot.status_fd, zmq.POLLIN)
                with self._socket_lock:  # the heartbeat thread waits for at most this poll
                    events = dict(poller.poll(100))
                if self.socket in events:
                    self._receive()
                core.read_status()
                self._advance_loads()
                core.reap()
                self._flush()
                now = time.monotonic()
                if now >= next_heartbeat or core.heartbeat_due:
                    self._heartbeat()
                    next_heartbeat = now + self.heartbeat_interval
                    core.heartbeat_due = False
                if core.controller_lost(self.controller):
                    self._flush()
                if core.shutting_down and core.all_done():
                    self._heartbeat()
                    return core.exit_code
        finally:
            self._beat_stop.set()  # the last heartbeat (composed above) goes, then the thread ends
            self._beat_now.set()
            beats.join(2.0)
            core.kill_all()
            core.loader.close()
            if not self.keep_l2:
                core.cache.clear()
                try:
                    core.cache.root.parent.rmdir()  # the per-user directory, once no agent uses it
                except OSError:
                    pass
            self.socket.close()
            self.context.term()

    def _hello(self) -> None:
        gpus, why = read_gpus()
        gpus = granted_telemetry(self.core.grant, gpus)  # the granted GPUs, as the pool numbers them
        if not gpus:
            log.info("%s", why)
        self._send(self.core.hello(gpus, host_memory()[0], os.getpid(), cpus=usable_cores(),
                                   replica_threads=replica_threads(replica_env(self.core.replica_env))))

    def follow(self, controller: str, server_public_key: bytes = b"") -> None:
        """Register with another controller (a new leader, ha/): any thread. The replicas keep running; the
        hello and the next heartbeat tell the new controller what runs here. controller_timeout counts from now."""
        with self._socket_lock:
            if controller == self.controller:
                return
            with contextlib.suppress(zmq.ZMQError):
                self.socket.disconnect(self.controller)
            if server_public_key:
                self.socket.curve_serverkey = server_public_key
            log.warning("following the controller at %s (was %s)", controller, self.controller)
            self.controller = controller
            self.socket.connect(controller)
            self.core.controller_heard = time.monotonic()
        self._hello()
        self.core.heartbeat_due = True

    def shutdown(self, drain_timeout: float) -> None:
        self.core.shutdown(drain_timeout)

    # ---------------------------------------------------------------- the loop's edges

    def _receive(self) -> None:
        with self._socket_lock:  # read under the lock, handled outside it (a start may take a while)
            pending = list(receive_pending(self.socket, 1000, log))
        for message in pending:
            self.core.handle(message)
            self._flush()

    def _advance_loads(self) -> None:
        self.core.advance_loads()

    def _flush(self) -> None:
        for message in self.core.take_effects():
            self._send(message)

    def _heartbeat(self) -> None:
        self._seq += 1
        gpus = granted_telemetry(self.core.grant, read_gpus()[0]) if self._seq % 5 == 1 else []
        self._compose_beat(self.core.heartbeat(self._seq, gpus, host_memory()[1]))

    def _compose_beat(self, beat: AgentHeartbeat) -> None:
        """The loop's newest heartbeat, for the heartbeat thread to send now and every interval after."""
        with self._socket_lock:
            self._beat, self._beat_at = beat, time.monotonic()
        self._beat_now.set()

    def _beat_loop(self) -> None:
        """Send the latest heartbeat at once when the loop composed one, else every interval. A loop stuck
        for two intervals still has the node heard: its beat goes out without replica states (stale)."""
        next_at = 0.0
        while True:
            self._beat_now.wait(max(0.0, next_at - time.monotonic()))
            self._beat_now.clear()
            with self._socket_lock:
                beat, at = self._beat, self._beat_at
            if beat is not None:
                if time.monotonic() - at > 2 * self.heartbeat_interval:
                    beat = msgspec.structs.replace(beat, replicas=[])
                self._send(beat)
            next_at = time.monotonic() + self.heartbeat_interval
            if self._beat_stop.is_set():
                return

    def _send(self, message) -> None:
        try:
            with self._socket_lock:
                self.socket.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("controller not reachable; dropped %s", type(message).__name__)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="exaserve-agent", description="Run the node agent of one node.")
    parser.add_argument("--controller", required=True, help="controller endpoint, e.g. tcp://host:port")
    parser.add_argument("--agent-id", default=pysocket.gethostname())
    parser.add_argument("--heartbeat", type=float, default=5.0, help="seconds between heartbeats")
    parser.add_argument("--node-index", type=int, default=0)
    parser.add_argument("--die-with-parent", action="store_true", help="exit when the starting process dies")
    parser.add_argument("--l2-capacity", type=parse_size, default=DEFAULT_L2_CAPACITY,
                        help="host memory for the node's weight cache, e.g. 64GiB (weight_cache.l2_capacity)")
    parser.add_argument("--l2-dir", help="where L2 lives (default /dev/shm/exaserve-l2-UID/AGENT_ID; "
                                         "weight_cache.l2_path sets the /dev/shm part)")
    parser.add_argument("--keep-l2", action="store_true", help="leave L2 in place at exit for the next agent")
    parser.add_argument("--controller-timeout", type=float, default=60.0,
                        help="seconds of silence from the controller after which the agent stops its replicas "
                             f"and exits with status {EXIT_CONTROLLER_LOST} (0: never; heartbeat.controller_timeout)")
    parser.add_argument("--memory-pool", type=parse_size, default=None,
                        help="bytes the replicas may reserve (default: per-GPU free memory, or host memory "
                             "less L2 on CPU nodes)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="GPUs the site declares per node (cluster.gpus_per_node): refused at start if the "
                             "node was granted fewer; 0: a CPU site, replicas get no GPU; default: unchecked")
    parser.add_argument("--memory-block", type=parse_size, default=DEFAULT_BLOCK_SIZE,
                        help="the memory pool's block size")
    args = parser.parse_args(argv)
    configure_logging(text_format="%(asctime)s agent %(levelname)s %(message)s", role="agent")  # EXASERVE_LOG_*
    if args.die_with_parent:
        die_with_parent()
    try:
        agent = NodeAgent(args.controller, args.agent_id, args.heartbeat, args.node_index,
                          l2_capacity=args.l2_capacity, l2_root=args.l2_dir, pool_bytes=args.memory_pool,
                          block_size=args.memory_block, keep_l2=args.keep_l2,
                          controller_timeout=args.controller_timeout, gpus_per_node=args.gpus_per_node)
    except GpuGrantError as exc:
        print(f"exaserve-agent: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_GRANT
    keys = replica_client_keys(os.environ)  # `exaserve serve` names its run directory: the controller is CURVE
    if keys is not None:
        secure_client(agent.socket, keys)
    for sig in (signal.SIGTERM, signal.SIGUSR1):  # scancel/preemption; Slurm's warning before the time limit
        signal.signal(sig, lambda *_: agent.shutdown(10.0))  # drain, stop, remove this node's L2 files, exit 0
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller orders the shutdown
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
