"""Suite-wide rules.

Under CI=true a test that needs a real outside component (Slurm, MPI, Lmod)
must run (Prometheus included): if it skips because the component is missing, that is a failure of
the CI setup, not a pass.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

REAL_COMPONENT_MARKERS = ("slurm", "mpi", "lmod", "prometheus")


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


# CI replays the same examples every run (a new counterexample is found locally, not in a landing),
# and no example fails for being slow on a busy 2-core machine.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if _in_ci() else "dev")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    needs = [m for m in REAL_COMPONENT_MARKERS if item.get_closest_marker(m)]
    if report.skipped and needs and _in_ci():
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.longrepr = f"CI=true: a test that needs {', '.join(needs)} must run, but it was skipped: {reason}"
