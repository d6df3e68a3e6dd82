"""The simulator's node (sim/fleet.py) around the agent's own core: its weight loader fills L2 once per model
and node, so a second replica of a model there starts without waiting for the shared store."""

from __future__ import annotations

from types import SimpleNamespace

from exaserve_hpc.agent.weight_loader import PREFETCH
from exaserve_hpc.sim.fleet import L3_BYTES_PER_S, WARM_START_S, SimLoader


class Agent:
    def __init__(self):
        self.alive, self.pumped, self.events = True, [], []
        self.sim = SimpleNamespace(now=100.0, warm_until=1.0, later=lambda t, fn, *a: self.events.append((t, fn, a)),
                                   catalogue={"m": SimpleNamespace(weight_bytes=16 * 10**9)})

    def pump(self, now):
        self.pumped.append(now)


def test_a_model_is_filled_once_per_node_and_then_served_from_l2():
    agent = Agent()
    loader = SimLoader(agent)
    first = loader.request("m", "/store/m", "m/r0", 100.0)
    second = loader.request("m", "/store/m", "m/r1", 101.0)  # arrives while the fill runs: it waits for it
    assert not first.ready and not second.ready and len(agent.events) == 1
    (at, fill, args), = agent.events
    assert at == 100.0 + 16e9 / L3_BYTES_PER_S  # 8 s from the shared store
    fill(at, *args)
    (result,) = loader.poll(at)
    assert result.ok and result.waiters == {"m/r0", "m/r1"} and agent.pumped == [at]
    third = loader.request("m", "/store/m", "m/r2", 200.0)
    assert third.ready and len(agent.events) == 1  # an L2 hit: no second fill


def test_the_initial_placement_loads_in_a_warm_second_and_a_forgotten_waiter_is_not_served():
    agent = Agent()
    agent.sim.now = 0.5
    loader = SimLoader(agent)
    loader.request("m", "/store/m", "m/r0", 0.5)
    loader.request("m", "/store/m", PREFETCH, 0.5)
    loader.forget("m/r0")
    (at, fill, args), = agent.events
    assert at == 0.5 + WARM_START_S
    fill(at, *args)
    (result,) = loader.poll(at)
    assert result.waiters == {PREFETCH}
