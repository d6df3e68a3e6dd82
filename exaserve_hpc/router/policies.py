"""The routing policies by name (``router.policy``) and the one factory.

Every policy implements `balancing.RoutingPolicy`; adding one is its class (a module of its own, or
balancing.py) plus one line in ``POLICIES`` naming where it lives. The table names modules rather than
importing them, as vLLM's model registry does, so the site schema (config/schema.py) can list the allowed
names without loading the router: a policy's module is imported when a router first asks for it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from exaserve_hpc.config.schema import BatchingConfig, RouterConfig
    from exaserve_hpc.router.balancing import RoutingPolicy

# name -> (module, class); the class's `name` attribute must be its key (checked on first use)
POLICIES: dict[str, tuple[str, str]] = {
    "round_robin": ("exaserve_hpc.router.balancing", "RoundRobin"),
    "least_load": ("exaserve_hpc.router.balancing", "LeastLoad"),
    "least_tokens": ("exaserve_hpc.router.balancing", "LeastTokens"),
    "power_of_two": ("exaserve_hpc.router.balancing", "PowerOfTwo"),
    "prefix_affinity": ("exaserve_hpc.router.affinity", "PrefixAffinity"),
    "random": ("exaserve_hpc.router.random_choice", "RandomChoice"),
    # the field's routers, each as its upstream ships it (the module docstrings cite the sources): the
    # baselines benchmarks/bench_router_trace.py measures prefix_affinity against, and usable by a site
    "sglang_cache_aware": ("exaserve_hpc.router.sglang_cache_aware", "SGLangCacheAware"),
    "llmd_scheduler": ("exaserve_hpc.router.llmd_scheduler", "LlmdScheduler"),
    "dynamo_kv": ("exaserve_hpc.router.dynamo_kv", "DynamoKvRouter"),
}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


def policy_class(name: str) -> "type[RoutingPolicy]":
    try:
        module, attribute = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICY_NAMES)}") from None
    cls = getattr(importlib.import_module(module), attribute)
    if cls.name != name:
        raise RuntimeError(f"routing policy {name!r} is registered as {module}.{attribute}, whose name is {cls.name!r}")
    return cls


def make_policy(name: str, **options) -> "RoutingPolicy":
    """A policy by name with explicit options (tests, benchmarks)."""
    return policy_class(name)(**options)


def policy_for_site(router: "RouterConfig", batching: "BatchingConfig") -> "RoutingPolicy":
    """The policy a site's router section names, with the settings the site gives it."""
    return policy_class(router.policy).from_site(router, batching)
