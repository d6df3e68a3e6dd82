"""`exaserve keys add GROUP` and `exaserve usage`: the quota commands (registered in cli/main.py)."""

from __future__ import annotations

import argparse
import csv
import io
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from rich.table import Table

from exaserve_hpc.cli.console import err, load_site_arg, out
from exaserve_hpc.quota.keys import append_key_hash, hash_key, key_file_path, new_key
from exaserve_hpc.quota.ledger import BY_CHOICES, default_ledger_dirs, read_usage, summarize

USAGE_COLUMNS = ("requests", "prompt_tokens", "completion_tokens", "total_tokens", "gpu_seconds")


def add_keys_arguments(parser: argparse.ArgumentParser, site_help: str) -> None:
    actions = parser.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    add = actions.add_parser("add", help="make a new API key for a quota group; the key is printed once, "
                                         "only its hash is stored")
    add.add_argument("group")
    add.add_argument("--site", help=site_help)
    add.set_defaults(func=cmd_keys_add)


def cmd_keys_add(args: argparse.Namespace) -> int:
    site = load_site_arg(args.site)
    group = next((g for g in site.quota_groups if g.name == args.group), None)
    if group is None:
        names = ", ".join(g.name for g in site.quota_groups) or "none defined"
        err.print(f"[red]error[/]: no quota group {args.group!r} in site {site.site!r}; quota_groups: {names}",
                  highlight=False)
        return 2
    key = new_key()
    digest = hash_key(key)
    if group.key_file:
        path = key_file_path(group.key_file)
        append_key_hash(path, digest)
        err.print(f"added a key to quota group {group.name!r}: its hash is in {path} (the gateway reads it at "
                  "start); the key is printed below once and stored nowhere", highlight=False)
    else:
        err.print(f"quota group {group.name!r} has no key_file; add this line to its api_key_hashes in the site "
                  f"file, then restart the gateway:\n  - \"{digest}\"\nThe key is printed below once and stored "
                  "nowhere", highlight=False, markup=False)
    print(key)
    return 0


def add_usage_arguments(parser: argparse.ArgumentParser, site_help: str) -> None:
    parser.add_argument("--site", help=site_help)
    parser.add_argument("--dir", help="the ledger directory (default: usage_dir, else <run_dir>/usage)")
    parser.add_argument("--since", help="from this time on: YYYY-MM-DD[THH:MM[:SS]] (UTC) or Unix seconds")
    parser.add_argument("--until", help="before this time (same forms)")
    parser.add_argument("--by", choices=BY_CHOICES, default="group", help="one row per (default group)")
    parser.add_argument("--csv", action="store_true", help="CSV on stdout, for an allocation bank to load")
    parser.set_defaults(func=cmd_usage)


def parse_time(text: Optional[str], flag: str) -> Optional[float]:
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: allowed: YYYY-MM-DD, YYYY-MM-DDTHH:MM[:SS] (UTC unless an offset "
                         "is given) or Unix seconds") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def cmd_usage(args: argparse.Namespace) -> int:
    candidates = [Path(args.dir).expanduser()] if args.dir else default_ledger_dirs(load_site_arg(args.site))
    directories = [d for d in candidates if d.is_dir()]
    if not directories:
        err.print(f"[red]error[/]: no usage ledger at {' or '.join(map(str, candidates))} (nothing served yet, or "
                  "pass --dir or set usage_dir)", highlight=False)
        return 1
    directory = ", ".join(map(str, directories))
    records = (record for d in directories for record in read_usage(d))
    rows = summarize(records, by=args.by, since=parse_time(args.since, "--since"),
                     until=parse_time(args.until, "--until"))
    if args.csv:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=(args.by, *USAGE_COLUMNS), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        sys.stdout.write(buffer.getvalue())
        return 0
    table = Table(title=f"usage by {args.by} ({directory})")
    for column in (args.by, *USAGE_COLUMNS):
        table.add_column(column, justify="left" if column == args.by else "right")
    for row in rows:
        table.add_row(*(str(row[c]) for c in (args.by, *USAGE_COLUMNS)))
    out.print(table)
    return 0
