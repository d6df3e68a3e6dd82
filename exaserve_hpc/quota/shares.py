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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

ADMIT = ""


@dataclass(frozen=True)
class GroupShare:
    guaranteed: float = 0.0  # share of each model's slots always available to the group
    burst: float = 1.0       # share it may hold at most, borrowing included


class DecayedUsage:
    """Per-group usage decaying with a half-life, as Slurm's fair-share usage does."""

    def __init__(self, half_life: float):
        self.half_life = half_life
        self._value: dict[str, tuple[float, float]] = {}  # group -> (usage, at)

    def value(self, group: str, now: float) -> float:
        usage, at = self._value.get(group, (0.0, now))
        return usage * 0.5 ** (max(0.0, now - at) / self.half_life) if self.half_life > 0 else usage

    def add(self, group: str, amount: float, now: float) -> None:
        self._value[group] = (self.value(group, now) + amount, now)

    def groups(self) -> list[str]:
        return list(self._value)


class SharePolicy:
    def __init__(self, shares: dict[str, GroupShare], half_life: float):
        self.shares = shares
        self.usage = DecayedUsage(half_life)

    def fair_factor(self, group: str, now: float) -> float:
        """Slurm's classic factor 2^(-U/S): U the group's share of all decayed usage, S its normalised share."""
        total = sum(self.usage.value(g, now) for g in self.shares) or 1.0
        weights = {g: max(s.guaranteed, 0.01) for g, s in self.shares.items()}  # a group of no guarantee still counts
        share = weights.get(group, 0.01) / (sum(weights.values()) or 1.0)
        return 2.0 ** (-(self.usage.value(group, now) / total) / share)

    def decide(self, group: Optional[str], inflight: dict[str, int], capacity: int, now: float) -> str:
        """ADMIT, or why not: 'burst_ceiling', 'borrowing_preempted', 'fair_share'.

        ``inflight``: requests in flight of this model per group (this one's not yet counted).
        """
        share = self.shares.get(group or "", GroupShare())
        mine = inflight.get(group or "", 0)
        capacity = max(1, capacity)
        if mine < math.floor(share.guaranteed * capacity + 1e-9):
            return ADMIT
        if mine >= max(1, math.ceil(share.burst * capacity - 1e-9)):
            return "burst_ceiling"
        if sum(inflight.values()) >= capacity:
            return "borrowing_preempted"
        guarantee = {g: math.floor(self.shares.get(g, GroupShare()).guaranteed * capacity + 1e-9) for g in inflight}
        borrowing = {g: n - guarantee[g] for g, n in inflight.items() if n > guarantee[g]}
        borrowing.setdefault(group or "", 0)
        if len(borrowing) == 1:
            return ADMIT
        spare = capacity - sum(min(n, guarantee[g]) for g, n in inflight.items())
        factors = {g: self.fair_factor(g, now) for g in borrowing}
        fair = spare * factors[group or ""] / sum(factors.values())
        return ADMIT if borrowing[group or ""] < max(1.0, fair) else "fair_share"

