"""Quota groups as Slurm sees them: each group's account must exist and the job's user must be able to charge it.

``account_problems`` is pure (what sacctmgr said -> messages naming group, account and user);
``check_accounts`` asks the real ``sacctmgr`` through one seam (``run``) and raises AccountError listing
every problem. Rank 0 of `exaserve launch` calls it before it starts the controller: a group whose account is
missing or not the user's stops the job; Slurm accounting that cannot be asked (no slurmdbd) is a warning.
"""

from __future__ import annotations

import getpass
import logging
import subprocess
from typing import Callable, Optional

from exaserve_hpc.config.schema import SiteConfig

log = logging.getLogger("exaserve.quota")


class AccountError(Exception):
    """A quota group whose Slurm account cannot be used, or Slurm accounting that cannot be asked."""


class AccountingUnavailable(AccountError):
    """sacctmgr could not be asked (not installed, no slurmdbd, a timeout): nothing is known about the accounts."""


def _sacctmgr(args: list[str]) -> str:
    done = subprocess.run(["sacctmgr", "--noheader", "--parsable2", *args], capture_output=True, text=True,
                          timeout=30)
    if done.returncode != 0:
        raise AccountError(f"sacctmgr {' '.join(args)} failed (exit {done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()[:300]}")
    return done.stdout


def parse_column(text: str) -> set[str]:
    """The first field of each line of sacctmgr's --parsable2 --noheader output."""
    return {line.split("|", 1)[0].strip() for line in text.splitlines() if line.strip()}


def account_problems(groups: dict[str, str], user: str, existing: set[str], chargeable: set[str]) -> list[str]:
    """groups: quota group -> Slurm account. One message per group whose account is missing or not the user's."""
    problems = []
    for group, account in sorted(groups.items()):
        if account.lower() not in {a.lower() for a in existing}:  # sacctmgr stores account names in lower case
            problems.append(f"quota group {group!r}: Slurm account {account!r} does not exist "
                            "(sacctmgr show account); fix quota_groups[].account or ask the centre to create it")
        elif account.lower() not in {a.lower() for a in chargeable}:
            problems.append(f"quota group {group!r}: user {user!r} cannot charge Slurm account {account!r} (no "
                            f"association in sacctmgr show assoc where user={user}); ask the account's coordinator")
    return problems


def check_accounts(site, user: Optional[str] = None, run: Callable[[list[str]], str] = _sacctmgr) -> None:
    """Refuse (AccountError) a site whose quota groups name accounts that do not exist or the user cannot charge."""
    groups = {g.name: g.account for g in site.quota_groups if g.account}
    if not groups:
        return
    user = user or getpass.getuser()
    try:
        existing = parse_column(run(["show", "account", "format=account"]))
        chargeable = parse_column(run(["show", "assoc", "where", f"user={user}", "format=account,user"]))
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise AccountingUnavailable(f"cannot ask Slurm accounting about the accounts of quota groups "
                           f"({', '.join(sorted(set(groups.values())))}): {exc}") from exc
    except AccountError as exc:
        raise AccountingUnavailable(f"cannot check the Slurm accounts of quota groups "
                           f"({', '.join(sorted(set(groups.values())))}): {exc}") from exc
    problems = account_problems(groups, user, existing, chargeable)
    if problems:
        raise AccountError("; ".join(problems))


def check_quota_accounts(site: SiteConfig, **check) -> None:
    """Each quota group's Slurm account must exist and be the job user's to charge (issue: groups as Slurm
    sees them). Raises AccountError naming group, account and user; without Slurm accounting, only warns."""
    try:
        check_accounts(site, **check)  # check: the sacctmgr seam (run=, user=) for tests
    except AccountingUnavailable as exc:
        log.warning("%s; quota groups' accounts not checked", exc)
