"""`router.policy: random`: each request to a replica drawn uniformly among the usable ones.

SGLang's router offers the same policy (its `random` policy); it is the floor every load- or cache-aware
policy must beat, and the example docs/extending.md walks through: one module and one line in
router/policies.py.
"""

from __future__ import annotations

import random
from typing import Container, Optional, Sequence

from exaserve_hpc.router.balancing import Decision, ReplicaLoad, RoutingKey, RoutingPolicy


class RandomChoice(RoutingPolicy):
    name = "random"

    def __init__(self, seed: Optional[int] = None) -> None:
        self._rng = random.Random(seed)  # its own generator: a seed makes a run repeatable

    def route(self, candidates: Sequence[ReplicaLoad], exclude: Container[str] = frozenset(),
              key: Optional[RoutingKey] = None) -> Decision:
        usable = [c for c in candidates if c.replica_id not in exclude]
        return Decision(self._rng.choice(usable).replica_id) if usable else Decision(None, reason="none")
