"""The HA metrics against a real 3-member etcd, read from the registry the gateway's /metrics serves
(render_metrics): the leader shows 1 and its election counted, a standby 0, a deposed leader's refused
write is counted and leadership moves, and an etcd no member of which answers is counted as unavailable."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exaserve_hpc.observability.collector import render_metrics
from exaserve_hpc.ha.election import Deposed, Election
from exaserve_hpc.ha.etcd_client import EtcdClient, EtcdUnavailable
from exaserve_hpc.ha.lease_policy import LeaseTiming

from tests.ha.conftest import client_for, free_ports
from tests.waiting import wait_for

TTL = 2.0


def scrape() -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, parsed from what /metrics serves."""
    body, _ = render_metrics()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


def sample(name: str, election: Election) -> float:
    return scrape().get((name, (("candidate", election.candidate), ("node", election.info["node"]))), -1.0)


def test_leader_shows_1_standby_0_then_a_fenced_write_moves_the_lead(etcd_cluster):
    etcd = client_for(etcd_cluster)
    timing = LeaseTiming.from_settings(TTL)
    tag = f"m{time.monotonic_ns()}"  # the registry is the process's: these series are this test's alone
    a, b = (Election(etcd, f"/t/{tag}", f"{name}-{tag}", timing, info={"node": f"n-{name}"}) for name in "ab")
    a.export_metrics()  # a campaigns from the test (no thread of its own, so no renewal races the fenced write)
    assert a.campaign_once()
    b.start()
    try:
        wait_for(lambda: sample("exaserve_ha_leader", b) == 0.0, 5, "b's leader series at 0")
        assert sample("exaserve_ha_leader", a) == 1.0
        assert sample("exaserve_ha_elections_total", a) == 1.0
        assert sample("exaserve_ha_elections_total", b) == 0.0
        left = sample("exaserve_ha_lease_seconds_left", a)
        assert 0 < left <= TTL - timing.margin
        assert sample("exaserve_ha_lease_seconds_left", b) == 0.0
        assert sample("exaserve_ha_fenced_writes_refused_total", a) == 0.0

        # a's election key vanishes behind its back (as when its lease expired in etcd): its next write is
        # refused by etcd itself, counted, and b wins the next campaign
        assert etcd.delete_if_created_at(a.key, a.revision)
        with pytest.raises(Deposed):
            a.fenced_put({f"/t/{tag}/fleet/state": "from a"})
        assert sample("exaserve_ha_fenced_writes_refused_total", a) == 1.0
        assert sample("exaserve_ha_leader", a) == 0.0
        wait_for(lambda: sample("exaserve_ha_leader", b) == 1.0, 3 * TTL, "b leading, on /metrics")
        assert sample("exaserve_ha_elections_total", b) == 1.0
        assert sample("exaserve_ha_leader", a) == 0.0
    finally:
        b.stop()
        a.stop()
    # a stopped candidate's gauges are gone; its counters stay
    assert sample("exaserve_ha_leader", a) == -1.0 and sample("exaserve_ha_lease_seconds_left", b) == -1.0
    assert sample("exaserve_ha_elections_total", b) == 1.0


def test_etcd_that_does_not_answer_is_counted_as_unavailable(etcd_cluster):
    key = ("exaserve_ha_etcd_errors_total", (("kind", "unavailable"),))
    dead = EtcdClient([f"http://127.0.0.1:{free_ports(1)[0]}"], timeout=0.5)
    before = scrape()[key]
    with pytest.raises(EtcdUnavailable):
        dead.get("/t/anything")
    assert scrape()[key] == before + 1
    client_for(etcd_cluster).get("/t/anything")  # a call that succeeds counts nothing
    assert scrape()[key] == before + 1
