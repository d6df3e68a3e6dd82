"""`exaserve rollout start|promote|rollback MODEL VERSION`: a client of the gateway's admin routes
(gateway/admin_api.py), authenticated with the admin key."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

from exaserve_hpc.cli.console import load_site_arg, running_server_url
from exaserve_hpc.gateway.admin_api import ADMIN_KEY_FILE, ROUTE


def add_rollout_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["start", "promote", "rollback"])
    parser.add_argument("model")
    parser.add_argument("version")
    parser.add_argument("--weight", type=float, default=0.05, help="start: share of traffic for VERSION (0.05 = 5%%)")
    parser.add_argument("--model-dir", help="start: VERSION's checkpoint, verified before it takes traffic "
                                            "(default: the model's checkpoint directory + '@VERSION')")
    parser.add_argument("--url", help="gateway URL (default: the running server recorded in run_dir)")
    parser.add_argument("--site")
    parser.add_argument("--run-dir")
    parser.add_argument("--admin-key", default=os.environ.get("EXASERVE_ADMIN_KEY"),
                        help=f"router admin key (default: $EXASERVE_ADMIN_KEY, else the run's {ADMIN_KEY_FILE} "
                             "in run_dir)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds (start verifies the checkpoint)")


def admin_headers(args: argparse.Namespace) -> dict[str, str]:
    """Authorization with the admin key: --admin-key / $EXASERVE_ADMIN_KEY, else the running server's
    admin.key in --run-dir (or the site's run_dir); none when neither is there (the server says 401)."""
    key = getattr(args, "admin_key", None) or os.environ.get("EXASERVE_ADMIN_KEY")
    if not key:
        try:
            if getattr(args, "run_dir", None):
                run_dir = Path(args.run_dir).expanduser()
            else:
                run_dir = load_site_arg(getattr(args, "site", None)).run_path
            key = (run_dir / ADMIN_KEY_FILE).read_text().strip()
        except (Exception, SystemExit):  # no readable key file, no loadable site: send none
            return {}
    return {"Authorization": f"Bearer {key}"}


def cmd_rollout(args: argparse.Namespace) -> int:
    body = {"model": args.model, "version": args.version}
    if args.action == "start":
        body["weight"] = args.weight
        if args.model_dir:
            body["model_dir"] = os.path.abspath(args.model_dir)
    url = f"{running_server_url(args)}{ROUTE}/{args.action}"
    headers = {"Content-Type": "application/json", **admin_headers(args)}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as response:
            rollout = json.load(response)["rollout"]
    except urllib.error.HTTPError as exc:
        try:  # FastAPI's {"detail": ...}, or the gateway's OpenAI-shaped {"error": {"message": ...}}
            answer = json.load(exc)
            detail = answer.get("detail") or answer.get("error", {}).get("message", "")
        except (ValueError, AttributeError):
            detail = exc.reason
        print(f"error: rollout {args.action} {args.model} {args.version} refused ({exc.code}): {detail}",
              file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"error: cannot reach exaserve at {url}: {getattr(exc, 'reason', exc)}", file=sys.stderr)
        return 1
    if rollout["canary"]:
        print(f"{rollout['model']}: {rollout['weight']:.0%} to {rollout['canary']}, "
              f"the rest to {rollout['stable'] or 'the current version'}")
    else:
        print(f"{rollout['model']}: all traffic to {rollout['stable'] or 'the current version'}")
    return 0
