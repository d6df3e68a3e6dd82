"""The checkpoint's quota section: the usage ledger's per-group totals, fair-share usage and file positions are
written by the state keeper into the controller's HDF5 checkpoint, and a restarted run restores them from it,
reading only the ledger past the saved positions (the records of the requests that ended after the checkpoint);
without a checkpoint it reads the whole ledger and reaches the same figures. A gateway's fair share is seeded
from them."""

from __future__ import annotations

import time

import pytest

from exaserve_hpc.controller_state import CHECKPOINT_FILE, ControllerState, load_state, save_state
from exaserve_hpc.quota.ledger import UsageLedger, UsageRecord
from exaserve_hpc.quota.shares import GroupShare, SharePolicy
from exaserve_hpc.app.state_keeper import StateKeeper

HOUR = 3600.0


class Fleet:
    """The controller as the keeper sees it: a status and the state it was restored from (unit test stand-in)."""

    def __init__(self, restored=None):
        self.restored = restored

    def status(self) -> dict:
        return {"replicas": [{"replica_id": "r0", "model": "m", "node": "n1"}]}


def record(t: float, group: str, prompt: int, completion: int) -> UsageRecord:
    return UsageRecord(t=t, request_id=f"req-{t}", group=group, account=f"{group}-acct", model="m",
                       prompt_tokens=prompt, completion_tokens=completion, gpu_seconds=0.1)


def test_the_checkpoint_carries_the_ledgers_quota_figures_and_a_restart_restores_them(tmp_path):
    now = time.time()
    ledger_dir = tmp_path / "usage"
    first = UsageLedger(ledger_dir, half_life=HOUR)
    first.restore(None)  # a first run: an empty ledger
    first.record(record(now - HOUR, "climate", 600, 400))
    first.record(record(now - 1, "bio", 70, 30))
    first.record(record(now - 1, "none", 5, 5))  # a caller without a group
    keeper = StateKeeper(Fleet(), tmp_path / CHECKPOINT_FILE, "77", 0)
    keeper.quota = first.quota_state
    assert keeper.save()
    saved = load_state(tmp_path / CHECKPOINT_FILE)
    assert saved.quota == {"climate": (1000, 1), "bio": (100, 1), "none": (10, 1)}
    assert saved.quota_usage["climate"] == pytest.approx(500, rel=1e-3)  # one half-life ago
    assert saved.quota_usage["bio"] == pytest.approx(100, rel=1e-3)
    assert saved.quota_usage_at == pytest.approx(now, abs=5)
    first.flush()
    assert saved.ledger_offsets == {first.path.name: first.path.stat().st_size}

    first.record(record(now, "bio", 8, 2))  # ends after the checkpoint: only in the ledger
    first.close()

    second = UsageLedger(ledger_dir, half_life=HOUR)
    assert second.restore(saved) == 1  # from the checkpoint, and the one record past its position
    restored = second.quota_state()
    assert restored.totals == {"climate": (1000, 1), "bio": (110, 2), "none": (10, 1)}
    assert restored.usage["bio"] == pytest.approx(110, rel=1e-3)
    assert restored.usage["climate"] == pytest.approx(500, rel=1e-3)
    assert restored.offsets[first.path.name] == first.path.stat().st_size

    # no checkpoint: the whole ledger, the same figures
    third = UsageLedger(ledger_dir, half_life=HOUR)
    assert third.restore(None) == 4
    assert third.quota_state().totals == restored.totals
    assert third.quota_state().usage == pytest.approx(restored.usage, rel=1e-3)

    # the next checkpoint of the restarted run carries them on (the keeper reads the ledger, not the old state)
    keeper = StateKeeper(Fleet(restored=saved), tmp_path / "next.h5", "77", 1)
    keeper.quota = second.quota_state
    assert keeper.save()
    assert load_state(tmp_path / "next.h5").quota == restored.totals

    # a gateway's fair share starts from the ledger's usage ("none" is the policy's "")
    policy = SharePolicy({"climate": GroupShare(0.5), "bio": GroupShare(0.5)}, half_life=HOUR)
    second.seed(policy, now=10.0)
    assert policy.usage.value("climate", 10.0) == pytest.approx(500, rel=1e-3)
    assert policy.usage.value("", 10.0) == pytest.approx(10, rel=1e-3)
    assert policy.fair_factor("bio", 10.0) > policy.fair_factor("climate", 10.0)  # used less lately
    second.close()
    third.close()


def test_a_ledger_file_the_checkpoint_does_not_list_adds_its_older_records_without_decaying_the_rest(tmp_path):
    # router rank 1's gateway writes a file of its own; rank 0's checkpoint lists only rank 0's file
    now = time.time()
    rank0, rank1 = UsageLedger(tmp_path, half_life=HOUR), UsageLedger(tmp_path, half_life=HOUR)
    rank0.record(record(now - 1, "bio", 600, 400))
    rank1.record(record(now - HOUR, "bio", 60, 40))  # older than the checkpoint's usage
    rank0.flush()
    rank1.close()
    state = rank0.quota_state()
    saved = ControllerState("77", 0, state.at, quota=state.totals, quota_usage=state.usage,
                            quota_usage_at=state.at, ledger_offsets={rank0.path.name: state.offsets[rank0.path.name]})
    rank0.close()
    restarted = UsageLedger(tmp_path, half_life=HOUR)
    assert restarted.restore(saved) == 1  # rank 1's whole file
    restored = restarted.quota_state()
    assert restored.totals == {"bio": (1100, 2)}
    assert restored.usage["bio"] == pytest.approx(1000 + 100 / 2, rel=1e-3)  # not (1000 + 100) / 2
    assert restored.offsets[rank1.path.name] == rank1.path.stat().st_size
    restarted.close()


def test_a_line_still_being_written_is_read_again_next_time(tmp_path):
    ledger = UsageLedger(tmp_path, half_life=HOUR)
    ledger.record(record(time.time(), "bio", 1, 1))
    ledger.close()
    with open(ledger.path, "ab") as file:
        file.write(b'{"t": 1, "request_id"')  # torn (or not yet whole)
    restarted = UsageLedger(tmp_path, half_life=HOUR)
    assert restarted.restore(None) == 1
    whole = ledger.path.stat().st_size - len(b'{"t": 1, "request_id"')
    assert restarted.quota_state().offsets[ledger.path.name] == whole
    restarted.close()


def test_a_checkpoint_without_the_quota_datasets_reads_back_empty(tmp_path):
    import h5py
    path = save_state(tmp_path / CHECKPOINT_FILE, ControllerState("1", 0, 1.0, quota={"a": (3, 1)}))
    with h5py.File(path, "a") as f:  # as a file written before the usage and ledger datasets existed
        for name in ("usage_group", "usage", "ledger_file", "ledger_offset"):
            del f["quota"][name]
    state = load_state(path)
    assert state.quota == {"a": (3, 1)} and state.quota_usage == {} and state.ledger_offsets == {}
