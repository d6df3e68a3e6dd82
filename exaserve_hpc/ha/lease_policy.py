"""When a leader may act, renew, or must step down: a pure policy over its lease and the last renewal.

    timing = LeaseTiming.from_settings(ttl=10.0, renew_interval=None)   # renew every 2 s, margin 2.5 s
    leader_decision(now, sent_at, granted_ttl, timing)                  # ACT, RENEW or STEP_DOWN

Why it is safe: etcd counts a lease's TTL from when the server *received* the renewal, which is after
the leader *sent* it. The leader counts from the send time, on its own monotonic clock, and stops acting
`margin` seconds before its TTL runs out, so it has stopped before etcd can expire the lease and let a
standby's campaign succeed. The margin absorbs clock-rate drift between the two machines and the time
the step-down itself takes (the controller's gate is read under the fleet lock, at its next decision).
A renewal answered with an expired lease (TTL <= 0) is a step-down at once.

No clock, socket or etcd here: the election loop (election.py) passes the times in.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

MIN_TTL = 2.0     # etcd 3.4 refuses leases shorter than about 1.5 x its election timeout (1 s by default)
MAX_TTL = 300.0   # longer and a lost leader leaves the fleet without decisions for minutes
MARGIN_SHARE = 0.25  # of the TTL, kept between stepping down and the lease's earliest expiry
MIN_MARGIN = 0.5


class LeaderAction(enum.Enum):
    ACT = "act"              # the lease is good and no renewal is due yet
    RENEW = "renew"          # keep acting, and renew now
    STEP_DOWN = "step_down"  # stop acting: the lease may be gone before a renewal could land


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


@dataclass(frozen=True)
class LeaseTiming:
    ttl: float
    renew_interval: float
    margin: float

    @classmethod
    def from_settings(cls, ttl: float, renew_interval: Optional[float] = None) -> "LeaseTiming":
        problems = lease_problems(ttl, renew_interval)
        if problems:
            raise ValueError("; ".join(problems))
        return cls(ttl, renew_interval or default_renew_interval(ttl), margin_for(ttl))


def act_deadline(sent_at: float, granted_ttl: float, timing: LeaseTiming) -> float:
    """The last moment the leader may act, on its own clock, after a renewal sent at `sent_at` was granted
    `granted_ttl` seconds (etcd answers with the TTL it reset the lease to)."""
    return sent_at + min(granted_ttl, timing.ttl) - timing.margin


def leader_decision(now: float, sent_at: float, granted_ttl: float, timing: LeaseTiming) -> LeaderAction:
    """sent_at: when the last *successful* renewal (or the grant) was sent; granted_ttl: its answer."""
    if granted_ttl <= 0 or now >= act_deadline(sent_at, granted_ttl, timing):
        return LeaderAction.STEP_DOWN
    if now - sent_at >= timing.renew_interval:
        return LeaderAction.RENEW
    return LeaderAction.ACT


def seconds_left(now: float, leading: bool, sent_at: float, granted_ttl: float, timing: LeaseTiming) -> float:
    """What exaserve_ha_lease_seconds_left shows: the time until the leader must stop acting (0 on a standby,
    and never negative: a late leader shows 0 until its gate steps it down)."""
    if not leading or granted_ttl <= 0:
        return 0.0
    return max(0.0, act_deadline(sent_at, granted_ttl, timing) - now)
