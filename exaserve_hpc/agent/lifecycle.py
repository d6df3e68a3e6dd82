"""Replica lifecycle: an explicit state machine, as reported by node agents and shown by `exaserve status`.

    pending -> reserving -> loading -> initializing -> warming -> registering -> serving -> draining -> stopped
    any live state -> failed        (everything reserved so far is released)
    any live state -> stopped       (a stop asked for before the replica served)

Who moves it: the agent does pending -> reserving (memory pool) -> loading
(L3 -> L2, shared by the node's replicas); the replica process reports the
rest (L2 -> L1 is still "loading") on its status pipe. ``Lifecycle`` stamps
every transition with the seconds spent in the state it leaves, from the
clock its caller passes in (no clock reads here).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class ReplicaState(str, enum.Enum):
    PENDING = "pending"  # asked for, nothing reserved yet
    RESERVING = "reserving"
    LOADING = "loading"
    INITIALIZING = "initializing"
    WARMING = "warming"
    REGISTERING = "registering"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (ReplicaState.STOPPED, ReplicaState.FAILED)


ORDER = [ReplicaState.PENDING, ReplicaState.RESERVING, ReplicaState.LOADING, ReplicaState.INITIALIZING,
         ReplicaState.WARMING, ReplicaState.REGISTERING, ReplicaState.SERVING, ReplicaState.DRAINING,
         ReplicaState.STOPPED]

# The one step forward each live state may take (besides failed / stopped).
NEXT = {ORDER[i]: ORDER[i + 1] for i in range(len(ORDER) - 1)}


def can_move(current: ReplicaState, new: ReplicaState) -> bool:
    """The next step of ORDER, or failed / stopped from any live state."""
    if current.terminal:
        return False
    return new in (ReplicaState.FAILED, ReplicaState.STOPPED) or NEXT.get(current) is new


@dataclass(frozen=True)
class Transition:
    old: ReplicaState
    new: ReplicaState
    seconds: float  # time spent in ``old``
    detail: str = ""


@dataclass
class Lifecycle:
    """One replica's state and the transitions it went through, with their durations."""

    entered_at: float
    state: ReplicaState = ReplicaState.PENDING
    history: list[Transition] = field(default_factory=list)

    def move(self, new: ReplicaState, now: float, detail: str = "") -> Transition | None:
        """Take the transition if the machine allows it; None (and no change) if not."""
        if not can_move(self.state, new):
            return None
        transition = Transition(self.state, new, max(0.0, now - self.entered_at), detail)
        self.state, self.entered_at = new, now
        self.history.append(transition)
        return transition

    def seconds_in(self, state: ReplicaState) -> float:
        return sum(t.seconds for t in self.history if t.old is state)


# A replica stop its agent did not ask for starts ReplicaEvent.detail with this (controller/loop.py)
STOPPED_UNASKED = "stopped on its own"
