"""What every command shares: the consoles it prints to, loading `--site`, and finding the running server."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from rich.console import Console

from exaserve_hpc.config.schema import SiteConfig, load_site, resolve_site

# Piped output (scripts, logs) gets wide tables rather than truncated cells.
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, soft_wrap=True)


def load_site_arg(site_arg: Optional[str]) -> SiteConfig:
    """The site a command's --site names (a path or a name on the site search path)."""
    return load_site(resolve_site(site_arg))


def running_server_url(args: argparse.Namespace) -> str:
    if args.url:
        return args.url.rstrip("/")
    run_dir = Path(args.run_dir).expanduser() if args.run_dir else load_site_arg(args.site).run_path
    state = run_dir / "serve.json"
    try:
        return json.loads(state.read_text())["url"]
    except (OSError, ValueError, KeyError):
        raise SystemExit(f"no running exaserve found ({state} is missing); start one with `exaserve serve` "
                         f"or pass --url http://HOST:PORT") from None
