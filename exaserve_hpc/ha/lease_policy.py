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

from exaserve_hpc.config.lease_bounds import default_renew_interval, lease_problems, margin_for

class LeaderAction(enum.Enum):
    ACT = "act"              # the lease is good and no renewal is due yet
    RENEW = "renew"          # keep acting, and renew now
    STEP_DOWN = "step_down"  # stop acting: the lease may be gone before a renewal could land


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
