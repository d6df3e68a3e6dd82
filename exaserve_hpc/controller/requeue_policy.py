"""When to give the allocation back and come again: a pure policy for rank 0.

Call protocol (every watch round, from app/requeue_watch.py):

    decision = requeue_decision(RequeueSnapshot(...), policy)
    if decision.requeue: checkpoint state, then `scontrol requeue` excluding decision.exclude

Branches, checked in this order, each with the label that appears in logs and in the decision:
    controller-node-lost   rank 0's own node agent is lost: the node hosting the controller is unwell
    requested              an operator (or a test) asked, e.g. a `requeue-requested` file in the job dir
    time-limit-near        fewer than policy.time_margin seconds before the job's time limit
    capacity-below-floor   live nodes / planned nodes fell below policy.capacity_floor
The nodes to exclude next time are always the ones declared lost.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional


class RequeueReason(enum.Enum):
    CONTROLLER_NODE_LOST = "controller-node-lost"
    REQUESTED = "requested"
    TIME_LIMIT_NEAR = "time-limit-near"
    CAPACITY_BELOW_FLOOR = "capacity-below-floor"


@dataclass(frozen=True)
class RequeuePolicy:
    capacity_floor: float = 0.5  # requeue when live/planned nodes drops below this; 0 turns it off
    time_margin: float = 0.0  # seconds before the time limit; 0 turns it off (the sbatch USR1 stop covers it)


@dataclass(frozen=True)
class RequeueSnapshot:
    planned_nodes: int
    live_nodes: tuple[str, ...]
    lost_nodes: tuple[str, ...]
    controller_node: str = ""
    seconds_left: Optional[float] = None  # before the job's time limit; None: no limit known
    requested: bool = False


@dataclass(frozen=True)
class RequeueDecision:
    requeue: bool
    reason: Optional[RequeueReason] = None
    exclude: tuple[str, ...] = ()
    why: str = ""


def requeue_decision(snapshot: RequeueSnapshot, policy: RequeuePolicy = RequeuePolicy()) -> RequeueDecision:
    exclude = tuple(sorted(set(snapshot.lost_nodes)))

    def requeue(reason: RequeueReason, why: str) -> RequeueDecision:
        return RequeueDecision(True, reason, exclude, f"{reason.value}: {why}")

    if snapshot.controller_node and snapshot.controller_node in snapshot.lost_nodes:
        return requeue(RequeueReason.CONTROLLER_NODE_LOST, f"the controller's node {snapshot.controller_node} "
                                                           f"stopped heartbeating")
    if snapshot.requested:
        return requeue(RequeueReason.REQUESTED, "asked for in the job directory")
    if policy.time_margin > 0 and snapshot.seconds_left is not None and snapshot.seconds_left < policy.time_margin:
        return requeue(RequeueReason.TIME_LIMIT_NEAR, f"{snapshot.seconds_left:.0f}s left, margin "
                                                      f"{policy.time_margin:.0f}s")
    if policy.capacity_floor > 0 and snapshot.planned_nodes > 0:
        share = len(snapshot.live_nodes) / snapshot.planned_nodes
        if share < policy.capacity_floor:
            return requeue(RequeueReason.CAPACITY_BELOW_FLOOR,
                           f"{len(snapshot.live_nodes)}/{snapshot.planned_nodes} nodes live ({share:.0%}) < floor "
                           f"{policy.capacity_floor:.0%}; lost {', '.join(exclude) or 'none'}")
    return RequeueDecision(False, why="capacity, time and controller node are fine")


# ---------------------------------------------------------------- the controller lost (no HA)


@dataclass(frozen=True)
class ControllerLostDecision:
    """What the one surviving rank that acts does when the controller went silent without HA
    (app/controller_lost.py). action: "successor" (a successor job excluding `exclude`, resuming from
    the last periodic checkpoint, then this job cancelled) or "cancel" (this job cancelled: its nodes go back)."""
    action: str
    exclude: tuple[str, ...]
    why: str


def controller_lost_decision(controller_node: str, requeue_enabled: bool, can_requeue: bool,
                             checkpoint_age: Optional[float]) -> ControllerLostDecision:
    """checkpoint_age: seconds since the controller's last periodic checkpoint was written; None: none was."""
    exclude = (controller_node,) if controller_node else ()
    lost = f"the controller on {controller_node or 'rank 0'} went silent"
    if not requeue_enabled:
        return ControllerLostDecision("cancel", exclude, f"{lost}; requeue is off (requeue.enabled, --no-requeue), "
                                                         f"so the job is cancelled and its nodes go back")
    if not can_requeue:
        return ControllerLostDecision("cancel", exclude, f"{lost}; this batch system cannot requeue, so the job is "
                                                         f"cancelled and its nodes go back")
    state = ("from the site's plan (no periodic checkpoint was written; requeue.checkpoint_interval)"
             if checkpoint_age is None else f"from the checkpoint written {checkpoint_age:.0f}s before")
    return ControllerLostDecision("successor", exclude, f"{lost}; a successor job excluding "
                                                        f"{controller_node or 'no node'} starts {state}")
