"""The node agent: one per node; runs the replicas the controller asks for.

    python -m exaserve_hpc.agent --controller tcp://HOST:PORT --agent-id NAME

It connects a DEALER socket (identity = agent id) to the controller, says
hello with its inventory, then loops: poll the controller socket and every
replica's status pipe, run commands (start / stop replica, shut down), reap
exited replicas and report their cause, and heartbeat every interval with
telemetry and each replica's state. Restarting a failed replica is the
controller's decision, not the agent's.
"""

from __future__ import annotations

import logging
import os
import signal
import socket as pysocket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import zmq

from ..protocol import (
    AgentHeartbeat, AgentHello, DecodeError, ReplicaEvent, ReplicaStatus, Shutdown, StartReplica, StopReplica,
    decode, encode,
)
from .lifecycle import ReplicaState, can_move
from .nvml_probe import host_memory, read_gpus
from .replica_main import die_with_parent

log = logging.getLogger("exaserve.agent")


@dataclass
class ReplicaProcess:
    spec: StartReplica
    process: subprocess.Popen
    status_fd: int
    state: ReplicaState = ReplicaState.PENDING
    started_at: float = field(default_factory=time.time)
    detail: str = ""
    exit_code: Optional[int] = None
    stop_deadline: float = 0.0
    _partial: bytes = b""

    def status(self) -> ReplicaStatus:
        return ReplicaStatus(replica_id=self.spec.replica_id, model=self.spec.model, state=self.state.value,
                             pid=self.process.pid, started_at=self.started_at, exit_code=self.exit_code,
                             detail=self.detail)


def spawn_replica(spec: StartReplica, node: str) -> ReplicaProcess:
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    command = [sys.executable, "-m", "exaserve_hpc.agent.replica_main", "--spec", encode(spec).hex(),
               "--status-fd", str(write_fd), "--node", node]
    process = subprocess.Popen(command, pass_fds=(write_fd,), stdin=subprocess.DEVNULL)
    os.close(write_fd)
    return ReplicaProcess(spec=spec, process=process, status_fd=read_fd)


