"""Gateway k of `exaserve launch` (router ranks 1 .. N-1, app/router_rank.py) starts its fair share from
the earlier runs' usage, as rank 0's plane does: the job's checkpoint and the ledger files past it, or every
ledger file without one. No sockets: the router client connects lazily and is never used here."""

from __future__ import annotations

import time

import pytest

from exaserve_hpc.jobdir import JobDir
from exaserve_hpc.batch.base import RankInfo
from exaserve_hpc.config.schema import parse_site
from exaserve_hpc.controller_state import CHECKPOINT_FILE
from exaserve_hpc.app.router_rank import gateway_app
from exaserve_hpc.quota.ledger import UsageLedger, UsageRecord, ledger_dir
from exaserve_hpc.app.state_keeper import StateKeeper

HOUR = 3600.0


class Router:
    frontend_endpoint = "tcp://127.0.0.1:1"

    def snapshot(self) -> dict:
        return {"replicas": []}


class Fleet:
    restored = None

    def status(self) -> dict:
        return {"replicas": []}


def share_site():
    return parse_site({
        "site": "shares", "router": {"count": 2}, "gateway": {"fair_share_half_life": HOUR},
        "models": [{"model_name": "m", "replicas": 1, "max_seq_len": 256}],
        "quota_groups": [{"name": "climate", "guaranteed_share": 0.5}, {"name": "bio", "guaranteed_share": 0.5}]})


def earlier_run(site, jobdir: JobDir, checkpoint: bool) -> None:
    ledger = UsageLedger(ledger_dir(site, jobdir.path.parent), half_life=HOUR)
    ledger.restore(None)
    ledger.record(UsageRecord(t=time.time() - 1, request_id="a", group="climate", account="", model="m",
                              prompt_tokens=600, completion_tokens=400, gpu_seconds=0.1))
    if checkpoint:  # rank 0's plane wrote the quota section, then one more request came after it
        keeper = StateKeeper(Fleet(), jobdir.path / CHECKPOINT_FILE, "77", 0)
        keeper.quota = ledger.quota_state
        ledger.flush()
        assert keeper.save()
    ledger.record(UsageRecord(t=time.time() - 1, request_id="b", group="bio", account="", model="m",
                              prompt_tokens=50, completion_tokens=50, gpu_seconds=0.1))
    ledger.close()


@pytest.mark.parametrize("checkpoint", [False, True], ids=["ledger-files", "checkpoint-and-tail"])
def test_gateway_k_seeds_fair_share_from_the_earlier_runs_usage(tmp_path, checkpoint):
    site = share_site()
    jobdir = JobDir(tmp_path / "jobs" / "77").ensure()
    earlier_run(site, jobdir, checkpoint)
    rank = RankInfo(rank=1, size=2, node="n1", job_id="77", restart=1, source="local")
    _, ledger, admission = gateway_app(site, Router(), jobdir, None, rank, lambda: None)
    try:
        assert ledger.totals == {"climate": [1000, 1], "bio": [100, 1]}
        now = admission.clock()
        assert admission.shares.usage.value("climate", now) == pytest.approx(1000, rel=1e-2)
        assert admission.shares.usage.value("bio", now) == pytest.approx(100, rel=1e-2)
        assert admission.shares.fair_factor("bio", now) > admission.shares.fair_factor("climate", now)
    finally:
        ledger.close()
