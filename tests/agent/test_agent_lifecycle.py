"""The node agent runs the replica lifecycle; a failure at any step releases everything reserved so far.

A real agent (thread) with real replica processes, driven through a fake controller socket.
"""

import time

import pytest

from agent_harness import TINY, AgentUnderTest, alive
from exaserve_hpc.agent.faults import ENV
from exaserve_hpc.cache.checkpoint import create_tiny_checkpoint

pytestmark = pytest.mark.process

STEPS = ["reserving", "pending", "reserving", "loading", "initializing", "warming", "registering", "serving",
         "draining", "stopped"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return create_tiny_checkpoint(tmp_path_factory.mktemp("l3") / "tiny", TINY)


@pytest.fixture
def agent(tmp_path):
    a = AgentUnderTest(tmp_path)
    yield a
    a.close()


def assert_nothing_held(agent: AgentUnderTest, replica_id: str) -> None:
    beat = agent.settle(lambda b: not b.memory.reservations and all(e.pins == 0 for e in b.l2.entries))
    assert beat.memory.reservations == {} and beat.memory.free == beat.memory.total
    assert all(e.pins == 0 for e in beat.l2.entries)
    slot = agent.agent.replicas[replica_id]
    if slot.process is not None:
        deadline = time.monotonic() + 5
        while alive(slot.process.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(slot.process.pid), "the replica process outlived its failure"


def test_every_transition_is_reported_with_its_duration_then_stop_releases(agent, checkpoint):
    agent.start("r1", checkpoint)
    agent.wait_state("r1", "serving")
    beat = agent.heartbeat()
    assert beat.memory.reservations["r1"] > 0
    (status,) = beat.replicas
    assert status.state == "serving" and status.load_progress == 1.0 and status.load_bytes_total > 0
    agent.stop("r1")
    agent.wait_terminal("r1")
    events = agent.events("r1")
    assert [e.state for e in events] == ["reserving", "loading", "initializing", "warming", "registering",
                                         "serving", "draining", "stopped"]
    assert all(e.seconds_in_previous_state >= 0 for e in events)
    assert events[2].seconds_in_previous_state > 0  # loading took time: L3 -> L2 -> L1
    assert_nothing_held(agent, "r1")


@pytest.mark.parametrize("step", ["reserving", "loading", "initializing", "warming", "registering", "serving",
                                  "draining", "l3_read"])
def test_failure_at_each_step_releases_everything(step, tmp_path, checkpoint, monkeypatch):
    monkeypatch.setenv(ENV, step)
    agent = AgentUnderTest(tmp_path)
    try:
        agent.start("r1", checkpoint)
        if step == "draining":
            agent.wait_state("r1", "serving")
            agent.stop("r1")
        failed = agent.wait_terminal("r1")
        assert failed.state == "failed"
        assert "injected failure" in failed.detail or "exit code" in failed.detail
        states = [e.state for e in agent.events("r1")]
        where = "loading" if step == "l3_read" else step
        assert states[-2] == where, states  # it failed at that step, not before or after
        assert_nothing_held(agent, "r1")
        # freed at once: the same replica id and memory start cleanly on the next try
        monkeypatch.delenv(ENV)
        agent.start("r1", checkpoint)
        agent.wait_state("r1", "serving")
    finally:
        agent.close()
    assert not alive(agent.agent.replicas["r1"].process.pid)


def test_a_reservation_that_cannot_be_met_fails_at_once_with_the_numbers(tmp_path, checkpoint):
    agent = AgentUnderTest(tmp_path, pool_bytes=8 << 20, block_size=1 << 20)
    try:
        agent.start("big", checkpoint, memory_bytes=9 << 20)
        failed = agent.wait_terminal("big", timeout=5)
        assert failed.state == "failed" and "asks 9.0 MiB" in failed.detail and "8.0 MiB" in failed.detail
        assert agent.agent.replicas["big"].process is None  # nothing was started
        agent.start("fits", checkpoint, memory_bytes=8 << 20)
        agent.wait_state("fits", "serving")
    finally:
        agent.close()


def test_a_replica_killed_while_serving_is_reported_and_released(agent, checkpoint):
    agent.start("r1", checkpoint)
    agent.wait_state("r1", "serving")
    agent.agent.replicas["r1"].process.kill()
    failed = agent.wait_terminal("r1")
    assert failed.state == "failed" and "killed by signal 9 while serving" in failed.detail
    assert_nothing_held(agent, "r1")
