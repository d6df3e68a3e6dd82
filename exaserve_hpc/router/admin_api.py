"""Admin HTTP routes of the router (the lead mounts them on the gateway app), and the `exaserve rollout` client.

    GET  /v1/exaserve/rollouts                      -> {"rollouts": [...]}
    POST /v1/exaserve/rollouts/{start|promote|rollback}
         {"model": M, "version": V, "weight": 0.05, "model_dir": "/path"}   (weight, model_dir: start only)

``start`` verifies the version's checkpoint against its checksum manifest
first (in a worker thread: it reads every byte) and refuses it with 422 if
that fails; only then does the version get traffic. Table changes run on the
router thread through ``apply`` (`ZmqRouter.call` in production), so the
dispatcher is never touched by two threads.

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
from typing import Callable, Optional

from fastapi import APIRouter, Header, HTTPException
from pydantic import BaseModel, Field

from .canary import RolloutError, RolloutTable, check_version

ROUTE = "/v1/exaserve/rollouts"

Apply = Callable[[Callable[[RolloutTable], object]], "Future"]
"""Run fn(rollout_table) where the table lives; returns a concurrent Future of its result."""


class RolloutCommand(BaseModel):
    model: str
    version: str
    weight: float = Field(0.05, gt=0, le=1)
    model_dir: Optional[str] = None  # checkpoint of the version; default: resolve_dir(model, version)


def router_apply(router) -> Apply:
    """`Apply` over a running ZmqRouter: the table is its dispatcher's."""
    return lambda fn: router.call(lambda dispatcher: fn(dispatcher.rollouts))


def make_admin_router(apply: Apply, resolve_dir: Callable[[str, str], Optional[str]] = lambda m, v: None,
                      admin_key: Optional[str] = None, verify: Callable[[str], None] = check_version) -> APIRouter:
    api = APIRouter()

    def authorize(authorization: Optional[str]) -> None:
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
        if action == "start":
            model_dir = body.model_dir or resolve_dir(body.model, body.version)
            if not model_dir:
                raise HTTPException(422, f"no checkpoint known for {body.model} version {body.version!r}; "
                                         "pass model_dir so it can be verified before it takes traffic")
            try:
                await asyncio.to_thread(verify, model_dir)
            except RolloutError as exc:
                raise HTTPException(exc.status, str(exc)) from exc
            rollout = await on_table(lambda t: t.start(body.model, body.version, body.weight))
        elif action == "promote":
            rollout = await on_table(lambda t: t.promote(body.model, body.version))
        elif action == "rollback":
            rollout = await on_table(lambda t: t.rollback(body.model, body.version))
        else:
            raise HTTPException(404, f"unknown rollout action {action!r}; use start, promote or rollback")
        return {"rollout": rollout.as_dict()}

    return api


# ---------------------------------------------------------------- CLI (`exaserve rollout ...`; the lead wires it)


def add_rollout_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["start", "promote", "rollback"])
    parser.add_argument("model")
    parser.add_argument("version")
    parser.add_argument("--weight", type=float, default=0.05, help="start: share of traffic for VERSION (0.05 = 5%%)")
    parser.add_argument("--model-dir", help="start: VERSION's checkpoint, verified before it takes traffic")
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
        try:
            detail = json.load(exc).get("detail", "")
        except ValueError:
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
