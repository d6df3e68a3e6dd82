"""The node agent's core: the controller's commands and what its replicas report in, decisions out. No
socket, no thread, no pipe.

    core = AgentCore(agent_id, hostname, pool=..., cache=..., loader=..., grant=..., processes=..., clock=...)
    core.handle(StartReplica(...))        # StartReplica, StopReplica, Prefetch, Shutdown
    core.advance_loads()                  # weight fills (L3 -> L2) that finished: spawn the waiting replicas
    core.read_status()                    # what the replica processes reported (state lines, L1 progress)
    core.reap()                           # exited processes: stopped, failed, or started again for new routers
    core.take_effects()                   # [message]: ReplicaEvent, LoadFailed, ... for the controller
    core.hello(...), core.heartbeat(...)  # what the agent says about itself

`NodeAgent` (node_agent.py) is this core plus the loop that owns the DEALER socket, the heartbeat thread and
the status pipes; the simulator (sim/fleet.py) drives the same core with simulated processes, loader and
cache. A replica's start (lifecycle.py): reserve from the node's memory pool -> load (the loader fills L2
from L3 once per model, then the replica process copies L2 -> L1) -> init -> warm-up -> register ->
serving. Whatever ends a replica (failure at any step, stop, crash), the core releases its reservation and
its L2 pin. Restarting or re-placing is the controller's decision.

The seams it is given: the memory pool (memory_pool.py, pure), the L2 cache and weight loader (their
`request`/`poll`/`progress`/`forget` and `unpin`/`path`/`status`), and `processes` (ReplicaProcesses:
start a replica process, read what it wrote on its status pipe). A slot's `process` is Popen-like (`pid`,
`poll`, `send_signal`, `kill`, `wait`).
"""

from __future__ import annotations

import logging
import signal
import time
from typing import Callable, Optional, Protocol

from exaserve_hpc.agent import faults
from exaserve_hpc.agent.adoption import backends, must_restart
from exaserve_hpc.agent.gpu_binding import GpuGrant, replica_binding
from exaserve_hpc.agent.lifecycle import STOPPED_UNASKED, Lifecycle, ReplicaState
from exaserve_hpc.agent.memory_pool import MemoryPool, ReservationError
from exaserve_hpc.agent.replica_process import ReplicaSlot, parse_status_line
from exaserve_hpc.agent.weight_loader import PREFETCH, FillResult
from exaserve_hpc.cache.checkpoint import CheckpointError
from exaserve_hpc.cache.l2_shm import L2Full
from exaserve_hpc.engine.registry import ENGINES
from exaserve_hpc.protocol import (
    AgentHeartbeat, AgentHello, GpuInfo, LoadFailed, Prefetch, ReplicaEvent, Shutdown, StartReplica, StopReplica
)

log = logging.getLogger("exaserve.agent")

EXIT_CONTROLLER_LOST = 3  # the agent's exit status when its controller went silent


def estimate_replica_bytes(spec: StartReplica) -> int:
    """Bytes per device to reserve: the controller's figure, else its engine's estimate (engine/registry.py)."""
    if spec.memory_bytes:
        return spec.memory_bytes
    engine = ENGINES.get(spec.settings.engine)
    return engine.memory_bytes(spec) if engine is not None else 0  # an unknown engine fails in its replica


class ReplicaProcesses(Protocol):
    """Where replica processes come from (replica_process.PipeProcesses; the simulator's stand-in)."""

    def spawn(self, slot: ReplicaSlot, node: str, weights_dir: str, source: str, env: dict[str, str]) -> None:
        """Start the replica's process (sets slot.process); OSError if it cannot start."""

    def read_status(self, slot: ReplicaSlot) -> list[str]:
        """The status lines the process wrote since the last call, without waiting."""

    def close(self, slot: ReplicaSlot) -> None:
        """Stop reading its status (its process is gone or forgotten)."""


