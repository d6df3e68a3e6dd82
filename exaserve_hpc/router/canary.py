"""Canary rollouts: which version of a model takes a request.

Per model at most one rollout: a ``stable`` version and a ``canary`` one
that gets ``weight`` of the traffic (0.05 = 5%). The choice is sticky: a
request's bucket is a stable hash of its conversation (``session_id``) or,
without one, of the start of its prompt, so a conversation stays on one
version and its prefix cache stays useful. A version whose replicas are not
registered (yet, or any more) gives its share to the other; with none at
all the dispatcher falls back to every replica of the model.

``promote`` makes the canary the stable version (all traffic); ``rollback``
drops it (all traffic back to stable). Both end the rollout.

Before a version takes traffic its checkpoint is verified against its
checksum manifest (`check_version`, which reads every byte: call it off
the router thread, then `start`).
"""

from __future__ import annotations

import zlib
from array import array
from dataclasses import dataclass
from typing import Mapping, Optional

from exaserve_hpc.cache.checkpoint import CheckpointError, verify_checkpoint
from exaserve_hpc.protocol import GenerateRequest

STICKY_PROMPT_TOKENS = 64  # the start of a prompt that names a conversation when it has no session id


class RolloutError(Exception):
    """A rollout command cannot be carried out; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class Rollout:
    model: str
    stable: str
    canary: Optional[str] = None
    weight: float = 0.0  # fraction of traffic to the canary

    def as_dict(self) -> dict:
        return {"model": self.model, "stable": self.stable, "canary": self.canary, "weight": self.weight}


def check_version(model_dir: str) -> None:
    """Refuse a version whose checkpoint fails its checksum manifest (reads the whole checkpoint)."""
    try:
        verify_checkpoint(model_dir)
    except CheckpointError as exc:
        raise RolloutError(422, f"version refused: checkpoint {model_dir} failed verification: {exc}") from exc
    except OSError as exc:
        raise RolloutError(422, f"version refused: cannot read checkpoint {model_dir}: {exc}") from exc


def sticky_bucket(request: GenerateRequest) -> float:
    """A number in [0, 1) fixed for a conversation: same session id or same prompt start, same bucket."""
    if request.session_id:
        data = request.session_id.encode()
    else:
        data = array("I", [t & 0xFFFFFFFF for t in request.prompt_token_ids[:STICKY_PROMPT_TOKENS]]).tobytes()
    return zlib.crc32(data) / 2 ** 32


class RolloutTable:
    def __init__(self) -> None:
        self.rollouts: dict[str, Rollout] = {}

    # ---------------------------------------------------------------- commands

    def start(self, model: str, version: str, weight: float = 0.05, stable: Optional[str] = None) -> Rollout:
        """Send ``weight`` of the model's traffic to ``version`` (its checkpoint already checked)."""
        if not 0.0 < weight <= 1.0:
            raise RolloutError(422, f"canary weight must be in (0, 1], got {weight}; e.g. 0.05 for 5%")
        current = self.rollouts.get(model)
        base = stable if stable is not None else (current.stable if current else "")
        if version == base:
            raise RolloutError(409, f"{model} version {version!r} is already the stable version")
        if current is not None and current.canary not in (None, version):
            raise RolloutError(409, f"{model} already has canary {current.canary!r} at {current.weight:.0%}; "
                                    f"promote or roll it back first")
        rollout = Rollout(model, base, version, weight)
        self.rollouts[model] = rollout
        return rollout

    def promote(self, model: str, version: str) -> Rollout:
        self._canary(model, version)
        self.rollouts[model] = Rollout(model, stable=version)
        return self.rollouts[model]

    def rollback(self, model: str, version: str) -> Rollout:
        rollout = self._canary(model, version)
        self.rollouts[model] = Rollout(model, stable=rollout.stable)
        return self.rollouts[model]

    def _canary(self, model: str, version: str) -> Rollout:
        rollout = self.rollouts.get(model)
        if rollout is None or rollout.canary is None:
            raise RolloutError(404, f"{model} has no rollout in progress; start one with "
                                    f"`exaserve rollout start {model} VERSION`")
        if rollout.canary != version:
            raise RolloutError(409, f"{model}'s canary is {rollout.canary!r}, not {version!r}")
        return rollout

    # ---------------------------------------------------------------- routing

    def select(self, model: str, request: GenerateRequest, version_pools: Mapping[tuple[str, str], object]
               ) -> Optional[str]:
        """The version for this request, or None: any replica of the model."""
        rollout = self.rollouts.get(model)
        if rollout is None:
            return None
        stable_up = bool(version_pools.get((model, rollout.stable)))
        if rollout.canary is None:
            return rollout.stable if stable_up else None
        canary_up = bool(version_pools.get((model, rollout.canary)))
        if canary_up and (not stable_up or sticky_bucket(request) < rollout.weight):
            return rollout.canary
        return rollout.stable if stable_up else None

    def snapshot(self) -> list[dict]:
        return [r.as_dict() for _, r in sorted(self.rollouts.items())]
