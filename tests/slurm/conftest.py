"""The local Slurm test cluster, brought up once per session for tests marked `slurm`.

Tests that need it take the `slurm_cluster` fixture: it runs tests/slurm/cluster.sh up (root,
Debian's slurm-wlm, munge and iproute2: four nodes, each in its own network and mount namespace, GRES
GPUs, cgroups), points SLURM_CONF at it, and brings the cluster down at the end
(EXASERVE_KEEP_CLUSTER=1 leaves it up). A node's /tmp is its own, so a job's files go in the
`shared_tmp` fixture's directory (the cluster's stand-in for a shared filesystem). If it cannot come up the error carries the daemon logs;
without root or Slurm the tests skip, which under CI=true is a failure (tests/conftest.py).
"""

from __future__ import annotations

import os
import shutil

import pytest

from .fleet import SLURM_DIR, cluster, remove_shared_dir, shared_dir


@pytest.fixture(scope="session")
def slurm_cluster():
    if os.geteuid() != 0:
        pytest.skip("the local Slurm test cluster needs root (tests/slurm/cluster.sh)")
    missing = [c for c in ("slurmctld", "slurmd", "munged", "sbatch") if not shutil.which(c)
               and not os.path.exists(f"/usr/sbin/{c}")]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge")
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(SLURM_DIR / "slurm.conf")
    cluster("up")  # raises with slurmctld/slurmd logs if it cannot come up
    yield SLURM_DIR
    if not os.environ.get("EXASERVE_KEEP_CLUSTER"):
        cluster("down", check=False)
    if previous is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = previous


@pytest.fixture
def shared_tmp(slurm_cluster, request):
    """A directory every virtual node sees (their /tmp is private, as on real nodes): a job's site file
    and job root go here. Removed after the test."""
    path = shared_dir(request.node.name[:40])
    yield path
    remove_shared_dir(path)
