"""The node agent's core (agent/core.py), driven with the controller's commands, what replica processes
report, and a clock; no socket, no thread, no process: the same core the node agent runs behind its loop
and the simulator runs for every simulated node."""

from __future__ import annotations

import signal
from pathlib import Path

from exaserve_hpc.agent.core import EXIT_CONTROLLER_LOST, AgentCore
from exaserve_hpc.agent.gpu_binding import GpuGrant, GrantedGpu
from exaserve_hpc.agent.memory_pool import MemoryPool
from exaserve_hpc.agent.weight_loader import FillResult, Ticket
from exaserve_hpc.protocol import (EngineSettings, L2Status, LoadFailed, ReplicaEvent, StartReplica, StopReplica)

GiB = 1 << 30


class Process:
    def __init__(self, pid):
        self.pid, self.returncode, self.signals = pid, None, []

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        return self.returncode

    def send_signal(self, sig):
        self.signals.append(sig)

    def kill(self):
        self.returncode = -signal.SIGKILL


class Processes:
    def __init__(self):
        self.started, self.lines = [], {}

    def spawn(self, slot, node, weights_dir, source, env):
        slot.process = Process(100 + len(self.started))
        self.started.append((slot.replica_id, weights_dir, source, dict(env), slot.binding.env))

    def read_status(self, slot):
        return self.lines.pop(slot.replica_id, [])

    def close(self, slot):
        self.lines.pop(slot.replica_id, None)


class Loader:
    def __init__(self):
        self.waiting, self.results, self.forgotten = {}, [], []

    def request(self, model, model_dir, holder, now, timeout=0.0):
        self.waiting.setdefault(model, set()).add(holder)
        return Ticket(model, Path("/l2") / model, False, 4 * GiB)

    def fill(self, model, ok=True):
        self.results.append(FillResult(model, model, self.waiting.pop(model), ok, 1, "" if ok else "checksum",
                                       "" if ok else "blake3 mismatch"))

    def poll(self, now):
        out, self.results = self.results, []
        return out

    def progress(self, key):
        return 1 * GiB, 4 * GiB

    def forget(self, holder):
        self.forgotten.append(holder)


class Cache:
    def __init__(self):
        self.unpinned = []

    def path(self, key):
        return Path("/l2") / key

    def unpin(self, key, holder, now):
        self.unpinned.append((key, holder))

    def status(self, now):
        return L2Status(capacity=64 * GiB)


def core_with(clock, timeout=0.0):
    grant = GpuGrant((GrantedGpu("0", "GPU-a"), GrantedGpu("1", "GPU-b")), source="test")
    return AgentCore("n1", "n1", pool=MemoryPool([80 * GiB, 80 * GiB], GiB, ["GPU-a", "GPU-b"]), cache=Cache(),
                     loader=Loader(), grant=grant, processes=Processes(), controller_timeout=timeout,
                     clock=lambda: clock[0])


def start(rid, memory=30 * GiB, gpu=1, engine="reference"):
    return StartReplica(replica_id=rid, model="m", model_dir="/store/m", router_backend="tcp://r:1",
                        settings=EngineSettings(engine=engine), memory_bytes=memory, gpu_indices=[gpu])


def states(effects):
    return [(m.replica_id, m.state, m.detail) for m in effects if isinstance(m, ReplicaEvent)]


def test_a_replica_from_start_to_serving_to_stopped_and_everything_given_back():
    clock = [0.0]
    core = core_with(clock)
    core.handle(start("m/r0"))
    assert [s[:2] for s in states(core.take_effects())] == [("m/r0", "reserving"), ("m/r0", "loading")]
    assert core.pool.status().free[1] == 50 * GiB and not core.processes.started  # waits for L2

    clock[0] = 3.0
    core.loader.fill("m")
    core.advance_loads()  # the fill is done: the process starts on its GPU, from L2
    (rid, weights, source, _, binding), = core.processes.started
    assert (rid, weights, source) == ("m/r0", "/l2/m", "l2") and binding["CUDA_VISIBLE_DEVICES"] == "GPU-b"
    assert core.heartbeat_due

    core.processes.lines["m/r0"] = ["initializing 0", "warming 0", "registering 0", "serving 0"]
    core.read_status()
    assert [s[1] for s in states(core.take_effects())] == ["initializing", "warming", "registering", "serving"]
    beat = core.heartbeat(1, [], 0)
    assert [(r.replica_id, r.state, r.pid, r.devices) for r in beat.replicas] == [("m/r0", "serving", 100, ["GPU-b"])]

    core.handle(StopReplica(replica_id="m/r0", drain_timeout=10.0))
    slot = core.replicas["m/r0"]
    assert slot.process.signals == [signal.SIGTERM] and slot.stop_deadline == 3.0 + 15.0
    slot.process.returncode = 0  # drained and exited
    core.reap()
    assert states(core.take_effects()) == [("m/r0", "stopped", "stopped on request")]
    assert core.pool.status().free == [80 * GiB, 80 * GiB] and ("m", "m/r0") in core.cache.unpinned


def test_a_refused_reservation_and_a_bad_fill_fail_the_replica_without_a_process():
    clock = [0.0]
    core = core_with(clock)
    core.handle(start("m/big", memory=90 * GiB))
    assert states(core.take_effects())[-1][:2] == ("m/big", "failed") and not core.processes.started
    core.handle(start("m/r1"))
    core.take_effects()
    core.loader.fill("m", ok=False)
    core.advance_loads()
    out = core.take_effects()
    assert states(out)[-1][:2] == ("m/r1", "failed") and not core.processes.started
    assert [(m.replica_id, m.reason) for m in out if isinstance(m, LoadFailed)] == [("m/r1", "checksum")]
    assert core.pool.status().free == [80 * GiB, 80 * GiB]


def test_a_crash_is_a_failure_a_slow_drain_is_killed_and_a_silent_controller_stops_everything():
    clock = [0.0]
    core = core_with(clock, timeout=30.0)
    for rid in ("e/r0", "e/r1"):  # the echo engine needs no weights: its process starts at once
        core.handle(start(rid, memory=GiB, engine="echo"))
        core.processes.lines[rid] = ["initializing 0", "warming 0", "registering 0", "serving 0"]
    core.read_status()
    core.take_effects()
    core.replicas["e/r0"].process.returncode = 1
    core.reap()
    assert states(core.take_effects()) == [("e/r0", "failed", "exit code 1 while serving")]

    core.handle(StopReplica(replica_id="e/r1", drain_timeout=2.0))
    clock[0] = 8.0  # past the drain timeout plus the agent's 5 s
    core.reap()
    assert core.replicas["e/r1"].process.returncode == -signal.SIGKILL
    core.reap()
    assert states(core.take_effects())[-1][:2] == ("e/r1", "failed")

    core.handle(start("e/r2", memory=GiB, engine="echo"))
    clock[0] = 40.0  # 32 s since the controller's last word
    assert core.controller_lost() and core.exit_code == EXIT_CONTROLLER_LOST and core.shutting_down
    assert core.replicas["e/r2"].process.signals == [signal.SIGTERM]
    assert not core.controller_lost()  # noticed once
