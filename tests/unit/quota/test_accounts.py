"""Quota groups' Slurm accounts: the pure check, the sacctmgr seam, and the real sacctmgr of this machine."""

from __future__ import annotations

import shutil

import pytest

from exaserve_hpc.config.schema import parse_site
from exaserve_hpc.batch.slurm.accounts import AccountError, account_problems, check_accounts, parse_column

SITE = parse_site({"site": "s", "models": [{"model_name": "m"}],
                   "quota_groups": [{"name": "climate", "account": "clim001"}, {"name": "bio", "account": "bio002"},
                                    {"name": "free"}]})


def test_missing_and_unchargeable_accounts_are_named_with_group_and_user():
    problems = account_problems({"climate": "clim001", "bio": "bio002", "phys": "Phys3"}, "alice",
                                existing={"clim001", "phys3"}, chargeable={"clim001", "phys3"})
    assert problems == ["quota group 'bio': Slurm account 'bio002' does not exist (sacctmgr show account); fix "
                        "quota_groups[].account or ask the centre to create it"]
    problems = account_problems({"bio": "bio002"}, "alice", existing={"bio002"}, chargeable=set())
    assert len(problems) == 1 and "user 'alice' cannot charge Slurm account 'bio002'" in problems[0]


def test_check_asks_sacctmgr_through_its_seam():
    asked = []

    def sacctmgr(args):
        asked.append(args)
        return "clim001|\nbio002|\n" if args[1] == "account" else "clim001|alice\n"

    with pytest.raises(AccountError, match="user 'alice' cannot charge Slurm account 'bio002'"):
        check_accounts(SITE, user="alice", run=sacctmgr)
    assert asked[1] == ["show", "assoc", "where", "user=alice", "format=account,user"]
    assert parse_column("a|x\n\nb|y\n") == {"a", "b"}


@pytest.mark.skipif(shutil.which("sacctmgr") is None, reason="no sacctmgr on this machine")
def test_the_real_sacctmgr_without_accounting_is_a_clear_refusal_naming_the_accounts():
    # The local test cluster runs without slurmdbd (AccountingStorageType=none): sacctmgr refuses, and so do we.
    try:
        check_accounts(SITE, user="nobody-here")
    except AccountError as exc:
        assert "bio002" in str(exc) and "clim001" in str(exc)
    else:
        pytest.skip("this machine has Slurm accounting: covered by the cluster tests")


def test_rank_0_refuses_a_group_whose_account_is_not_the_users_and_only_warns_without_accounting(caplog):
    from exaserve_hpc.batch.slurm.accounts import AccountingUnavailable, check_quota_accounts

    def known(args):
        return "clim001|\nbio002|\n" if args[1] == "account" else "clim001|alice\n"

    with pytest.raises(AccountError, match="'bio002'") as caught:
        check_quota_accounts(SITE, user="alice", run=known)
    assert not isinstance(caught.value, AccountingUnavailable)

    def no_slurmdbd(args):
        raise AccountError("sacctmgr show account failed (exit 1): Connection refused")

    with caplog.at_level("WARNING", logger="exaserve.launch"):
        check_quota_accounts(SITE, user="alice", run=no_slurmdbd)  # a warning, not a refusal
    assert "not checked" in caplog.text and "clim001" in caplog.text
