"""How many replacement nodes to ask Slurm for: a pure policy for rank 0.

Call protocol (every watch round, after requeue_decision said no; the job environment acts:
batch/, e.g. a Slurm companion job from batch/slurm/companion_jobs.py):

    decision = replacement_decision(planned, live, lost, pending)
    if decision.nodes: submit a companion job of decision.nodes nodes, excluding decision.exclude

`pending` counts nodes already asked for in companion jobs whose agents have not joined yet, so a
tick never asks twice for the same hole. Label in logs and decisions: "replace-lost-nodes".
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplacementDecision:
    nodes: int  # nodes to ask for now; 0: none
    exclude: tuple[str, ...] = ()
    why: str = ""


def replacement_decision(planned_nodes: int, live_nodes: int, lost_nodes: tuple[str, ...] | list[str],
                         pending_nodes: int) -> ReplacementDecision:
    missing = planned_nodes - live_nodes - max(0, pending_nodes)
    if missing <= 0 or not lost_nodes:
        return ReplacementDecision(0, why=f"{live_nodes}/{planned_nodes} nodes live, {pending_nodes} on the way")
    exclude = tuple(sorted(set(lost_nodes)))
    return ReplacementDecision(missing, exclude, f"replace-lost-nodes: {live_nodes}/{planned_nodes} nodes live, "
                                                 f"{pending_nodes} on the way; asking for {missing} "
                                                 f"(lost {', '.join(exclude)})")
