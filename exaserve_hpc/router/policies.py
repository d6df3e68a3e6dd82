"""The routing policies by name (``router.policy``) and the one factory.

Every policy implements `balancing.RoutingPolicy`; adding one is its class
plus an entry here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from exaserve_hpc.router.affinity import PrefixAffinity
from exaserve_hpc.router.balancing import LeastLoad, LeastTokens, PowerOfTwo, RoundRobin, RoutingPolicy

if TYPE_CHECKING:
    from exaserve_hpc.config.schema import BatchingConfig, RouterConfig

POLICIES: dict[str, type[RoutingPolicy]] = {
    cls.name: cls for cls in (RoundRobin, LeastLoad, LeastTokens, PowerOfTwo, PrefixAffinity)
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


def policy_class(name: str) -> type[RoutingPolicy]:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICY_NAMES)}") from None


def make_policy(name: str, **options) -> RoutingPolicy:
    """A policy by name with explicit options (tests, benchmarks)."""
    return policy_class(name)(**options)


def policy_for_site(router: "RouterConfig", batching: "BatchingConfig") -> RoutingPolicy:
    """The policy a site's router section names, with the settings the site gives it."""
    return policy_class(router.policy).from_site(router, batching)
