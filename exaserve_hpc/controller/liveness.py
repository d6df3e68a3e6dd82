"""When is a node lost? A pure rule (`judge`) the controller feeds every tick (issue 25, item 1).

A node is lost when its processes are gone or silent on *every* channel, not when one heartbeat thread is
starved. Overload on a shared machine delays the agent's heartbeat thread by seconds while its replicas
keep streaming tokens; declaring such a node lost moved every request it held and made the replicas'
work orphaned. So the evidence of life is:

- any message from the node's agent (heartbeats, replica events, hellos: `heard_at`);
- any message from the node's replicas that the router sees (token chunks, stats, errors: `other_at`);
- under `exaserve serve`, the agent process itself, checked directly (`process`: it is a child of the
  control plane; a running process is alive, however late its heartbeats are; a gone one is not).

The grace after `heartbeat.expiry` adapts to the scheduling delay the node showed: `Lateness` keeps how
late its recent heartbeats arrived (gap between two arrivals less the interval), and `adaptive_grace`
widens the configured grace to a multiple of the worst recent lateness, up to a cap, so a machine whose
heartbeats arrive seconds late gets seconds more before anything is torn down, and a quiet one keeps the
configured figure.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional

ALIVE, SUSPECT, LOST = "alive", "suspect", "lost"

LATENESS_WINDOW = 32      # heartbeat arrivals remembered per node
LATENESS_FACTOR = 3.0     # the grace covers this many times the worst recent lateness
GRACE_CAP_EXPIRIES = 10   # ... but at most this many heartbeat expiries (unless the configured grace is larger)


@dataclass(frozen=True)
class Evidence:
    """What the controller knows of one node, on its own clock."""
    heard_at: float                  # the latest message from the node's agent
    other_at: float = 0.0            # the latest message from one of its replicas (at the router); 0: none
    process: Optional[bool] = None   # its agent process checked directly: True running, False gone, None unknown


@dataclass(frozen=True)
class Verdict:
    state: str      # ALIVE, SUSPECT or LOST
    silent: float   # seconds since the last sign of life on any channel
    why: str        # a phrase for the log


def judge(now: float, evidence: Evidence, expiry: float, grace: float) -> Verdict:
    """The node's state now: ALIVE while its agent process runs (when that can be checked) or some channel
    spoke within `expiry`; SUSPECT for `grace` seconds after that; then LOST. A process known gone gets no
    grace (a gone process is not late): LOST once every channel has been silent for `expiry`."""
    last = max(evidence.heard_at, evidence.other_at)
    silent = max(0.0, now - last)
    channel = "its replicas" if evidence.other_at > evidence.heard_at else "its agent"
    if evidence.process is True:
        return Verdict(ALIVE, silent, "its agent process is running")
    if silent <= expiry:
        return Verdict(ALIVE, silent, f"heard from {channel} {silent:.1f}s ago")
    if evidence.process is False:
        return Verdict(LOST, silent, f"its agent process is gone and nothing was heard for {silent:.1f}s")
    if silent <= expiry + grace:
        return Verdict(SUSPECT, silent, f"silent on every channel for {silent:.1f}s")
    return Verdict(LOST, silent, f"silent on every channel (agent and replicas) for {silent:.1f}s, "
                                 f"past {expiry:.1f}s + a grace of {grace:.1f}s")


class Lateness:
    """How late one node's heartbeats arrive: the recent gaps between arrivals less the interval."""

    def __init__(self, interval: float, window: int = LATENESS_WINDOW):
        self.interval = interval
        self.samples: deque[float] = deque(maxlen=window)
        self.last_arrival: Optional[float] = None

    def arrived(self, now: float) -> None:
        if self.last_arrival is not None:
            self.samples.append(max(0.0, now - self.last_arrival - self.interval))
        self.last_arrival = now

    def worst(self) -> float:
        return max(self.samples, default=0.0)


def adaptive_grace(base: float, worst_lateness: float, expiry: float,
                   factor: float = LATENESS_FACTOR, cap_expiries: float = GRACE_CAP_EXPIRIES) -> float:
    """The grace after `expiry` before a silent node is lost: the configured `base`, widened to `factor`
    times the worst recent heartbeat lateness, capped at `cap_expiries` expiries (never below `base`)."""
    cap = max(base, cap_expiries * expiry)
    return max(base, min(cap, factor * worst_lateness))
