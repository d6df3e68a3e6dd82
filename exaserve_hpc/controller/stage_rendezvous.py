"""Pipeline-parallel replicas on the controller: one StartReplica per stage, and the stages' rendezvous.

A model with ``pipeline_parallel`` N > 1 runs each replica as N stage processes
(``agent/stage_process.py``), one per node of its assignment (the planner puts the stages on
distinct nodes; ``Fleet.stage_specs`` gives one (node, StartReplica) per stage). The controller's
record of the replica is stage 0's: its node, its state (stage 0 registers with the router and
reports for the whole replica). Each start of such a replica is an *attempt* with a key of its own:

- ``PipelineStages.stage_starts`` turns the per-stage specs into what is sent: each gets its
  ``PipelineStage`` (rank, size, key, the controller's endpoint, every stage's node, timeouts).
  Stage 0 keeps the replica's id; stage k > 0 gets ``<replica id>~s<k>@<attempt>``, so a stage of
  an earlier attempt still exiting never blocks its agent from starting the new one. (Stage 0 of
  an earlier attempt still running on the same node is killed by its agent, unreported, when the
  new attempt's StartReplica arrives: ``NodeAgent._discard_stage``.)
- Stages find each other here: each says ``StageHello`` (its link endpoint) and ``on_hello``
  answers with the attempt's ``StageTable``. A later stage whose agent reports it failed (say its
  reservation was refused) fails the attempt at once: the table carries the reason to the others.
  Stages of an attempt that was replaced, or that the controller no longer knows (it restarted),
  are told so and exit.
- Losing any stage loses the replica: stage 0 fails by itself when a peer's link drops (the link's
  watchdog) and is restarted like any failed replica; a lost node re-places every replica with a
  stage on it (placement_control.node_lost), which starts a new attempt.

No sockets and no clock here: the controller thread calls these with its lock held.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import msgspec

from exaserve_hpc.engine.stage_link import stage_name
from exaserve_hpc.protocol import PipelineStage, ReplicaEvent, StageHello, StageTable, StartReplica

log = logging.getLogger("exaserve.pipeline")


def stage_process_id(replica_id: str, rank: int, attempt: int) -> str:
    """Stage 0 is the replica itself; later stages have an id per attempt."""
    return replica_id if rank == 0 else f"{replica_id}~s{rank}@{attempt}"


def stage_of(process_id: str) -> Optional[tuple[str, int, int]]:
    """(replica id, rank, attempt) of a later stage's process id; None for anything else."""
    replica_id, sep, rest = process_id.rpartition("~s")
    rank, at, attempt = rest.partition("@")
    if not sep or not at or not rank.isdigit() or not attempt.isdigit():
        return None
    return replica_id, int(rank), int(attempt)


@dataclass
class Attempt:
    """One start of a pipeline replica: where its stages run and how they meet."""
    key: str
    nodes: list[str]
    endpoints: list[str]
    failed: str = ""


@dataclass
class PipelineStages:
    """The controller's pipeline bookkeeping: the current and the previous attempt of each replica."""
    rendezvous: str = ""  # the controller's endpoint, where stages say StageHello
    timeout: float = 15.0  # link silence after which a stage counts as lost (the heartbeat expiry)
    rendezvous_timeout: float = 300.0  # stages may wait this long for each other (weights load first)
    attempts: dict[str, Attempt] = field(default_factory=dict)  # replica id -> its current attempt
    previous: dict[str, Attempt] = field(default_factory=dict)  # replica id -> the attempt before
    counter: int = 0

    def stage_starts(self, stages: list[tuple[str, StartReplica]]) -> list[tuple[str, StartReplica]]:
        """(node, StartReplica) per stage, as Fleet.stage_specs gives them, made ready to send: a
        replica of one stage is sent as it is; the stages of a pipeline get their PipelineStage."""
        if len(stages) <= 1:
            return stages
        replica_id = stages[0][1].replica_id
        nodes = [node for node, _ in stages]
        if len(set(nodes)) < len(nodes):
            log.warning("replica %s: pipeline stages share a node (%s)", replica_id, ", ".join(nodes))
        self.counter += 1
        key = f"{replica_id}@{self.counter}"
        old = self.attempts.get(replica_id)
        if old is not None:
            old.failed = old.failed or f"replaced by attempt {key}"
            self.previous[replica_id] = old
        self.attempts[replica_id] = Attempt(key, nodes, [""] * len(stages))
        log.info("replica %s: pipeline stages on %s (attempt %s)", replica_id, ", ".join(nodes), key)
        return [(node, msgspec.structs.replace(
                    spec, replica_id=stage_process_id(replica_id, rank, self.counter),
                    stage=PipelineStage(rank=rank, size=len(stages), key=key, rendezvous=self.rendezvous,
                                        nodes=nodes, timeout=self.timeout,
                                        rendezvous_timeout=self.rendezvous_timeout)))
                for rank, (node, spec) in enumerate(stages)]

    def _attempt(self, key: str) -> Optional[Attempt]:
        replica_id = key.rpartition("@")[0]
        for attempt in (self.attempts.get(replica_id), self.previous.get(replica_id)):
            if attempt is not None and attempt.key == key:
                return attempt
        return None

    def on_hello(self, hello: StageHello) -> StageTable:
        """A stage's endpoint in; the attempt's table (complete or not, or why it failed) out."""
        attempt = self._attempt(hello.key)
        if attempt is None:
            return StageTable(key=hello.key, endpoints=[], failed="the controller knows no such attempt "
                                                                  "(it restarted, or the replica was replaced)")
        if 0 <= hello.rank < len(attempt.endpoints):
            attempt.endpoints[hello.rank] = hello.endpoint
        return StageTable(key=attempt.key, endpoints=list(attempt.endpoints), failed=attempt.failed)

    def on_stage_event(self, event: ReplicaEvent) -> bool:
        """True if the event is a later stage's (no replica record has its id); a failure of one fails
        its attempt, so the stages waiting for it stop waiting."""
        parsed = stage_of(event.replica_id)
        if parsed is None:
            return False
        replica_id, rank, counter = parsed
        attempt = self._attempt(f"{replica_id}@{counter}")
        if event.state == "failed" and attempt is not None and not attempt.failed:
            attempt.failed = f"{stage_name(rank, attempt.nodes)} failed: {event.detail}"
            log.warning("replica %s: %s", replica_id, attempt.failed)
        return True

    def forget(self, replica_id: str) -> None:
        self.attempts.pop(replica_id, None)
        self.previous.pop(replica_id, None)
