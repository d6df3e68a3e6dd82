"""The fleet state through a real etcd: the leader writes it on change, a new leader reads the same state,
a deposed leader's writer stops."""

from __future__ import annotations

import json
from dataclasses import fields

from exaserve_hpc.controller_state import ControllerState, RolloutState
from exaserve_hpc.ha.election import Election
from exaserve_hpc.ha.fleet_store import FleetStateWriter, decode_state, encode_state, read_state
from exaserve_hpc.ha.lease_policy import LeaseTiming
from tests.ha.conftest import client_for


def sample(saved_at: float = 1.0, node: str = "n2") -> ControllerState:
    return ControllerState(job_id="77", restart=1, saved_at=saved_at,
                           placement={"m-0": ("m", "n1"), "m-1": ("m", node), "m-2": ("m", "")},
                           affinity={2**63 + 5: ["m-0", "m-1"]}, quota={"physics": (1200, 7)},
                           quota_usage={"physics": 812.5}, quota_usage_at=1.7e9,
                           ledger_offsets={"usage-77.jsonl": 4096},
                           rollout={"m": RolloutState("v2", "canary", 0.05)}, excluded_nodes=["n4"])


def test_encode_round_trip():
    assert decode_state(encode_state(sample())) == sample()
    # every field of the checkpoint travels (a field added there and not here fails this)
    assert {f.name for f in fields(ControllerState)} <= set(json.loads(encode_state(sample())))


def test_leader_writes_new_leader_restores(etcd_cluster):
    etcd = client_for(etcd_cluster)
    timing = LeaseTiming.from_settings(2.0)
    prefix = "/t/state"
    a, b = Election(etcd, prefix, "a", timing), Election(etcd, prefix, "b", timing)
    assert a.campaign_once()
    current = {"state": sample()}
    writer = FleetStateWriter(a, prefix, lambda: current["state"], refresh=3600)
    assert writer.write_if_changed() is True
    assert writer.write_if_changed() is False  # unchanged: no write
    current["state"] = sample(saved_at=2.0, node="n3")
    assert writer.write_if_changed() is True and writer.writes == 2
    a.resign()
    assert b.campaign_once()
    restored = read_state(etcd, prefix)
    assert restored == sample(saved_at=2.0, node="n3")
    # the old leader's writer cannot overwrite what the new leader reads
    current["state"] = sample(saved_at=3.0, node="n9")
    writer.start()
    writer._thread.join(5)
    assert not writer._thread.is_alive()
    assert read_state(etcd, prefix).placement["m-1"] == ("m", "n3")
