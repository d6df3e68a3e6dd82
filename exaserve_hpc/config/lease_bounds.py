"""The bounds of `ha.lease_ttl` and `ha.renew_interval`, checked when a site file loads (config/schema.py)
and used by the leader's lease policy (ha/lease_policy.py): a leader stops acting `margin_for(ttl)` before
its lease can expire, and two renewals must fit in what is left."""

from __future__ import annotations

from typing import Optional

MIN_TTL = 2.0     # etcd 3.4 refuses leases shorter than about 1.5 x its election timeout (1 s by default)
MAX_TTL = 300.0   # longer and a lost leader leaves the fleet without decisions for minutes
MARGIN_SHARE = 0.25  # of the TTL, kept between stepping down and the lease's earliest expiry
MIN_MARGIN = 0.5


def margin_for(ttl: float) -> float:
    return max(MIN_MARGIN, MARGIN_SHARE * ttl)


def default_renew_interval(ttl: float) -> float:
    return ttl / 5


def lease_problems(ttl: float, renew_interval: Optional[float]) -> list[str]:
    """What is wrong with these settings, each message naming the setting and what is allowed ([] if fine)."""
    problems = []
    if not MIN_TTL <= ttl <= MAX_TTL:
        problems.append(f"ha.lease_ttl is {ttl:g}s; allowed: {MIN_TTL:g}s to {MAX_TTL:g}s")
        return problems
    usable = ttl - margin_for(ttl)
    if renew_interval is not None:
        # two renewals must fit before the step-down, so one lost request does not depose a healthy leader
        if not 0 < renew_interval <= usable / 2:
            problems.append(f"ha.renew_interval is {renew_interval:g}s; allowed: more than 0 and at most "
                            f"{usable / 2:g}s (half of ha.lease_ttl {ttl:g}s less its {margin_for(ttl):g}s safety "
                            f"margin), or unset for {default_renew_interval(ttl):g}s")
    return problems
