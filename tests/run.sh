#!/usr/bin/env bash
# Install everything the test suite needs, then run it. This is the README's
# test command and what CI runs (.ci/run).
#   bash tests/run.sh [pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages for the tests that use real components: MPI, Slurm 22.05 + munge (the local test
# cluster, tests/slurm/cluster.sh, which the Slurm tests bring up and down themselves: iproute2 for its
# network namespaces, util-linux for nsenter/unshare, libpmix2 for srun --mpi=pmix), Lmod, Prometheus
# (prometheus and promtool: the alert rules' tests and a real Prometheus scraping exaserve serve), etcd
# (etcd-server 3.4: the control-plane HA tests start a 3-member cluster, tests/ha/; openssl makes its
# certificates), haproxy (docs/slurm.md's proxy recipe in front of HA gateway candidates, through a failover), gcc and the
# Python headers (pip install -e . compiles the router's prefix index and route, router/_*.pyx).
DEBIAN_PACKAGES=(openmpi-bin libopenmpi-dev slurm-wlm munge lmod iproute2 util-linux libpmix2 prometheus slurmdbd mariadb-server etcd-server openssl haproxy gcc python3-dev)
missing=()
for pkg in "${DEBIAN_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "installing Debian packages: ${missing[*]}"
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e '.[test,mpi,sim]'

# Under CI=true a test that needs Slurm, MPI, Lmod or Prometheus must run, not skip: conftest.py turns such skips into failures.
exec .venv/bin/python -m pytest "$@"
