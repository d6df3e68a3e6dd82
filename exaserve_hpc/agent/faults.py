"""Failure injection for lifecycle tests: ``EXASERVE_INJECT_FAILURE=step[,step...]``.

Steps the agent checks: ``reserving``, ``l3_read`` (an I/O error while copying
L3 -> L2) and ``load_timeout[:N]`` (the first N L3 -> L2 attempts hang until
cancelled; no N: every attempt). Steps the replica process checks:
``loading``, ``initializing``, ``warming``, ``registering``, ``serving``,
``draining``. A router rank checks ``router_late:S`` (it registers its router S seconds after its
agent starts, not before: a router that comes after placement). The control plane checks
``gateway_late:S`` (its gateway starts S seconds after serve.json is written). Unset (the normal case), every check
is a no-op.
"""

from __future__ import annotations

import os

ENV = "EXASERVE_INJECT_FAILURE"


class InjectedFailure(RuntimeError):
    pass


def _steps() -> dict[str, str]:
    steps = {}
    for item in os.environ.get(ENV, "").split(","):
        name, _, arg = item.strip().partition(":")
        if name:
            steps[name] = arg
    return steps


def check(step: str) -> None:
    """Raise InjectedFailure if the environment asks for a failure at ``step``."""
    if step in _steps():
        raise InjectedFailure(f"injected failure at {step} ({ENV})")


def stalls(attempt: int) -> bool:
    """Whether L3 -> L2 attempt number ``attempt`` (1-based) should hang until cancelled."""
    steps = _steps()
    if "load_timeout" not in steps:
        return False
    limit = steps["load_timeout"]
    return not limit or attempt <= int(limit)


def delay(step: str) -> float:
    """Seconds the environment asks ``step`` to be late by (``step:S``); 0.0 when it does not."""
    arg = _steps().get(step)
    return float(arg or 0.0) if arg is not None else 0.0
