"""`exaserve serve` keeps its node agent running (issue 13 item 5).

The agent is a child process and its replicas are the agent's children, started with PDEATHSIG
(SIGTERM when the agent dies). When the agent dies on its own (kill -9, a crash):
  1. its exit is reaped at once (Popen.wait: it never stays a zombie);
  2. its orphaned replicas, reparented to this process (a child subreaper), are killed and reaped. A new
     agent cannot adopt them (their status pipes died with the old one), and a copy left draining would
     hold the replica's identity at the router and its memory on the node: a clean replacement;
  3. a new agent starts (the same id and L2 directory, whose files it adopts);
  4. once it has said hello, the replicas the controller had on this node are reported failed, so the
     controller restarts them on the new agent with its usual backoff (the first after 1 s).
An agent that refuses the node (its GPU grant) or dies more than RESTARTS times within WINDOW seconds
stops the plane instead (exit 1): restarting it would not help.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

from exaserve_hpc.agent.lifecycle import ReplicaState
from exaserve_hpc.protocol import ReplicaEvent

log = logging.getLogger("exaserve.control")

RESTARTS = 5          # agent restarts allowed within WINDOW seconds
WINDOW = 60.0
HELLO_WAIT = 30.0     # seconds a new agent has to say hello before its node's replicas are reported anyway
REPLICA_COMMAND = b"exaserve_hpc.agent.replica_main"
EXIT_BAD_GRANT = 2    # node_agent.EXIT_BAD_GRANT (not imported: that module pulls in the agent's dependencies)


def give_up_reason(code: int, restarts: list[float], now: float) -> str:
    """Why the agent that exited with `code` is not restarted ("" to restart it); `restarts`: when it was
    restarted before (monotonic seconds)."""
    if code == EXIT_BAD_GRANT:
        return f"this node's agent exited with status {code} (its message is above)"
    recent = [t for t in restarts if now - t < WINDOW]
    if len(recent) >= RESTARTS:
        return (f"this node's agent exited with status {code}, its {len(recent) + 1}th exit within "
                f"{WINDOW:.0f}s; not restarting it")
    return ""


def become_subreaper() -> None:
    """Orphaned descendants (an agent's replicas once it dies) are reparented to us, so we can end them."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except OSError:
        pass


def orphaned_replicas() -> list[int]:
    """Replica processes whose parent is now this process (their agent died)."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            if ppid == me and REPLICA_COMMAND in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def end_orphans(known: Iterable[int] = ()) -> list[int]:
    """Kill and reap the dead agent's replicas; their pids. `known`: the replicas' pids as the controller has
    them. A replica that ended by itself before the scan (PDEATHSIG's TERM: an idle one drains at once) is
    a zombie of ours whose /proc cmdline is empty, so the scan cannot name it: it is reaped by its pid. One
    the scan missed while it still ran (its /proc entries unreadable for a moment on a loaded machine) is
    killed and reaped by its pid too: left alone it would drain and stay a zombie nobody waits for."""
    pids = orphaned_replicas()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    for pid in set(known) - set(pids):
        try:
            if not os.waitpid(pid, os.WNOHANG)[0]:  # our child (reparented here), still running
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            pids.append(pid)
        except (ChildProcessError, ProcessLookupError):  # not a child of ours (never reparented, or reaped)
            continue
    return pids


class AgentSupervisor:
    """Starts this node's agent with `start()` and restarts it when it dies on its own (see the module)."""

    def __init__(self, start: Callable[[], subprocess.Popen], controller, node: str,
                 on_give_up: Callable[[str], None]):
        self._start, self.controller, self.node, self._on_give_up = start, controller, node, on_give_up
        self._lock = threading.Lock()
        self._stopping = False
        self.restarts: list[float] = []
        become_subreaper()
        self.process = start()
        self._thread = threading.Thread(target=self._watch, name="exaserve-agent-watch", daemon=True)
        self._thread.start()

    def stop(self) -> subprocess.Popen:
        """The plane is stopping: no restart any more; the agent to wait for."""
        with self._lock:
            self._stopping = True
            return self.process

    def kill(self) -> None:
        self.stop().kill()

    def check(self, node: str) -> Optional[bool]:
        """The controller's direct liveness check (controller/liveness.py) for `node`: True while this node's
        agent process runs (however late its heartbeats are), False once it is gone (until its replacement
        starts), None for another node or a process that cannot be judged (stopped by a signal)."""
        if node != self.node:
            return None
        process = self.process
        if process.poll() is not None:
            return False
        return process_running(process.pid)

    def _watch(self) -> None:
        while True:
            process = self.process
            code = process.wait()
            with self._lock:
                if self._stopping:
                    return
            now = time.monotonic()
            why = give_up_reason(code, self.restarts, now)
            if why:
                log.error("%s; stopping", why)
                self._on_give_up(why)
                return
            stale = self._replicas_here()
            ended = end_orphans(self._replica_pids())
            with self._lock:
                if self._stopping:
                    return
                self.restarts.append(now)
                self.process = self._start()
            line = (f"exaserve: this node's agent (pid {process.pid}) exited with status {code}; started a new "
                    f"one (pid {self.process.pid}); {len(ended)} replica process(es) of the old one ended, "
                    f"restarted under the new one")
            log.warning("%s", line)
            print(line, flush=True)
            self._replace_replicas(self.process, stale, f"its agent (pid {process.pid}) died; restarted")

    def _replicas_here(self) -> dict:
        """The controller's replicas on this node now: id -> (state, transitions seen), to tell later whether
        anything happened to each since (a node declared lost meanwhile has its replicas placed anew)."""
        with self.controller.fleet.lock:
            return {rid: (r.state, len(r.transitions)) for rid, r in self.controller.replicas.items()
                    if r.agent_id == self.node and not r.state.terminal}

    def _replica_pids(self) -> set[int]:
        with self.controller.fleet.lock:
            return {r.pid for r in self.controller.replicas.values() if r.agent_id == self.node and r.pid > 0}

    def _replace_replicas(self, process: subprocess.Popen, stale: dict, why: str) -> None:
        """Once the new agent has said hello, the controller restarts the old agent's replicas on it."""
        deadline = time.monotonic() + HELLO_WAIT
        while time.monotonic() < deadline and process.poll() is None and not self._stopping:
            with self.controller.fleet.lock:
                agent = self.controller.agents.get(self.node)
                if agent is not None and agent.pid == process.pid:
                    break
            time.sleep(0.05)
        controller, node = self.controller, self.node

        def fail_old() -> None:  # on the controller thread, fleet lock held
            for rid, seen in stale.items():
                record = controller.replicas.get(rid)
                if record is not None and record.agent_id == node and (record.state, len(record.transitions)) == seen:
                    controller.handle(node, ReplicaEvent(agent_id=node, replica_id=record.replica_id,
                                                         state=ReplicaState.FAILED.value, detail=why))
        controller.fleet.submit(fail_old)


def process_running(pid: int) -> Optional[bool]:
    """A local process checked through /proc: True running (or runnable, however starved), False gone (or a
    zombie), None when it cannot tell (stopped by a signal, being traced: it may be hung; no /proc)."""
    if pid <= 0:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        return None
    try:
        state = stat[stat.rindex(")") + 2]
    except (ValueError, IndexError):
        return None
    if state in "ZX":
        return False
    if state in "Tt":
        return None
    return True
