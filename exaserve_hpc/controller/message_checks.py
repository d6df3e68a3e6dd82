"""What the controller checks of a message beyond decoding: a pure rule (loop.py drops a message
it names, counted against its peer by peer_guard.PeerGuard).

`invalid(message)` checks the replica states named in heartbeats and events.
"""

from __future__ import annotations

from exaserve_hpc.agent.lifecycle import ReplicaState
from exaserve_hpc.peer_guard import shorten
from exaserve_hpc.protocol import AgentHeartbeat, ReplicaEvent

_STATES = frozenset(s.value for s in ReplicaState)


def invalid(message) -> str:
    """Why `message` cannot be handled though it decoded ("" when it can)."""
    if isinstance(message, AgentHeartbeat):
        for status in message.replicas:
            if status.state not in _STATES:
                return (f"heartbeat names replica {shorten(status.replica_id, 60)!r} in unknown state "
                        f"{shorten(status.state, 40)!r}; states: {', '.join(sorted(_STATES))}")
    elif isinstance(message, ReplicaEvent) and message.state not in _STATES:
        return (f"event for replica {shorten(message.replica_id, 60)!r} names unknown state "
                f"{shorten(message.state, 40)!r}")
    return ""
