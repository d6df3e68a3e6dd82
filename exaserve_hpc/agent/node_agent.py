"""The node agent: one per node; runs the replicas the controller asks for.

    python -m exaserve_hpc.agent --controller tcp://HOST:PORT --agent-id NAME

It connects a DEALER socket (identity = agent id) to the controller, says
hello with its inventory, then loops: poll the controller socket and every
replica's status pipe, run commands (start / stop replica, prefetch, shut
down), advance weight loads, reap exited replicas and report their cause,
and heartbeat every interval with telemetry, the memory pool, the L2 cache
and each replica's state and load progress.

Replica start (lifecycle.py): reserve from the node's memory pool -> load
(the agent fills L2 from L3 once per model, then the replica process copies
L2 -> L1) -> init -> warm-up -> register -> serving. Whatever ends a replica
(failure at any step, stop, crash), the agent releases its reservation and
its L2 pin. Restarting or re-placing is the controller's decision.
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

from exaserve_hpc.agent import faults
from exaserve_hpc.agent.adoption import backends, must_restart
from exaserve_hpc.agent.gpu_binding import (
    GpuGrant, GpuGrantError, granted_telemetry, node_grant, node_pool, replica_binding
)
from exaserve_hpc.agent.lifecycle import STOPPED_UNASKED, Lifecycle, ReplicaState
from exaserve_hpc.agent.memory_pool import DEFAULT_BLOCK_SIZE, ReservationError
from exaserve_hpc.agent.nvml_probe import host_memory, read_gpus
from exaserve_hpc.agent.replica_main import die_with_parent
from exaserve_hpc.agent.replica_process import (
    ReplicaSlot, parse_status_line, replica_env, replica_threads, spawn, usable_cores
)
from exaserve_hpc.agent.weight_loader import PREFETCH, FillResult, WeightLoader
from exaserve_hpc.cache.checkpoint import CheckpointError
from exaserve_hpc.cache.l2_shm import L2Cache, L2Full, make_l2_root, read_l2_page_note
from exaserve_hpc.engine.registry import ENGINES
from exaserve_hpc.observability.logs import configure_logging
from exaserve_hpc.protocol import (
    AgentHeartbeat, AgentHello, DecodeError, LoadFailed, Message, Prefetch, ReplicaEvent, Shutdown, StartReplica,
    StopReplica, decode, encode
)
from exaserve_hpc.transport import replica_client_keys, secure_client
from exaserve_hpc.units import format_size, parse_size

log = logging.getLogger("exaserve.agent")

DEFAULT_L2_CAPACITY = 8 << 30  # WeightCacheConfig.l2_capacity's default
EXIT_BAD_GRANT = 2  # the site asks for more GPUs per node than this node was granted
EXIT_CONTROLLER_LOST = 3  # the agent's exit status when its controller went silent


def estimate_replica_bytes(spec: StartReplica) -> int:
    """Bytes per device to reserve: the controller's figure, else its engine's estimate (engine/registry.py)."""
    if spec.memory_bytes:
        return spec.memory_bytes
    engine = ENGINES.get(spec.settings.engine)
    return engine.memory_bytes(spec) if engine is not None else 0  # an unknown engine fails in its replica


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
        self.grant = grant if grant is not None else node_grant(gpus_per_node)
        self.allowed_cpus = frozenset(os.sched_getaffinity(0))  # Slurm's cpuset: replicas' CPUs stay in it
        self.controller = controller
        self.replica_env = replica_env or {}  # added to every replica process's environment
        self.agent_id = agent_id
        self.hostname = hostname or pysocket.gethostname()
        self.node_index = node_index
        self.heartbeat_interval = heartbeat_interval
        self.replicas: dict[str, ReplicaSlot] = {}
        self._replacing: dict[str, StartReplica] = {}  # replica id -> its spec for new routers, started at its exit
        self.shutting_down = False
        self.shutdown_deadline = 0.0
        self.keep_l2 = keep_l2
        # Silence from the controller this long (0: never) means it is gone: stop everything and exit
        # non-zero, rather than keep replicas (and, under Slurm, the allocation) running for nobody.
        self.controller_timeout = controller_timeout
        self.controller_heard = time.monotonic()
        self.exit_code = 0
        root = Path(l2_root) if l2_root else default_l2_root(agent_id)
        make_l2_root(root)  # another agent of ours removing the per-user directory meanwhile is retried
        shm_free = shutil.disk_usage(root).free
        if l2_capacity > shm_free:
            log.warning("L2 capacity %s is more than %s free in %s; using %s", format_size(l2_capacity),
                        format_size(shm_free), root, format_size(int(shm_free * 0.9)))
            l2_capacity = int(shm_free * 0.9)
        self.cache = L2Cache(root, l2_capacity)
        note = read_l2_page_note(root)
        if note:  # a warning where L2 is big enough for the copy speed to matter (not a laptop's 1 GiB)
            log.log(logging.WARNING if l2_capacity >= 16 << 30 else logging.INFO, "%s", note)
        self.cache.adopt(time.monotonic())
        self.loader = WeightLoader(self.cache, retries=load_retries)
        self.pool = node_pool(l2_capacity, pool_bytes, block_size, self.grant)
        self._seq = 0
        self._heartbeat_due = False  # a replica process started: its pid goes out before its first event
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

    def run(self) -> int:
        self.socket.connect(self.controller)
        self.controller_heard = time.monotonic()  # the controller's silence counts from here
        self._hello()
        next_heartbeat = 0.0
        beats = threading.Thread(target=self._beat_loop, name="exaserve-agent-heartbeat", daemon=True)
        self._heartbeat()  # the thread has a beat to send even if the loop's first round hangs
        beats.start()
        try:
            while True:
                poller = zmq.Poller()
                poller.register(self.socket, zmq.POLLIN)
                for slot in self.replicas.values():
                    if slot.status_fd >= 0:
                        poller.register(slot.status_fd, zmq.POLLIN)
                with self._socket_lock:  # the heartbeat thread waits for at most this poll
                    events = dict(poller.poll(100))
                if self.socket in events:
                    self._receive()
                self._read_status_pipes()
                self._advance_loads()
                self._reap()
                now = time.monotonic()
                if now >= next_heartbeat or self._heartbeat_due:
                    self._heartbeat()
                    next_heartbeat = now + self.heartbeat_interval
                    self._heartbeat_due = False
                if (self.controller_timeout and not self.shutting_down
                        and now - self.controller_heard > self.controller_timeout):
                    log.error("no word from the controller at %s for %.0fs (heartbeat.controller_timeout); "
                              "stopping %d replica(s) and exiting", self.controller, now - self.controller_heard,
                              len(self.replicas))
                    self.exit_code = EXIT_CONTROLLER_LOST
                    self.shutdown(5.0)
                if self.shutting_down and self._all_done(now):
                    self._heartbeat()
                    return self.exit_code
        finally:
            self._beat_stop.set()  # the last heartbeat (composed above) goes, then the thread ends
            self._beat_now.set()
            beats.join(2.0)
            self._kill_all()
            self.loader.close()
            if not self.keep_l2:
                self.cache.clear()
                try:
                    self.cache.root.parent.rmdir()  # the per-user directory, once no agent uses it
                except OSError:
                    pass
            self.socket.close()
            self.context.term()

    def _hello(self) -> None:
        gpus, why = read_gpus()
        gpus = granted_telemetry(self.grant, gpus)  # the granted GPUs, as the pool numbers them
        if not gpus:
            log.info("%s", why)
        self._send(AgentHello(agent_id=self.agent_id, hostname=self.hostname, pid=os.getpid(),
                              node_index=self.node_index, gpus=gpus, host_memory_total=host_memory()[0],
                              memory=self.pool.status(), l2=self.cache.status(time.monotonic()),
                              cpus=usable_cores(), replica_threads=replica_threads(replica_env(self.replica_env))))

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
            self.controller_heard = time.monotonic()
        self._hello()
        self._heartbeat_due = True

    # ---------------------------------------------------------------- commands

    def _receive(self) -> None:
        with self._socket_lock:  # read under the lock, handled outside it (a start may take a while)
            pending = list(receive_pending(self.socket, 1000, log))
        for message in pending:
            self.controller_heard = time.monotonic()
            if isinstance(message, StartReplica):
                self.start(message)
            elif isinstance(message, StopReplica):
                self.stop(message.replica_id, message.drain_timeout)
            elif isinstance(message, Prefetch):
                self.prefetch(message)
            elif isinstance(message, Shutdown):
                self.shutdown(message.drain_timeout)

    def start(self, spec: StartReplica) -> None:
        existing = self.replicas.get(spec.replica_id)
        if existing is not None and not existing.finished:
            if must_restart(backends(existing.spec.router_backend, existing.spec.router_backends),
                            backends(spec.router_backend, spec.router_backends)):
                # A new leader's routers (ha/): the running process cannot reach them. It drains and exits,
                # and starts again here for them (_reap), as the same replica: no stop reaches the controller.
                # With several routers, a new leader that adopted the surviving ones names only routers this
                # replica already serves: it is kept (agent/adoption.py).
                log.warning("replica %s runs for router %s, now asked for %s: restarting it", spec.replica_id,
                            existing.spec.router_backend, spec.router_backend)
                self._replacing[spec.replica_id] = spec
                self.stop(spec.replica_id, drain_timeout=5.0)
                return
            if not (spec.stage and existing.spec.stage and spec.stage.key != existing.spec.stage.key):
                log.warning("replica %s is already here (%s)", spec.replica_id, existing.state.value)
                # a new controller (a new leader, or one restored from a checkpoint) learns its state
                self._send(ReplicaEvent(agent_id=self.agent_id, replica_id=spec.replica_id,
                                        state=existing.state.value, detail="already running here",
                                        seconds_in_previous_state=0.0))
                return
            self._discard_stage(existing, spec.stage.key)
        if self.shutting_down:
            return
        slot = ReplicaSlot(spec, Lifecycle(time.monotonic()))
        self.replicas[spec.replica_id] = slot
        self._move(slot, ReplicaState.RESERVING)
        try:
            faults.check("reserving")
            slot.reservation = self.pool.reserve(spec.replica_id, estimate_replica_bytes(spec), spec.devices,
                                                 spec.gpu_indices)
            slot.binding = replica_binding(self.grant, slot.reservation.devices, self.allowed_cpus)
        except (ReservationError, CheckpointError, faults.InjectedFailure) as exc:
            self._fail(slot, f"reserve failed: {exc}")
            return
        self._move(slot, ReplicaState.LOADING, spec.model_dir)
        if not slot.needs_weights:
            self._spawn(slot, "", "")
            return
        now = time.monotonic()
        try:
            ticket = self.loader.request(spec.model, spec.model_dir, spec.replica_id, now, spec.load_timeout)
        except CheckpointError as exc:
            self._fail(slot, f"checkpoint: {exc}", load_reason="checkpoint")
            return
        except L2Full as exc:  # pinned models fill L2: this replica reads L3 itself (verified)
            log.warning("replica %s bypasses L2: %s", spec.replica_id, exc)
            slot.load_source = "l3"
            self._spawn(slot, spec.model_dir, "l3")
            return
        slot.l2_key = ticket.key
        if ticket.ready:
            slot.load_source = "l2"
            self._spawn(slot, str(ticket.path), "l2")
        else:
            slot.load_source, slot.l3_total = "l3", ticket.nbytes

    def prefetch(self, message: Prefetch) -> None:
        try:
            self.loader.request(message.model, message.model_dir, PREFETCH, time.monotonic(), message.load_timeout)
        except (CheckpointError, L2Full) as exc:
            reason = "l2_full" if isinstance(exc, L2Full) else "checkpoint"
            self._send(LoadFailed(agent_id=self.agent_id, replica_id="", model=message.model, reason=reason,
                                  detail=str(exc)))

    def stop(self, replica_id: str, drain_timeout: float) -> None:
        slot = self.replicas.get(replica_id)
        if slot is None or slot.finished:
            return
        if slot.process is None:  # still reserving or waiting for L2: nothing runs yet
            self._move(slot, ReplicaState.STOPPED, "stopped before its process started")
            self._release(slot)
            return
        if slot.exit_code is not None:
            return
        slot.stop_deadline = time.monotonic() + drain_timeout + 5.0
        try:
            slot.process.send_signal(signal.SIGTERM)  # the replica drains, then exits
        except ProcessLookupError:
            pass

    def shutdown(self, drain_timeout: float) -> None:
        self.shutting_down = True
        self.shutdown_deadline = time.monotonic() + drain_timeout + 5.0
        for replica_id in list(self.replicas):
            self.stop(replica_id, drain_timeout)

    # ---------------------------------------------------------------- weights

    def _advance_loads(self) -> None:
        now = time.monotonic()
        for result in self.loader.poll(now):
            self._on_fill(result)
        for slot in self.replicas.values():  # progress of L3 -> L2 for the heartbeat
            if slot.process is None and slot.l2_key and slot.state is ReplicaState.LOADING:
                slot.l3_done, _ = self.loader.progress(slot.l2_key)

    def _on_fill(self, result: FillResult) -> None:
        if not result.ok:
            log.warning("loading %s into L2 failed after %d attempt(s): %s %s", result.model, result.attempts,
                        result.reason, result.detail)
        if PREFETCH in result.waiters and not result.ok:
            self._send(LoadFailed(agent_id=self.agent_id, replica_id="", model=result.model, reason=result.reason,
                                  attempts=result.attempts, detail=result.detail))
        for replica_id in result.waiters - {PREFETCH}:
            slot = self.replicas.get(replica_id)
            if slot is None or slot.process is not None or slot.state is not ReplicaState.LOADING:
                self.cache.unpin(result.key, replica_id, time.monotonic())  # it went away meanwhile
                continue
            if result.ok:
                slot.l3_done = slot.l3_total
                self._spawn(slot, str(self.cache.path(result.key)), "l2")
            else:
                self._fail(slot, f"{result.reason}: {result.detail}", load_reason=result.reason,
                           attempts=result.attempts)

    # ---------------------------------------------------------------- replica processes

    def _spawn(self, slot: ReplicaSlot, weights_dir: str, source: str) -> None:
        try:
            spawn(slot, self.hostname, weights_dir, source, self.replica_env)
        except OSError as exc:
            self._fail(slot, f"cannot start the replica process: {exc}")
            return
        self._heartbeat_due = True
        log.info("started replica %s (pid %d, weights from %s)", slot.replica_id, slot.process.pid,
                 source or "nowhere")

    def _read_status_pipes(self) -> None:
        for slot in self.replicas.values():
            if slot.status_fd < 0:
                continue
            try:
                data = os.read(slot.status_fd, 65536)
            except BlockingIOError:
                continue
            if not data:  # writer closed: the process is exiting
                os.close(slot.status_fd)
                slot.status_fd = -1
                continue
            slot.partial += data
            *lines, slot.partial = slot.partial.split(b"\n")
            for line in lines:
                self._on_status_line(slot, line.decode(errors="replace"))

    def _on_status_line(self, slot: ReplicaSlot, line: str) -> None:
        parsed = parse_status_line(line)
        if parsed is None:
            log.warning("bad status line from %s: %r", slot.replica_id, line)
        elif isinstance(parsed[0], ReplicaState):
            state, detail = parsed
            if state is ReplicaState.STOPPED and not slot.stop_deadline and not self.shutting_down:
                # Nobody here asked it to stop (the router dropped it after a stall and told it to drain):
                # the controller restarts it rather than take it for its node leaving.
                detail = STOPPED_UNASKED + (f": {detail}" if detail else "")
            if state is not slot.state:  # "loading" again from the replica: same step, L2 -> L1 now
                self._move(slot, state, detail)
        else:
            slot.l1_done, slot.l1_total = parsed

    def _move(self, slot: ReplicaSlot, new: ReplicaState, detail: str = "") -> bool:
        if slot.state.terminal:  # e.g. the exit of a replica that already said "failed"
            return False
        transition = slot.lifecycle.move(new, time.monotonic(), detail)
        if transition is None:
            log.warning("replica %s: ignoring %s -> %s (not a lifecycle step)", slot.replica_id,
                        slot.state.value, new.value)
            return False
        slot.detail = detail
        log.info("replica %s %s -> %s after %.3fs %s", slot.replica_id, transition.old.value, new.value,
                 transition.seconds, detail)
        if slot.replica_id in self._replacing:
            return True  # its drain for new routers (start()) is not news: the replica starts again here
        self._send(ReplicaEvent(agent_id=self.agent_id, replica_id=slot.replica_id, state=new.value,
                                detail=detail, seconds_in_previous_state=round(transition.seconds, 6)))
        return True

    def _fail(self, slot: ReplicaSlot, detail: str, load_reason: str = "", attempts: int = 1) -> None:
        """A failure before the replica process exists: report it and release what was reserved."""
        self._move(slot, ReplicaState.FAILED, detail)
        if load_reason:
            self._send(LoadFailed(agent_id=self.agent_id, replica_id=slot.replica_id, model=slot.spec.model,
                                  reason=load_reason, attempts=attempts, detail=detail))
        self._release(slot)

    def _discard_stage(self, slot: ReplicaSlot, new_key: str) -> None:
        """A new attempt of a pipeline replica replaces this process of an old one (a peer stage of it
        was lost, so it cannot serve): killed and released without a report, as if it never was."""
        log.warning("replica %s: stopping pipeline attempt %s for attempt %s", slot.replica_id,
                    slot.spec.stage.key, new_key)
        if slot.process is not None and slot.process.poll() is None:
            slot.process.kill()
            slot.process.wait(5)
        if slot.status_fd >= 0:
            os.close(slot.status_fd)
            slot.status_fd = -1
        self._release(slot)

    def _release(self, slot: ReplicaSlot) -> None:
        """Give back everything the replica held; safe to call more than once."""
        if slot.released:
            return
        slot.released = True
        self.pool.release(slot.replica_id)
        self.loader.forget(slot.replica_id)
        if slot.l2_key:
            self.cache.unpin(slot.l2_key, slot.replica_id, time.monotonic())

    def _reap(self) -> None:
        now = time.monotonic()
        again: list[StartReplica] = []
        for slot in self.replicas.values():
            if slot.process is None or slot.exit_code is not None:
                continue
            code = slot.process.poll()
            if code is None:
                if slot.stop_deadline and now > slot.stop_deadline:
                    log.warning("replica %s did not stop in time; killing it", slot.replica_id)
                    slot.process.kill()
                continue
            slot.exit_code = code
            self._read_status_pipes()  # pick up its last words before judging the exit
            if slot.replica_id in self._replacing and not self.shutting_down:
                self._release(slot)
                again.append(self._replacing.pop(slot.replica_id))
                continue
            if code == 0 and slot.stop_deadline and not slot.state.terminal:
                self._move(slot, ReplicaState.STOPPED, "stopped on request")
            elif not slot.state.terminal:
                cause = f"exit code {code}" if code >= 0 else f"killed by signal {-code}"
                self._move(slot, ReplicaState.FAILED, f"{cause} while {slot.state.value}"
                           + (f": {slot.detail}" if slot.detail else ""))
            self._release(slot)
        for spec in again:
            self.replicas.pop(spec.replica_id, None)
            self.start(spec)

    def _all_done(self, now: float) -> bool:
        if all(slot.finished for slot in self.replicas.values()):
            return True
        return now > self.shutdown_deadline + 5.0

    def _kill_all(self) -> None:
        for slot in self.replicas.values():
            if slot.process is not None and slot.process.poll() is None:
                slot.process.kill()
                slot.process.wait(5)
            if slot.process is not None and slot.exit_code is None:
                slot.exit_code = slot.process.returncode
            if slot.status_fd >= 0:
                os.close(slot.status_fd)
                slot.status_fd = -1
            self._release(slot)

    # ---------------------------------------------------------------- telemetry

    def _heartbeat(self) -> None:
        self._seq += 1
        gpus = granted_telemetry(self.grant, read_gpus()[0]) if self._seq % 5 == 1 else []
        self._compose_beat(AgentHeartbeat(agent_id=self.agent_id, seq=self._seq,
                                  replicas=[slot.status() for slot in self.replicas.values()],
                                  gpus=gpus, host_memory_used=host_memory()[1], memory=self.pool.status(),
                                  l2=self.cache.status(time.monotonic())))

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
