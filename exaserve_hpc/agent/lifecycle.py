"""Replica lifecycle states, as reported by node agents and shown by `exaserve status`.

reserving -> loading -> initializing -> warming -> registering -> serving -> draining -> stopped
any state before stopped can go to failed. A transition is reported with the
seconds spent in the state it leaves.
"""

from __future__ import annotations

import enum


class ReplicaState(str, enum.Enum):
    PENDING = "pending"  # asked for, no process yet
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


def can_move(current: ReplicaState, new: ReplicaState) -> bool:
    """Forward along ORDER (steps may be skipped), or to FAILED from any live state."""
    if current.terminal:
        return False
    if new is ReplicaState.FAILED:
        return True
    return ORDER.index(new) > ORDER.index(current)
