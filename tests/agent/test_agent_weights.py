"""Weights through the agent: one L3 read for N replicas, checksums refused and reported, timeouts retried."""

import pytest

from agent_harness import TINY, AgentUnderTest
from exaserve_hpc.agent.faults import ENV
from exaserve_hpc.cache.checkpoint import create_tiny_checkpoint
from exaserve_hpc.cache.l3_store import manifest_bytes
from exaserve_hpc.protocol import LoadFailed, Prefetch

pytestmark = pytest.mark.process


@pytest.fixture
def checkpoint(tmp_path):
    return create_tiny_checkpoint(tmp_path / "l3" / "tiny", TINY)


def test_n_replicas_of_one_model_read_l3_once(tmp_path, checkpoint):
    agent = AgentUnderTest(tmp_path)
    try:
        for i in range(3):  # arrive together: all wait on the one fill
            agent.start(f"r{i}", checkpoint)
        for i in range(3):
            agent.wait_state(f"r{i}", "serving")
        agent.start("late", checkpoint)  # arrives after the fill: an L2 hit
        agent.wait_state("late", "serving")
        beat = agent.heartbeat()
        assert beat.l2.l3_bytes_read == manifest_bytes(checkpoint)  # once, not 4 times
        assert beat.l2.fills == 1 and beat.l2.hits == 1
        (entry,) = beat.l2.entries
        assert entry.pins == 4 and entry.state == "ready"
        sources = {s.replica_id: s.load_source for s in beat.replicas}
        assert sources == {"r0": "l3", "r1": "l3", "r2": "l3", "late": "l2"}
    finally:
        agent.close()


def test_a_checksum_mismatch_is_refused_and_reported(tmp_path, checkpoint):
    shard = checkpoint / "model-00001-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    agent = AgentUnderTest(tmp_path)
    try:
        agent.start("r1", checkpoint)
        failed = agent.wait_terminal("r1")
        assert failed.state == "failed" and failed.detail.startswith("checksum:")
        report = agent.wait_for(lambda m: isinstance(m, LoadFailed))
        assert (report.replica_id, report.reason, report.attempts) == ("r1", "checksum", 1)
        assert "model-00001-of-00002.safetensors is corrupt" in report.detail
        beat = agent.settle(lambda b: not b.memory.reservations)
        assert beat.l2.entries == [] and beat.memory.reservations == {}
        assert agent.agent.replicas["r1"].process is None  # no replica ever saw the bad bytes
        assert not any(p.name.startswith(".fill-") for p in agent.agent.cache.root.iterdir())
    finally:
        agent.close()


def test_a_load_that_times_out_is_retried_three_times_then_reported(tmp_path, checkpoint, monkeypatch):
    monkeypatch.setenv(ENV, "load_timeout")
    agent = AgentUnderTest(tmp_path)
    try:
        agent.start("r1", checkpoint, load_timeout=0.2)
        failed = agent.wait_terminal("r1", timeout=10)
        assert failed.state == "failed" and failed.detail.startswith("load_timeout:")
        report = agent.wait_for(lambda m: isinstance(m, LoadFailed))
        assert (report.reason, report.attempts, report.model) == ("load_timeout", 4, "tiny")
        assert len(agent.load_failures()) == 1
        beat = agent.settle(lambda b: not b.memory.reservations)
        assert beat.memory.reservations == {} and beat.l2.entries == []
    finally:
        agent.close()


def test_a_load_that_times_out_twice_succeeds_on_retry(tmp_path, checkpoint, monkeypatch):
    monkeypatch.setenv(ENV, "load_timeout:2")
    agent = AgentUnderTest(tmp_path)
    try:
        agent.start("r1", checkpoint, load_timeout=0.2)
        agent.wait_state("r1", "serving", timeout=15)
        loading = next(e for e in agent.events("r1") if e.state == "initializing")
        assert loading.seconds_in_previous_state >= 0.4  # two timed-out attempts before the good one
        assert agent.load_failures() == []
    finally:
        agent.close()


def test_load_progress_is_reported_in_heartbeats_while_loading(tmp_path, checkpoint, monkeypatch):
    monkeypatch.setenv(ENV, "load_timeout")
    agent = AgentUnderTest(tmp_path)
    try:
        agent.start("r1", checkpoint, load_timeout=30)
        beat = agent.settle(lambda b: b.replicas and b.replicas[0].state == "loading")
        (status,) = beat.replicas
        assert status.state == "loading" and status.load_bytes_total == manifest_bytes(checkpoint)
        assert status.load_progress == 0.0 and status.load_source == "l3"
        assert beat.l2.entries[0].state == "filling"
    finally:
        agent.close()


def test_prefetch_fills_l2_so_the_next_replica_is_a_hit(tmp_path, checkpoint):
    agent = AgentUnderTest(tmp_path)
    try:
        agent.send(Prefetch(model="tiny", model_dir=str(checkpoint)))
        beat = agent.settle(lambda b: b.l2.entries and b.l2.entries[0].state == "ready")
        assert beat.l2.entries[0].pins == 0 and beat.l2.fills == 1
        agent.start("r1", checkpoint)
        agent.wait_state("r1", "serving")
        beat = agent.heartbeat()
        assert beat.l2.hits == 1 and beat.l2.l3_bytes_read == manifest_bytes(checkpoint)
        assert beat.replicas[0].load_source == "l2"
    finally:
        agent.close()


def test_when_l2_is_too_small_the_replica_reads_l3_itself(tmp_path, checkpoint):
    agent = AgentUnderTest(tmp_path, l2_capacity=1024)
    try:
        agent.start("r1", checkpoint)
        agent.wait_state("r1", "serving")
        beat = agent.heartbeat()
        assert beat.l2.entries == [] and beat.replicas[0].load_source == "l3"
    finally:
        agent.close()
