"""Guaranteed shares, borrowing and fair share of each model's capacity among quota groups. Pure: callers pass
in-flight counts, capacity and the time.

Capacity is a model's request slots (replicas x batch slots). A group's guarantee is
``guaranteed_share`` of them, its ceiling ``burst_share``. Admission of one more request of group g:

- under its guarantee: always admitted, whatever others are doing (others' bursts never refuse it; the
  model may run over its slots for a while, the replicas queue it);
- at or over its ceiling: refused (reason ``burst_ceiling``);
- otherwise it would borrow: admitted only while the model has a free slot, so idle guaranteed capacity is
  lent, and as soon as an owner's requests come back the model is full and new borrowing stops
  (``borrowing_preempted``: 429 with Retry-After); accepted requests are never cut;
- and among groups borrowing at once, each may hold at most its fair part of the spare slots (those not
  used by guaranteed work): parts are weighted by Slurm's fair-share factor 2^(-usage/share), usage being
  the group's tokens decayed with a half-life over all groups' (``fair_share``).

Several gateways on different ranks (``exaserve launch`` with ``router.count`` N) cannot see each other's
requests in flight without a round trip per request, so each holds a part of every limit (``split_limit``):
gateway k of N takes limit // N, plus one while k < limit % N, so the parts add up to the limit exactly. The
model's slots, each group's guaranteed slots and its ceiling are split so (``decide``'s ``part``); guaranteed
slots are dealt out as one sequence over the groups, so the guarantees a gateway holds never exceed the slots
it holds. A part may be 0 when a limit is below N: that gateway refuses what the limit covers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

ADMIT = ""
WHOLE = (0, 1)  # (gateway, gateways): one gateway holds every limit whole


def split_limit(limit: int, gateway: int, gateways: int, offset: int = 0) -> int:
    """Gateway ``gateway``'s part of an integer limit dealt over ``gateways`` gateways: the units
    offset .. offset+limit-1 go round-robin, unit j to gateway j % gateways. With offset 0 that is
    limit // gateways plus one while gateway < limit % gateways; the parts always add up to the limit."""
    if not 0 <= gateway < gateways:
        raise ValueError(f"gateway {gateway} is not one of {gateways} gateways")

    def dealt(units: int) -> int:  # units 0 .. units-1 that fall to this gateway
        return (units - gateway + gateways - 1) // gateways

    return dealt(offset + limit) - dealt(offset)


@dataclass(frozen=True)
class GroupShare:
    guaranteed: float = 0.0  # share of each model's slots always available to the group
    burst: float = 1.0       # share it may hold at most, borrowing included


class DecayedUsage:
    """Per-group usage decaying with a half-life, as Slurm's fair-share usage does."""

    def __init__(self, half_life: float):
        self.half_life = half_life
        self._value: dict[str, tuple[float, float]] = {}  # group -> (usage, at)

    def _decay(self, seconds: float) -> float:
        return 0.5 ** (max(0.0, seconds) / self.half_life) if self.half_life > 0 else 1.0

    def value(self, group: str, now: float) -> float:
        usage, at = self._value.get(group, (0.0, now))
        return usage * self._decay(now - at)

    def add(self, group: str, amount: float, now: float) -> None:
        usage, at = self._value.get(group, (0.0, now))
        if now < at:
            # Older than what the group holds (a file of another rank read after the checkpoint's figures): decay
            # the amount up to the group's time and keep that time; moving it back would decay the usage twice.
            self._value[group] = (usage + amount * self._decay(at - now), at)
        else:
            self._value[group] = (usage * self._decay(now - at) + amount, now)

    def groups(self) -> list[str]:
        return list(self._value)


class SharePolicy:
    def __init__(self, shares: dict[str, GroupShare], half_life: float):
        self.shares = shares
        self.usage = DecayedUsage(half_life)

    def guaranteed_slots(self, group: str, capacity: int, part: tuple[int, int] = WHOLE) -> int:
        """The group's guaranteed slots of a model (at this gateway's part): floor(share x capacity) of the whole,
        dealt after the groups before it in the site's order, so no gateway holds more guarantees than slots."""
        offset = 0
        for name, share in self.shares.items():
            slots = math.floor(share.guaranteed * capacity + 1e-9)
            if name == group:
                return split_limit(slots, *part, offset=offset)
            offset += slots
        return 0

    def slots(self, capacity: int, part: tuple[int, int] = WHOLE) -> int:
        """The model's slots this gateway holds."""
        return split_limit(max(1, capacity), *part)

    def ceiling(self, group: Optional[str], capacity: int, part: tuple[int, int] = WHOLE) -> int:
        """The most requests of the model the group may hold at this gateway (burst_share of the slots, at least 1
        in all)."""
        share = self.shares.get(group or "", GroupShare())
        return split_limit(max(1, math.ceil(share.burst * max(1, capacity) - 1e-9)), *part)

    def fair_factor(self, group: str, now: float) -> float:
        """Slurm's classic factor 2^(-U/S): U the group's share of all decayed usage, S its normalised share."""
        total = sum(self.usage.value(g, now) for g in self.shares) or 1.0
        weights = {g: max(s.guaranteed, 0.01) for g, s in self.shares.items()}  # a group of no guarantee still counts
        share = weights.get(group, 0.01) / (sum(weights.values()) or 1.0)
        return 2.0 ** (-(self.usage.value(group, now) / total) / share)

    def decide(self, group: Optional[str], inflight: dict[str, int], capacity: int, now: float,
               part: tuple[int, int] = WHOLE) -> str:
        """ADMIT, or why not: 'burst_ceiling', 'borrowing_preempted', 'fair_share'.

        ``inflight``: requests in flight of this model per group (this one's not yet counted) at this gateway;
        ``part``: (this gateway, gateways) when the limits are split over several (module docstring).
        """
        mine = inflight.get(group or "", 0)
        capacity = max(1, capacity)
        if mine < self.guaranteed_slots(group or "", capacity, part):
            return ADMIT
        if mine >= self.ceiling(group, capacity, part):
            return "burst_ceiling"
        slots = self.slots(capacity, part)
        if sum(inflight.values()) >= slots:
            return "borrowing_preempted"
        guarantee = {g: self.guaranteed_slots(g, capacity, part) for g in inflight}
        borrowing = {g: n - guarantee[g] for g, n in inflight.items() if n > guarantee[g]}
        borrowing.setdefault(group or "", 0)
        if len(borrowing) == 1:
            return ADMIT
        spare = slots - sum(min(n, guarantee[g]) for g, n in inflight.items())
        factors = {g: self.fair_factor(g, now) for g in borrowing}
        fair = spare * factors[group or ""] / sum(factors.values())
        return ADMIT if borrowing[group or ""] < max(1.0, fair) else "fair_share"
