"""Admin HTTP routes of the router (mounted on the gateway app by `serving_admin_routes`), and the
`exaserve rollout` client.

    GET  /v1/exaserve/rollouts                      -> {"rollouts": [...]}
    POST /v1/exaserve/rollouts/{start|promote|rollback}
         {"model": M, "version": V, "weight": 0.05, "model_dir": "/path"}   (weight, model_dir: start only)

``start`` verifies the version's checkpoint against its checksum manifest
first (in a worker thread: it reads every byte) and refuses it with 422 if
that fails; only then does the version get traffic. Table changes run on the
router thread through ``apply`` (`ZmqRouter.call` in production), so the
dispatcher is never touched by two threads. Right after a change, on that
thread (so in table order), ``on_change`` tells the fleet: the controller's
`RolloutFleet` starts the canary's replicas, replaces the old version's on
promote and drains the canary's on rollback (scheduler/rollout_control.py).
The table changes first, so a replica never gets traffic its table entry
does not allow.

When ``admin_key`` is set, requests need ``Authorization: Bearer <admin_key>``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import urllib.error
import urllib.request
from concurrent.futures import Future
from typing import Callable, Collection, Optional

from fastapi import APIRouter, Header, HTTPException
from pydantic import BaseModel, Field

from .canary import Rollout, RolloutError, RolloutTable, check_version

ROUTE = "/v1/exaserve/rollouts"

Apply = Callable[[Callable[[RolloutTable], object]], "Future"]
"""Run fn(rollout_table) where the table lives; returns a concurrent Future of its result."""

OnChange = Callable[[str, Rollout, str, Optional[str]], None]
"""(action, the rollout after it, the command's version, the verified model_dir on start): called once the
table changed, on the table's thread (it must not block)."""


class RolloutCommand(BaseModel):
    model: str
    version: str
    weight: float = Field(0.05, gt=0, le=1)
    model_dir: Optional[str] = None  # checkpoint of the version; default: resolve_dir(model, version)


def router_apply(router) -> Apply:
    """`Apply` over a running ZmqRouter: the table is its dispatcher's."""
    return lambda fn: router.call(lambda dispatcher: fn(dispatcher.rollouts))


def serving_admin_routes(site, router, controller, host: Optional[str] = None) -> APIRouter:
    """The rollout routes of a running deployment: the router's table, the controller's fleet, the site's key.
    A version's checkpoint defaults to the one next to the model's (`rollout_control.version_dir`).
    `host`: the address the gateway really listens on (a --host flag overrides the site's)."""
    from ..scheduler.rollout_control import version_dir

    def resolve_dir(model: str, version: str) -> Optional[str]:
        path = version_dir(site, model, version)
        return str(path) if path is not None else None

    host = host or site.gateway.host
    local = host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")
    return make_admin_router(router_apply(router), resolve_dir, admin_key=site.router.admin_key,
                             on_change=controller.rollouts.changed, models=[m.model_name for m in site.models],
                             keyless=None if local else host)


def make_admin_router(apply: Apply, resolve_dir: Callable[[str, str], Optional[str]] = lambda m, v: None,
                      admin_key: Optional[str] = None, verify: Callable[[str], None] = check_version,
                      on_change: Optional[OnChange] = None, models: Optional[Collection[str]] = None,
                      keyless: Optional[str] = None) -> APIRouter:
    """models: the served model names (None: any); a command for another model is refused with 404.
    keyless: the non-loopback address the gateway listens on, if any; without an admin key the
    routes then refuse everyone (403), since anyone who can reach the gateway could change traffic."""
    api = APIRouter()

    def authorize(authorization: Optional[str]) -> None:
        if not admin_key and keyless:
            raise HTTPException(403, f"the gateway listens on {keyless}, beyond this machine, and no admin key "
                                     "is set; set router.admin_key in the site config to use the admin routes")
        if admin_key and authorization != f"Bearer {admin_key}":
            raise HTTPException(401, "admin routes need 'Authorization: Bearer <admin key>' "
                                     "(the site's router admin key)")

    async def on_table(fn: Callable[[RolloutTable], object]):
        try:
            return await asyncio.wrap_future(apply(fn))
        except RolloutError as exc:
            raise HTTPException(exc.status, str(exc)) from exc

    @api.get(ROUTE)
    async def list_rollouts(authorization: Optional[str] = Header(None)) -> dict:
        authorize(authorization)
        return {"rollouts": await on_table(lambda t: t.snapshot())}

    @api.post(ROUTE + "/{action}")
    async def command(action: str, body: RolloutCommand, authorization: Optional[str] = Header(None)) -> dict:
        authorize(authorization)
        if action not in ("start", "promote", "rollback"):
            raise HTTPException(404, f"unknown rollout action {action!r}; use start, promote or rollback")
        if models is not None and body.model not in models:
            raise HTTPException(404, f"model {body.model!r} is not served here; served models: "
                                     f"{', '.join(sorted(models))}")
        model_dir = await verified_dir(body) if action == "start" else None

        def change(table: RolloutTable) -> Rollout:
            if action == "start":
                rollout = table.start(body.model, body.version, body.weight)
            else:
                rollout = getattr(table, action)(body.model, body.version)  # promote, rollback
            if on_change is not None:  # still where the table lives: the fleet hears changes in table order
                on_change(action, rollout, body.version, model_dir)
            return rollout

        return {"rollout": (await on_table(change)).as_dict()}

    async def verified_dir(body: RolloutCommand) -> str:
        model_dir = body.model_dir or resolve_dir(body.model, body.version)
        if not model_dir:
            raise HTTPException(422, f"no checkpoint known for {body.model} version {body.version!r}; "
                                     "pass model_dir so it can be verified before it takes traffic")
        try:
            await asyncio.to_thread(verify, model_dir)
        except RolloutError as exc:
            raise HTTPException(exc.status, str(exc)) from exc
        return model_dir

    return api


# ---------------------------------------------------------------- CLI (`exaserve rollout ...`; the lead wires it)


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
                        help="router admin key (default: $EXASERVE_ADMIN_KEY)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds (start verifies the checkpoint)")


def cmd_rollout(args: argparse.Namespace) -> int:
    body = {"model": args.model, "version": args.version}
    if args.action == "start":
        body["weight"] = args.weight
        if args.model_dir:
            body["model_dir"] = os.path.abspath(args.model_dir)
    from ..cli import running_server_url  # --url, else the server recorded in run_dir
    url = f"{running_server_url(args)}{ROUTE}/{args.action}"
    headers = {"Content-Type": "application/json"}
    if args.admin_key:
        headers["Authorization"] = f"Bearer {args.admin_key}"
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
