"""The node memory pool: fixed-size blocks, reserve/release by replica, failures with the numbers."""

import pytest
from hypothesis import given, settings, strategies as st

from exaserve_hpc.agent.memory_pool import MemoryPool, ReservationError

MiB = 1 << 20


def test_reserve_rounds_up_to_blocks_and_release_frees_them():
    pool = MemoryPool([100 * MiB], block_size=10 * MiB)
    r = pool.reserve("a", 25 * MiB)
    assert r.blocks_per_device == 3 and r.nbytes == 30 * MiB
    assert pool.free_bytes() == 70 * MiB
    assert pool.release("a") == 30 * MiB
    assert pool.free_bytes() == 100 * MiB
    assert pool.release("a") == 0  # idempotent


def test_failure_is_immediate_and_carries_asked_free_largest():
    pool = MemoryPool([100 * MiB, 100 * MiB], block_size=10 * MiB)
    pool.reserve("a", 60 * MiB)
    pool.reserve("b", 30 * MiB)
    with pytest.raises(ReservationError) as info:
        pool.reserve("c", 80 * MiB)
    err = info.value
    assert (err.asked, err.free, err.largest) == (80 * MiB, 110 * MiB, 70 * MiB)
    assert "80.0 MiB" in str(err) and "110.0 MiB" in str(err) and "70.0 MiB" in str(err)
    assert "c" not in pool.reservations and pool.free_bytes() == 110 * MiB  # nothing taken


def test_freed_memory_is_reusable_at_once():
    pool = MemoryPool([100 * MiB], block_size=10 * MiB)
    pool.reserve("a", 100 * MiB)
    assert not pool.can_reserve(10 * MiB)
    pool.release("a")
    assert pool.reserve("b", 100 * MiB).nbytes == 100 * MiB


def test_multi_device_reservation_uses_the_freest_devices():
    pool = MemoryPool([100 * MiB] * 4, block_size=10 * MiB)
    pool.reserve("a", 50 * MiB)  # device 0
    r = pool.reserve("tp2", 80 * MiB, devices=2)
    assert r.devices == (1, 2) and r.nbytes == 160 * MiB
    assert pool.largest_reservable(2) == 50 * MiB  # devices 3 (100) and 0 (50)
    with pytest.raises(ReservationError, match="asks for 5 device"):
        pool.reserve("too-wide", MiB, devices=5)


def test_a_replica_cannot_hold_two_reservations():
    pool = MemoryPool([100 * MiB], block_size=MiB)
    pool.reserve("a", MiB)
    with pytest.raises(ReservationError, match="already holds"):
        pool.reserve("a", MiB)


def test_status_reports_per_device_bytes():
    pool = MemoryPool([64 * MiB, 32 * MiB], block_size=16 * MiB)
    pool.reserve("a", 20 * MiB)
    s = pool.status()
    assert s.total == [64 * MiB, 32 * MiB] and s.free == [32 * MiB, 32 * MiB] and s.reservations == {"a": 32 * MiB}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 7), st.integers(0, 40 * MiB)), max_size=60))
def test_accounting_never_leaks(ops):
    pool = MemoryPool([64 * MiB, 48 * MiB], block_size=4 * MiB)
    for reserve, who, size in ops:
        rid = f"r{who}"
        if reserve and rid not in pool.reservations:
            fits = pool.can_reserve(size)
            try:
                pool.reserve(rid, size)
                assert fits
            except ReservationError as e:
                assert not fits and e.largest < size
        else:
            pool.release(rid)
    for rid in list(pool.reservations):
        pool.release(rid)
    assert pool.free_blocks == pool.total_blocks


def test_planned_devices_are_reserved_exactly_and_fractional_replicas_share_one():
    pool = MemoryPool([100 * MiB] * 4, block_size=10 * MiB, device_ids=["GPU-a", "GPU-b", "GPU-c", "GPU-d"])
    assert pool.reserve("a", 40 * MiB, 2, [3, 1]).devices == (3, 1)  # the controller's order is kept
    assert pool.reserve("b", 30 * MiB, 1, [3]).devices == (3,)  # shares device 3 with a: both fit
    assert pool.free_blocks == [10, 6, 10, 3]
    status = pool.status()
    assert status.devices == {"a": [3, 1], "b": [3]} and status.device_ids == ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]


def test_planned_devices_not_granted_or_not_free_are_refused_and_nothing_is_taken():
    pool = MemoryPool([100 * MiB] * 2, block_size=10 * MiB)
    pool.reserve("a", 80 * MiB, 1, [0])
    with pytest.raises(ReservationError, match=r"device\(s\) \[4\], which this node was not granted"):
        pool.reserve("b", 10 * MiB, 1, [4])
    with pytest.raises(ReservationError, match="device 0 20.0 MiB"):
        pool.reserve("b", 30 * MiB, 2, [1, 0])  # device 1 has room, device 0 does not
    with pytest.raises(ReservationError, match="gpu_indices"):
        pool.reserve("b", 10 * MiB, 2, [1])
    with pytest.raises(ReservationError, match="gpu_indices"):
        pool.reserve("b", 10 * MiB, 2, [1, 1])
    assert pool.free_blocks == [2, 10] and set(pool.reservations) == {"a"}


def test_device_ids_must_name_every_device():
    with pytest.raises(ValueError, match="device_ids"):
        MemoryPool([MiB, MiB], block_size=MiB, device_ids=["GPU-a"])
