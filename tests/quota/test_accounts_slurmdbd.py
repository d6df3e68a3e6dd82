"""Quota groups' Slurm accounts against real Slurm accounting: MariaDB and slurmdbd brought up by
tests/slurm/accounting.sh (and stopped by it after the module), accounts and associations made with
sacctmgr, checked by the real sacctmgr."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from exaserve_hpc.config.schema import parse_site
from exaserve_hpc.batch.slurm.accounts import AccountError, check_accounts

pytestmark = pytest.mark.slurm

SCRIPT = Path(__file__).resolve().parents[1] / "slurm" / "accounting.sh"
USER = f"exaq{os.getpid()}"


@pytest.fixture(scope="module")
def accounting(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("Slurm accounting for tests needs root (tests/slurm/accounting.sh)")
    missing = [c for c in ("slurmdbd", "mariadbd", "sacctmgr", "munge") if not shutil.which(c)
               and not os.path.exists(f"/usr/sbin/{c}")]
    if missing:
        pytest.skip(f"missing {', '.join(missing)}: apt-get install slurmdbd mariadb-server munge")
    previous = os.environ.get("SLURM_CONF")
    try:  # MariaDB and slurmdbd go down again whatever happens from here (a half-finished `up` included)
        up = subprocess.run([str(SCRIPT), "up"], capture_output=True, text=True, timeout=180)
        assert up.returncode == 0, up.stdout + up.stderr
        conf = up.stdout.strip().splitlines()[-1].split("=", 1)[1]
        os.environ["SLURM_CONF"] = conf

        def sacctmgr(*args: str) -> None:
            done = subprocess.run(["sacctmgr", "-i", *args], capture_output=True, text=True, timeout=60)
            assert done.returncode == 0 or "Nothing new added" in done.stdout + done.stderr, done.stdout + done.stderr

        sacctmgr("add", "account", "clim001", "cluster=exaacct")
        sacctmgr("add", "account", "bio002", "cluster=exaacct")
        sacctmgr("add", "user", USER, "account=clim001", "cluster=exaacct")
        yield conf
        subprocess.run(["sacctmgr", "-i", "delete", "user", USER], capture_output=True, timeout=60)
    finally:
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        down = subprocess.run([str(SCRIPT), "down"], capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, f"accounting.sh down left a daemon running: {down.stdout + down.stderr}"


def site(groups: list[dict]):
    return parse_site({"site": "acct", "models": [{"model_name": "m"}], "quota_groups": groups})


def test_an_account_the_user_may_charge_passes(accounting):
    check_accounts(site([{"name": "climate", "account": "clim001"}]), user=USER)


def test_an_account_the_user_cannot_charge_is_refused_naming_both(accounting):
    with pytest.raises(AccountError) as refused:
        check_accounts(site([{"name": "climate", "account": "clim001"}, {"name": "bio", "account": "bio002"}]),
                       user=USER)
    assert f"user '{USER}' cannot charge Slurm account 'bio002'" in str(refused.value)
    assert "clim001" not in str(refused.value)


def test_a_missing_account_is_refused_naming_group_and_account(accounting, tmp_path):
    groups = [{"name": "physics", "account": "nosuch9"}]
    with pytest.raises(AccountError, match="quota group 'physics': Slurm account 'nosuch9' does not exist"):
        check_accounts(site(groups), user=USER)
    # the command an operator (or the batch script) runs before starting
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump({"site": "acct", "models": [{"model_name": "m"}], "quota_groups": groups}))
    done = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "config", "check", "--accounts", str(path)],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "USER": USER})
    assert done.returncode == 2 and "'nosuch9' does not exist" in done.stderr, done.stdout + done.stderr
