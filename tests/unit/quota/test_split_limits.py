"""Quota limits over several gateways (router.count): the split each gateway on its own rank holds under
`exaserve launch` (pure), and the one admission the gateways of `exaserve serve` share (the running system:
tests/test_serve_several_routers.py)."""

from __future__ import annotations

import threading
import time

import pytest

from exaserve_hpc.quota.shares import ADMIT, GroupShare, SharePolicy, split_limit
from exaserve_hpc.gateway.admission import Admission, ApiError


@pytest.mark.parametrize("gateways", range(1, 9))
def test_parts_add_up_to_the_limit_and_differ_by_at_most_one(gateways):
    for limit in range(0, 40):
        parts = [split_limit(limit, k, gateways) for k in range(gateways)]
        assert sum(parts) == limit
        assert parts == [limit // gateways + (1 if k < limit % gateways else 0) for k in range(gateways)]
        for offset in range(0, 2 * gateways):  # dealt after other groups' units: still adds up
            dealt = [split_limit(limit, k, gateways, offset) for k in range(gateways)]
            assert sum(dealt) == limit and max(dealt) - min(dealt) <= 1
    with pytest.raises(ValueError, match="gateway 3 is not one of 3"):
        split_limit(5, 3, 3)


def fill(admission: Admission, group: str, model: str = "") -> tuple[int, ApiError]:
    """Admit until refused: how many were admitted, and the refusal."""
    admitted = 0
    while True:
        try:
            admission.admit(group, model)
        except ApiError as refusal:
            return admitted, refusal
        admitted += 1


def test_every_gateway_holds_its_part_of_each_limit_and_the_parts_add_up():
    for gateways in (1, 2, 3, 4):
        parts = [Admission(10, {"bio": 5}, part=(k, gateways)) for k in range(gateways)]
        admitted = [fill(a, "bio")[0] for a in parts]
        assert sum(admitted) == 5 and admitted == [split_limit(5, k, gateways) for k in range(gateways)]
        assert sum(fill(a, "other")[0] for a in parts) == 10 - 5  # gateway.max_queued_requests split likewise
    assert [Admission(1, {}, {"bio": 1001}, part=(k, 2)).budget.limits for k in (0, 1)] == [{"bio": 501},
                                                                                         {"bio": 500}]


def test_a_refusal_names_the_split_and_one_gateway_alone_is_not_split():
    admitted, refusal = fill(Admission(10, {"bio": 5}, part=(1, 2)), "bio")
    assert admitted == 2 and refusal.status == 429 and refusal.code == "quota_exceeded"
    assert "max_concurrent_requests 5 is split over the 2 gateways of router.count 2; this gateway's part is 2" \
        in refusal.message
    assert "split" not in fill(Admission(10, {"bio": 5}), "bio")[1].message


def test_a_gateway_whose_part_is_zero_refuses_saying_the_limit_is_split():
    # max_concurrent_requests 2 over 3 gateways: 1, 1, 0
    gateways = [Admission(10, {"bio": 2}, {"tpm": 2}, part=(k, 3)) for k in range(3)]
    assert [fill(a, "bio")[0] for a in gateways] == [1, 1, 0]
    refusal = fill(gateways[2], "bio")[1]
    assert refusal.status == 429 and refusal.retry_after > 0
    assert ("requests of quota group 'bio' under its max_concurrent_requests 2: the limit is split over the 3 "
            "gateways of router.count 3 and this gateway's part is 0") in refusal.message
    tokens = fill(gateways[2], "tpm")[1]  # tokens_per_minute 2 over 3: this gateway's part is 0 too
    assert tokens.status == 429 and "tokens_per_minute 2: the limit is split over the 3 gateways" in tokens.message
    gateways[1].admit("tpm")  # a gateway with a part of it admits (nothing used yet)
    overloaded = fill(Admission(2, {}, part=(2, 3)), "bio")[1]  # gateway.max_queued_requests 2 over 3
    assert overloaded.code == "overloaded" and "gateway.max_queued_requests 2: the limit is split" in overloaded.message


def test_shares_split_so_each_gateway_holds_its_part_of_the_slots_and_the_guarantees():
    shares = {"owner": GroupShare(0.5, 0.5), "small": GroupShare(0.25, 1.0), "burst": GroupShare(0.0, 0.75)}
    policy, capacity = SharePolicy(shares, half_life=60), 10  # guarantees 5 and 2 slots, ceilings 5, 10, 8
    for gateways in (1, 2, 3, 4, 11):
        parts = [(k, gateways) for k in range(gateways)]
        assert sum(policy.slots(capacity, p) for p in parts) == capacity
        for group, whole in (("owner", 5), ("small", 2), ("burst", 0)):
            assert sum(policy.guaranteed_slots(group, capacity, p) for p in parts) == whole
        for group, whole in (("owner", 5), ("small", 10), ("burst", 8)):
            assert sum(policy.ceiling(group, capacity, p) for p in parts) == whole
        for p in parts:  # guarantees dealt one after another: a gateway never owes more than it holds
            assert sum(policy.guaranteed_slots(g, capacity, p) for g in shares) <= policy.slots(capacity, p)
        # the owner fills its guarantee across the gateways while burst holds every slot: all admitted
        admitted = 0
        for p in parts:
            mine = 0
            while policy.decide("owner", {"burst": 10, "owner": mine}, capacity, 0, p) == ADMIT:
                mine += 1
            admitted += mine
        assert admitted == 5


def test_one_admission_shared_by_several_threads_never_goes_past_a_limit():
    def yielding_clock() -> float:
        # read between the group's check and its count (the token budget's wait): sleeping here lets the other
        # threads run their check too, so without the lock nearly all 16 would get in, not 3
        time.sleep(0.005)
        return time.monotonic()

    admission = Admission(100, {"bio": 3}, clock=yielding_clock)
    start, tickets, refused = threading.Barrier(16), [], []

    def one() -> None:
        start.wait()
        try:
            tickets.append(admission.admit("bio", "m"))
        except ApiError as refusal:
            refused.append(refusal)

    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(tickets) == 3 and len(refused) == 13 and admission.by_group["bio"] == 3
    for ticket in tickets:
        threading.Thread(target=ticket.release).start()
    for ticket in tickets:
        ticket.release()  # idempotent, also against a release on another thread
    assert admission.inflight == 0 and admission.by_group["bio"] == 0 and admission.by_model["m"] == {"bio": 0}


def test_each_gateway_of_a_launch_takes_its_part_and_serve_shares_the_whole():
    from exaserve_hpc.config.schema import parse_site
    from exaserve_hpc.app.several_routers import gateway_admission
    site = parse_site({"site": "s", "router": {"count": 3}, "gateway": {"max_queued_requests": 10},
                       "models": [{"model_name": "m"}],
                       "quota_groups": [{"name": "lab", "max_concurrent_requests": 2, "tokens_per_minute": 1000}]})
    launch = [gateway_admission(site, None, True, rank) for rank in range(3)]  # router rank k's gateway
    assert [a.group_limits["lab"] for a in launch] == [1, 1, 0]
    assert [a.max_inflight for a in launch] == [4, 3, 3]
    assert [a.budget.limits["lab"] for a in launch] == [334, 333, 333]
    serve = gateway_admission(site, None, False)  # every gateway of the process admits through this one
    assert (serve.group_limits, serve.max_inflight, serve.part) == ({"lab": 2}, 10, (0, 1))
