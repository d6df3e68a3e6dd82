"""Slurm job and node states, translated into our own enums at the boundary.

Slurm spells states differently by version and by command: squeue --json in
22.05 gives "RUNNING", newer releases give ["RUNNING"]; sinfo --json gives
"down" plus state_flags ["NOT_RESPONDING"]; scontrol gives
"DOWN+NOT_RESPONDING" and squeue's short form "R"/"PD". Every one of them goes
through `job_state()` or `node_state()` and nothing past this module sees a
Slurm spelling. An unknown spelling maps to UNKNOWN (logged by the caller),
never to an exception: a new Slurm state must not crash the controller.
"""

from __future__ import annotations

import enum
from typing import Iterable, Union


class JobState(enum.Enum):
    PENDING = "pending"      # queued, held, requeued and waiting, configuring
    RUNNING = "running"
    STOPPING = "stopping"    # completing, signalled, stage-out: on its way out
    SUSPENDED = "suspended"
    COMPLETED = "completed"
    FAILED = "failed"        # non-zero exit, node failure, boot failure, out of memory
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"      # reached its time limit (or deadline)
    PREEMPTED = "preempted"
    UNKNOWN = "unknown"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL_JOB


_TERMINAL_JOB = {JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED, JobState.TIMEOUT, JobState.PREEMPTED}


class NodeState(enum.Enum):
    IDLE = "idle"
    ALLOCATED = "allocated"  # allocated or mixed: running jobs
    DOWN = "down"            # down, not responding, failed, powered off: do not place on it
    DRAINING = "draining"    # still running jobs, takes no new ones
    DRAINED = "drained"
    RESERVED = "reserved"    # in a reservation or maintenance
    UNKNOWN = "unknown"

    @property
    def usable(self) -> bool:
        """Can run our processes now (we may be the job on it)."""
        return self in (NodeState.IDLE, NodeState.ALLOCATED)


# Long names (squeue --json, scontrol) and compact codes (squeue -o %t).
JOB_TRANSLATE: dict[str, JobState] = {
    "PENDING": JobState.PENDING, "PD": JobState.PENDING,
    "REQUEUED": JobState.PENDING, "RQ": JobState.PENDING,
    "REQUEUE_HOLD": JobState.PENDING, "REQUEUE_FED": JobState.PENDING,
    "CONFIGURING": JobState.PENDING, "CF": JobState.PENDING,
    "RESV_DEL_HOLD": JobState.PENDING, "RD": JobState.PENDING,
    "RUNNING": JobState.RUNNING, "R": JobState.RUNNING,
    "RESIZING": JobState.RUNNING, "RS": JobState.RUNNING,
    "COMPLETING": JobState.STOPPING, "CG": JobState.STOPPING,
    "SIGNALING": JobState.STOPPING, "SI": JobState.STOPPING,
    "STAGE_OUT": JobState.STOPPING, "SO": JobState.STOPPING,
    "STOPPED": JobState.SUSPENDED, "ST": JobState.SUSPENDED,
    "SUSPENDED": JobState.SUSPENDED, "S": JobState.SUSPENDED,
    "COMPLETED": JobState.COMPLETED, "CD": JobState.COMPLETED,
    "FAILED": JobState.FAILED, "F": JobState.FAILED,
    "NODE_FAIL": JobState.FAILED, "NF": JobState.FAILED,
    "BOOT_FAIL": JobState.FAILED, "BF": JobState.FAILED,
    "OUT_OF_MEMORY": JobState.FAILED, "OOM": JobState.FAILED,
    "SPECIAL_EXIT": JobState.FAILED, "SE": JobState.FAILED,
    "REVOKED": JobState.CANCELLED, "RV": JobState.CANCELLED,
    "CANCELLED": JobState.CANCELLED, "CA": JobState.CANCELLED,
    "TIMEOUT": JobState.TIMEOUT, "TO": JobState.TIMEOUT,
    "DEADLINE": JobState.TIMEOUT, "DL": JobState.TIMEOUT,
    "PREEMPTED": JobState.PREEMPTED, "PR": JobState.PREEMPTED,
}

NODE_BASE: dict[str, NodeState] = {
    "IDLE": NodeState.IDLE,
    "ALLOCATED": NodeState.ALLOCATED, "ALLOC": NodeState.ALLOCATED,
    "MIXED": NodeState.ALLOCATED, "MIX": NodeState.ALLOCATED,
    "COMPLETING": NodeState.ALLOCATED, "COMP": NodeState.ALLOCATED,
    "DOWN": NodeState.DOWN, "FAIL": NodeState.DOWN, "FUTURE": NodeState.DOWN,
    "UNKNOWN": NodeState.UNKNOWN, "UNK": NodeState.UNKNOWN,
    "RESERVED": NodeState.RESERVED, "RESV": NodeState.RESERVED,
    "MAINT": NodeState.RESERVED, "PLANNED": NodeState.RESERVED,
    "DRAINED": NodeState.DRAINED, "DRAINING": NodeState.DRAINING, "DRNG": NodeState.DRAINING,
}

# Flags that override the base state, strongest first.
_NODE_FLAG_OVERRIDES: tuple[tuple[str, NodeState], ...] = (
    ("NOT_RESPONDING", NodeState.DOWN), ("FAIL", NodeState.DOWN), ("POWERED_DOWN", NodeState.DOWN),
    ("POWER_DOWN", NodeState.DOWN), ("POWERING_DOWN", NodeState.DOWN), ("REBOOT_ISSUED", NodeState.DOWN),
    ("DRAIN", NodeState.DRAINING), ("MAINTENANCE", NodeState.RESERVED), ("MAINT", NodeState.RESERVED),
)


def _words(raw: Union[str, Iterable[str], None]) -> list[str]:
    if raw is None:
        return []
    if isinstance(raw, str):
        raw = raw.replace("+", " ").split()
    return [str(w).strip().upper().rstrip("*~#!%$@^-") for w in raw if str(w).strip()]


def job_state(raw: Union[str, Iterable[str], None]) -> JobState:
    """"RUNNING", ["RUNNING"], "R", "CANCELLED by 0" -> JobState; unknown spellings -> UNKNOWN."""
    words = _words(raw)
    for word in words:
        if word in JOB_TRANSLATE:
            return JOB_TRANSLATE[word]
    return JobState.UNKNOWN


def node_state(raw: Union[str, Iterable[str], None], flags: Iterable[str] = ()) -> NodeState:
    """"mixed", "down"+["NOT_RESPONDING"], "DOWN+NOT_RESPONDING", "idle*", ["IDLE","DRAIN"] -> NodeState.

    A trailing '*' (sinfo's "not responding") counts as DOWN.
    """
    text = raw if isinstance(raw, str) else " ".join(raw or [])
    words = _words(raw) + _words(list(flags))
    if "*" in text:
        words.append("NOT_RESPONDING")
    base = next((NODE_BASE[w] for w in words if w in NODE_BASE), NodeState.UNKNOWN)
    for flag, state in _NODE_FLAG_OVERRIDES:
        if flag in words:
            if state is NodeState.DRAINING and base in (NodeState.IDLE, NodeState.DOWN):
                return NodeState.DRAINED if base is NodeState.IDLE else NodeState.DOWN
            return state
    return base