class AgentCore:
    def __init__(self, agent_id: str, hostname: str, *, pool: MemoryPool, cache, loader, grant: GpuGrant,
                 processes: ReplicaProcesses, allowed_cpus: frozenset[int] = frozenset(), node_index: int = 0,
                 replica_env: Optional[dict[str, str]] = None, controller_timeout: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self.agent_id = agent_id
        self.hostname = hostname
        self.node_index = node_index
        self.pool = pool
        self.cache = cache
        self.loader = loader
        self.grant = grant
        self.processes = processes
        self.allowed_cpus = allowed_cpus  # Slurm's cpuset: replicas' CPUs stay in it
        self.replica_env = replica_env or {}  # added to every replica process's environment
        self.clock = clock
        self.replicas: dict[str, ReplicaSlot] = {}
        self._replacing: dict[str, StartReplica] = {}  # replica id -> its spec for new routers, started at its exit
        self.shutting_down = False
        self.shutdown_deadline = 0.0
        # Silence from the controller this long (0: never) means it is gone: stop everything and exit
        # non-zero, rather than keep replicas (and, under Slurm, the allocation) running for nobody.
        self.controller_timeout = controller_timeout
        self.controller_heard = clock()
        self.exit_code = 0
        self.heartbeat_due = False  # a replica process started: its pid goes out before its first event
        self.outbox: list = []

    def take_effects(self) -> list:
        """The messages for the controller the core produced since the last call, in order."""
        out, self.outbox = self.outbox, []
        return out

    # ---------------------------------------------------------------- what the agent says

    def hello(self, gpus: list[GpuInfo], host_memory_total: int, pid: int, cpus: int = 0,
              replica_threads: int = 0) -> AgentHello:
        return AgentHello(agent_id=self.agent_id, hostname=self.hostname, pid=pid, node_index=self.node_index,
                          gpus=gpus, host_memory_total=host_memory_total, memory=self.pool.status(),
                          l2=self.cache.status(self.clock()), cpus=cpus, replica_threads=replica_threads)

    def heartbeat(self, seq: int, gpus: list[GpuInfo], host_memory_used: int) -> AgentHeartbeat:
        return AgentHeartbeat(agent_id=self.agent_id, seq=seq, replicas=[s.status() for s in self.replicas.values()],
                              gpus=gpus, host_memory_used=host_memory_used, memory=self.pool.status(),
                              l2=self.cache.status(self.clock()))

    # ---------------------------------------------------------------- commands

    def handle(self, message) -> None:
        """One command from the controller (any message counts as word from it)."""
        self.controller_heard = self.clock()
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
                # and starts again here for them (reap), as the same replica: no stop reaches the controller.
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
                self.outbox.append(ReplicaEvent(agent_id=self.agent_id, replica_id=spec.replica_id,
                                                state=existing.state.value, detail="already running here",
                                                seconds_in_previous_state=0.0))
                return
            self._discard_stage(existing, spec.stage.key)
        if self.shutting_down:
            return
        slot = ReplicaSlot(spec, Lifecycle(self.clock()))
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
        try:
            ticket = self.loader.request(spec.model, spec.model_dir, spec.replica_id, self.clock(), spec.load_timeout)
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
            self.loader.request(message.model, message.model_dir, PREFETCH, self.clock(), message.load_timeout)
        except (CheckpointError, L2Full) as exc:
            reason = "l2_full" if isinstance(exc, L2Full) else "checkpoint"
            self.outbox.append(LoadFailed(agent_id=self.agent_id, replica_id="", model=message.model, reason=reason,
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
        slot.stop_deadline = self.clock() + drain_timeout + 5.0
        try:
            slot.process.send_signal(signal.SIGTERM)  # the replica drains, then exits
        except ProcessLookupError:
            pass

    def shutdown(self, drain_timeout: float) -> None:
        self.shutting_down = True
        self.shutdown_deadline = self.clock() + drain_timeout + 5.0
        for replica_id in list(self.replicas):
            self.stop(replica_id, drain_timeout)

    def controller_lost(self, controller: str = "") -> bool:
        """The controller (at `controller`, for the log) has been silent past controller_timeout: stop every
        replica and exit with EXIT_CONTROLLER_LOST (True the first time it is noticed)."""
        now = self.clock()
        if not self.controller_timeout or self.shutting_down or now - self.controller_heard <= self.controller_timeout:
            return False
        log.error("no word from the controller%s for %.0fs (heartbeat.controller_timeout); stopping %d replica(s) "
                  "and exiting", f" at {controller}" if controller else "", now - self.controller_heard,
                  len(self.replicas))
        self.exit_code = EXIT_CONTROLLER_LOST
        self.shutdown(5.0)
        return True

    def all_done(self) -> bool:
        """Shutting down and every replica finished (or past the shutdown deadline)."""
        if all(slot.finished for slot in self.replicas.values()):
            return True
        return self.clock() > self.shutdown_deadline + 5.0

    # ---------------------------------------------------------------- weights

    def advance_loads(self) -> None:
        for result in self.loader.poll(self.clock()):
            self._on_fill(result)
        for slot in self.replicas.values():  # progress of L3 -> L2 for the heartbeat
            if slot.process is None and slot.l2_key and slot.state is ReplicaState.LOADING:
                slot.l3_done, _ = self.loader.progress(slot.l2_key)

    def _on_fill(self, result: FillResult) -> None:
        if not result.ok:
            log.warning("loading %s into L2 failed after %d attempt(s): %s %s", result.model, result.attempts,
                        result.reason, result.detail)
        if PREFETCH in result.waiters and not result.ok:
            self.outbox.append(LoadFailed(agent_id=self.agent_id, replica_id="", model=result.model,
                                          reason=result.reason, attempts=result.attempts, detail=result.detail))
        for replica_id in result.waiters - {PREFETCH}:
            slot = self.replicas.get(replica_id)
            if slot is None or slot.process is not None or slot.state is not ReplicaState.LOADING:
                self.cache.unpin(result.key, replica_id, self.clock())  # it went away meanwhile
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
            self.processes.spawn(slot, self.hostname, weights_dir, source, self.replica_env)
        except OSError as exc:
            self._fail(slot, f"cannot start the replica process: {exc}")
            return
        self.heartbeat_due = True
        log.info("started replica %s (pid %d, weights from %s)", slot.replica_id, slot.process.pid,
                 source or "nowhere")

    def read_status(self) -> None:
        """What every replica process wrote on its status pipe since the last call."""
        for slot in list(self.replicas.values()):
            for line in self.processes.read_status(slot):
                self.on_status_line(slot, line)

    def on_status_line(self, slot: ReplicaSlot, line: str) -> None:
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
        transition = slot.lifecycle.move(new, self.clock(), detail)
        if transition is None:
            log.warning("replica %s: ignoring %s -> %s (not a lifecycle step)", slot.replica_id,
                        slot.state.value, new.value)
            return False
        slot.detail = detail
        log.info("replica %s %s -> %s after %.3fs %s", slot.replica_id, transition.old.value, new.value,
                 transition.seconds, detail)
        if slot.replica_id in self._replacing:
            return True  # its drain for new routers (start()) is not news: the replica starts again here
        self.outbox.append(ReplicaEvent(agent_id=self.agent_id, replica_id=slot.replica_id, state=new.value,
                                        detail=detail, seconds_in_previous_state=round(transition.seconds, 6)))
        return True

    def _fail(self, slot: ReplicaSlot, detail: str, load_reason: str = "", attempts: int = 1) -> None:
        """A failure before the replica process exists: report it and release what was reserved."""
        self._move(slot, ReplicaState.FAILED, detail)
        if load_reason:
            self.outbox.append(LoadFailed(agent_id=self.agent_id, replica_id=slot.replica_id, model=slot.spec.model,
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
        self.processes.close(slot)
        self._release(slot)

    def _release(self, slot: ReplicaSlot) -> None:
        """Give back everything the replica held; safe to call more than once."""
        if slot.released:
            return
        slot.released = True
        self.pool.release(slot.replica_id)
        self.loader.forget(slot.replica_id)
        if slot.l2_key:
            self.cache.unpin(slot.l2_key, slot.replica_id, self.clock())

    def reap(self) -> None:
        """Exited replica processes: reported stopped or failed and released, or started again for new
        routers; one past its stop deadline is killed."""
        now = self.clock()
        again: list[StartReplica] = []
        for slot in list(self.replicas.values()):
            if slot.process is None or slot.exit_code is not None:
                continue
            code = slot.process.poll()
            if code is None:
                if slot.stop_deadline and now > slot.stop_deadline:
                    log.warning("replica %s did not stop in time; killing it", slot.replica_id)
                    slot.process.kill()
                continue
            slot.exit_code = code
            for line in self.processes.read_status(slot):  # its last words, before judging the exit
                self.on_status_line(slot, line)
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

    def kill_all(self) -> None:
        """The agent is leaving: every replica process killed and everything released."""
        for slot in self.replicas.values():
            if slot.process is not None and slot.process.poll() is None:
                slot.process.kill()
                slot.process.wait(5)
            if slot.process is not None and slot.exit_code is None:
                slot.exit_code = slot.process.returncode
            self.processes.close(slot)
            self._release(slot)