class NodeAgent:
    def __init__(self, controller: str, agent_id: str, heartbeat_interval: float = 5.0, node_index: int = 0,
                 hostname: Optional[str] = None):
        self.controller = controller
        self.agent_id = agent_id
        self.hostname = hostname or pysocket.gethostname()
        self.node_index = node_index
        self.heartbeat_interval = heartbeat_interval
        self.replicas: dict[str, ReplicaProcess] = {}
        self.shutting_down = False
        self.shutdown_deadline = 0.0
        self._seq = 0
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, agent_id.encode())
        self.socket.setsockopt(zmq.LINGER, 1000)

    def run(self) -> int:
        self.socket.connect(self.controller)
        gpus, why = read_gpus()
        if not gpus:
            log.info("%s", why)
        self._send(AgentHello(agent_id=self.agent_id, hostname=self.hostname, pid=os.getpid(),
                              node_index=self.node_index, gpus=gpus, host_memory_total=host_memory()[0]))
        next_heartbeat = 0.0
        try:
            while True:
                poller = zmq.Poller()
                poller.register(self.socket, zmq.POLLIN)
                for replica in self.replicas.values():
                    if replica.status_fd >= 0:
                        poller.register(replica.status_fd, zmq.POLLIN)
                events = dict(poller.poll(100))
                if self.socket in events:
                    self._receive()
                self._read_status_pipes()
                self._reap()
                now = time.monotonic()
                if now >= next_heartbeat:
                    self._heartbeat()
                    next_heartbeat = now + self.heartbeat_interval
                if self.shutting_down and self._all_done(now):
                    self._heartbeat()
                    return 0
        finally:
            self._kill_all()
            self.socket.close()
            self.context.term()

    # ---------------------------------------------------------------- commands

    def _receive(self) -> None:
        while True:
            try:
                frame = self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = decode(frame)
            except DecodeError as exc:
                log.warning("undecodable command: %s", exc)
                continue
            if isinstance(message, StartReplica):
                self.start(message)
            elif isinstance(message, StopReplica):
                self.stop(message.replica_id, message.drain_timeout)
            elif isinstance(message, Shutdown):
                self.shutdown(message.drain_timeout)

    def start(self, spec: StartReplica) -> None:
        existing = self.replicas.get(spec.replica_id)
        if existing is not None and not existing.state.terminal:
            log.warning("replica %s is already running (pid %d)", spec.replica_id, existing.process.pid)
            return
        if self.shutting_down:
            return
        replica = spawn_replica(spec, self.hostname)
        self.replicas[spec.replica_id] = replica
        log.info("started replica %s (pid %d)", spec.replica_id, replica.process.pid)

    def stop(self, replica_id: str, drain_timeout: float) -> None:
        replica = self.replicas.get(replica_id)
        if replica is None or replica.exit_code is not None:
            return
        replica.stop_deadline = time.monotonic() + drain_timeout + 5.0
        try:
            replica.process.send_signal(signal.SIGTERM)  # the replica drains, then exits
        except ProcessLookupError:
            pass

    def shutdown(self, drain_timeout: float) -> None:
        self.shutting_down = True
        self.shutdown_deadline = time.monotonic() + drain_timeout + 5.0
        for replica_id in list(self.replicas):
            self.stop(replica_id, drain_timeout)

    # ---------------------------------------------------------------- replica processes

    def _read_status_pipes(self) -> None:
        for replica in self.replicas.values():
            if replica.status_fd < 0:
                continue
            try:
                data = os.read(replica.status_fd, 65536)
            except BlockingIOError:
                continue
            if not data:  # writer closed: the process is exiting
                os.close(replica.status_fd)
                replica.status_fd = -1
                continue
            replica._partial += data
            *lines, replica._partial = replica._partial.split(b"\n")
            for line in lines:
                self._on_status_line(replica, line.decode(errors="replace"))

    def _on_status_line(self, replica: ReplicaProcess, line: str) -> None:
        parts = line.split(" ", 2)
        try:
            new = ReplicaState(parts[0])
            seconds = float(parts[1])
        except (ValueError, IndexError):
            log.warning("bad status line from %s: %r", replica.spec.replica_id, line)
            return
        self._move(replica, new, parts[2] if len(parts) > 2 else "", seconds)

    def _move(self, replica: ReplicaProcess, new: ReplicaState, detail: str, seconds: float = 0.0) -> None:
        if not can_move(replica.state, new):
            return
        replica.state = new
        replica.detail = detail
        self._send(ReplicaEvent(agent_id=self.agent_id, replica_id=replica.spec.replica_id, state=new.value,
                                detail=detail, seconds_in_previous_state=seconds))

    def _reap(self) -> None:
        now = time.monotonic()
        for replica in self.replicas.values():
            if replica.exit_code is not None:
                continue
            code = replica.process.poll()
            if code is None:
                if replica.stop_deadline and now > replica.stop_deadline:
                    log.warning("replica %s did not stop in time; killing it", replica.spec.replica_id)
                    replica.process.kill()
                continue
            replica.exit_code = code
            self._read_status_pipes()  # pick up its last words before judging the exit
            if code == 0 and replica.state in (ReplicaState.DRAINING, ReplicaState.STOPPED, ReplicaState.SERVING) \
                    and replica.stop_deadline:
                self._move(replica, ReplicaState.STOPPED, "stopped on request")
            elif not replica.state.terminal:
                cause = f"exit code {code}" if code >= 0 else f"killed by signal {-code}"
                self._move(replica, ReplicaState.FAILED, f"{cause} while {replica.state.value}"
                           + (f": {replica.detail}" if replica.detail else ""))

    def _all_done(self, now: float) -> bool:
        if all(r.exit_code is not None for r in self.replicas.values()):
            return True
        return now > self.shutdown_deadline + 5.0

    def _kill_all(self) -> None:
        for replica in self.replicas.values():
            if replica.process.poll() is None:
                replica.process.kill()
                replica.process.wait(5)
            if replica.status_fd >= 0:
                os.close(replica.status_fd)
                replica.status_fd = -1

    # ---------------------------------------------------------------- telemetry

    def _heartbeat(self) -> None:
        self._seq += 1
        gpus, _ = read_gpus() if self._seq % 5 == 1 else ([], "")
        self._send(AgentHeartbeat(agent_id=self.agent_id, seq=self._seq,
                                  replicas=[r.status() for r in self.replicas.values()],
                                  gpus=gpus, host_memory_used=host_memory()[1]))

    def _send(self, message) -> None:
        try:
            self.socket.send(encode(message), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("controller not reachable; dropped %s", type(message).__name__)


def main(argv: Optional[list[str]] = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="exaserve-agent", description="Run the node agent of one node.")
    parser.add_argument("--controller", required=True, help="controller endpoint, e.g. tcp://host:port")
    parser.add_argument("--agent-id", default=pysocket.gethostname())
    parser.add_argument("--heartbeat", type=float, default=5.0, help="seconds between heartbeats")
    parser.add_argument("--node-index", type=int, default=0)
    parser.add_argument("--die-with-parent", action="store_true", help="exit when the starting process dies")
    args = parser.parse_args(argv)
    logging.basicConfig(level=os.environ.get("EXASERVE_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s agent %(levelname)s %(message)s")
    if args.die_with_parent:
        die_with_parent()
    agent = NodeAgent(args.controller, args.agent_id, args.heartbeat, args.node_index)
    signal.signal(signal.SIGTERM, lambda *_: agent.shutdown(10.0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller orders the shutdown
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
