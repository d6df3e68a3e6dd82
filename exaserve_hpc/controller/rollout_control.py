"""Rollouts on the controller's side: which version each replica runs, and the replicas a rollout adds or stops.

The router's `RolloutTable` (router/canary.py) decides which version takes a request; this module makes
the fleet match it. The admin API changes the table first, then calls `RolloutFleet.changed`, so traffic
never goes to a version before the table knows its share:

- start V at weight w: add `canary_replicas` replicas of V (at least one; w of the stable version's count,
  rounded up), started from V's checkpoint. V takes its share once one of them registers; until then the
  table sends everything to the stable version.
- promote V: V is the stable version: replicas added later (autoscaler) run it. The model keeps its
  replica count: V gets as many replicas as the old stable version had, and an old replica is drained
  and stopped for each V replica serving beyond that (`old_to_retire`), so the serving count never drops
  while the old version is replaced.
- rollback V: V gets no new requests (table); each V replica is drained (finishes what it holds) and stopped.

While a promote replaces the old version the autoscaler does not scale the model down, and it never
stops a canary replica (`scalable`): those are outside the model's count.

Decisions are the pure functions; `RolloutFleet` carries them out on the controller thread.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from exaserve_hpc.config.schema import SiteConfig
from exaserve_hpc.controller.fleet_state import ReplicaRecord, pick_for_removal

if TYPE_CHECKING:
    from exaserve_hpc.router.canary import Rollout
    from exaserve_hpc.controller.fleet import Fleet

log = logging.getLogger("exaserve.rollout")

_VERSION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def version_dir(site: SiteConfig, model: str, version: str) -> Optional[Path]:
    """Where a version's checkpoint lives when none is given: next to the model's, named `<dir>@<version>`
    (e.g. ~/.cache/exaserve/models/tiny-llama@v2); None when there is no checkpoint there."""
    if not _VERSION_NAME.fullmatch(version) or model not in {m.model_name for m in site.models}:
        return None
    base = site.model_dir(site.model(model))
    path = base.with_name(f"{base.name}@{version}")
    return path if (path / "manifest.json").is_file() else None


def canary_replicas(stable: int, weight: float) -> int:
    """Replicas a canary at `weight` of the traffic gets: that share of the stable count, rounded up, >= 1."""
    return max(1, math.ceil(weight * stable - 1e-9))


def old_to_retire(old: list[ReplicaRecord], new_serving: int, wanted: int, routed: Mapping[str, dict]) -> list[str]:
    """Old-version replicas to stop now: one per new-version replica serving beyond what keeps `wanted`
    replicas serving (those not serving first, then the least busy)."""
    count = min(len(old), new_serving + len(old) - wanted)
    return pick_for_removal(old, routed, count)


@dataclass
class ModelVersions:
    stable: str = ""  # version new replicas run; "" = the site's checkpoint
    canary: Optional[str] = None
    dirs: dict[str, str] = field(default_factory=dict)  # version -> checkpoint directory


class RolloutFleet:
    """The controller's rollout state. `changed` may be called from any thread; the rest runs on the
    controller thread (the controller calls `model_dir`, `stable`, `scalable` and `tick`)."""

    def __init__(self, fleet: "Fleet"):
        self.fleet = fleet
        self.models: dict[str, ModelVersions] = {}

    # ---------------------------------------------------------------- read by the controller

    def stable(self, model: str) -> str:
        versions = self.models.get(model)
        return versions.stable if versions else ""

    def model_dir(self, record: ReplicaRecord) -> str:
        versions = self.models.get(record.model)
        if record.version and versions and record.version in versions.dirs:
            return versions.dirs[record.version]
        site = self.fleet.site
        return str(site.model_dir(site.model(record.model)))

    def scalable(self, model: str, active: Iterable[ReplicaRecord]) -> list[ReplicaRecord]:
        """The replicas the autoscaler may stop: the stable version's, and none while old ones are replaced."""
        versions = self.models.get(model) or ModelVersions()
        active = list(active)
        if any(r.version not in (versions.stable, versions.canary) for r in active):
            return []
        return [r for r in active if r.version == versions.stable]

    # ---------------------------------------------------------------- commands

    def changed(self, action: str, rollout: "Rollout", version: str, model_dir: Optional[str]) -> None:
        """The router's table took `action` (start/promote/rollback) for `version`; make the fleet follow."""
        self.fleet.submit(lambda: self._apply(action, rollout, version, model_dir))

    def _apply(self, action: str, rollout: "Rollout", version: str, model_dir: Optional[str]) -> None:
        """On the controller thread, fleet lock held (Fleet.submit); the next tick places what it adds."""
        fleet = self.fleet
        versions = self.models.setdefault(rollout.model, ModelVersions())
        active = fleet.active(rollout.model)
        if action == "start":
            if model_dir:
                versions.dirs[version] = model_dir
            versions.stable, versions.canary = rollout.stable, version
            stable = sum(r.version == versions.stable for r in active)
            have = sum(r.version == version for r in active)
            self._add(rollout.model, version, canary_replicas(stable, rollout.weight) - have,
                      f"canary {version} at {rollout.weight:.0%}")
        elif action == "promote":
            old = sum(r.version == versions.stable for r in active)
            versions.stable, versions.canary = version, None
            have = sum(r.version == version for r in active)
            self._add(rollout.model, version, old - have, f"promoted {version}")
        elif action == "rollback":
            versions.stable, versions.canary = rollout.stable, None
            for record in active:
                if record.version == version:
                    fleet.retire(record, f"rollback of {rollout.model} {version}")

    def _add(self, model: str, version: str, count: int, reason: str) -> None:
        added = self.fleet.add(model, count, f"rollout: {reason}", version=version)
        if added:
            log.info("rollout %s: %s; adding %s", model, reason, ", ".join(r.replica_id for r in added))

    # ---------------------------------------------------------------- every tick

    def tick(self) -> None:
        """Stop old-version replicas of promoted models as the new version's replicas come up (lock held)."""
        fleet = self.fleet
        routed: Optional[dict[str, dict]] = None
        for model, versions in self.models.items():
            active = fleet.active(model)
            old = [r for r in active if r.version not in (versions.stable, versions.canary)]
            new = [r for r in active if r.version == versions.stable]
            if not old or not new:  # nothing to replace, or nothing to replace it with
                continue
            if routed is None:
                routed = {r["replica_id"]: r for r in fleet.router.snapshot().get("replicas", [])}
            for rid in old_to_retire(old, sum(r.serving for r in new), len(new), routed):
                log.info("rollout %s: replacing %s (version %r) by version %r", model, rid,
                         fleet.replicas[rid].version, versions.stable)
                fleet.retire(fleet.replicas[rid], f"replaced by {model} version {versions.stable!r}")
