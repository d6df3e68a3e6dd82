"""Circuit breaker per replica: stop sending work to a replica that keeps failing.

closed --(``failures`` consecutive failures or timeouts)--> open
open   --(``cooloff`` seconds pass)--> half-open: exactly one probe request may go
half-open --probe succeeds--> closed;  --probe fails--> open again, cool-off doubled (capped)

Pure: every call takes the current time; the dispatcher asks `available`
when it builds the candidate set and reports outcomes. A success is the
first token of a request (the replica demonstrably serves), a failure a
replica-side error, a first-token timeout or a stalled stream.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class BreakerSettings:
    failures: int = 3  # consecutive failures that open the breaker
    cooloff: float = 10.0  # seconds open before the half-open probe
    max_cooloff: float = 120.0  # a failing probe doubles the cool-off up to this


class CircuitBreaker:
    def __init__(self, settings: BreakerSettings):
        self.settings = settings
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.opened_at = 0.0
        self.cooloff = settings.cooloff
        self.probe_in_flight = False
        self.times_opened = 0

    def available(self, now: float) -> bool:
        """May a new request go to this replica now? (moves open -> half-open when the cool-off is over)"""
        if self.state is BreakerState.OPEN and now - self.opened_at >= self.cooloff:
            self.state = BreakerState.HALF_OPEN
            self.probe_in_flight = False
        if self.state is BreakerState.HALF_OPEN:
            return not self.probe_in_flight
        return self.state is BreakerState.CLOSED

    def on_dispatch(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self.probe_in_flight = True

    def on_success(self) -> None:
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.cooloff = self.settings.cooloff
        self.probe_in_flight = False

    def on_failure(self, now: float) -> bool:
        """Count a failure; True when this one opened the breaker."""
        if self.state is BreakerState.HALF_OPEN:
            self.cooloff = min(self.settings.max_cooloff, self.cooloff * 2)
            return self._open(now)
        if self.state is BreakerState.OPEN:
            return False  # late failures of requests sent before it opened
        self.consecutive_failures += 1
        if self.consecutive_failures >= self.settings.failures:
            return self._open(now)
        return False

    def _open(self, now: float) -> bool:
        self.state = BreakerState.OPEN
        self.opened_at = now
        self.probe_in_flight = False
        self.times_opened += 1
        return True

    def reopens_at(self) -> float:
        return self.opened_at + self.cooloff
