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
promote and drains the canary's on rollback (controller/rollout_control.py).
The table changes first, so a replica never gets traffic its table entry
does not allow.

Every request needs ``Authorization: Bearer <admin key>``: the site's
``router.admin_key``, or else a key made for the run and written (mode 0600)
to ``<run or job directory>/admin.key``, where `exaserve rollout` and
`exaserve status` read it (`admin_key_for`). A version's checkpoint must pass
its manifest and lie under an allowed model root (`model_roots`): the site's
``weight_cache.l3_path`` and the directory holding each model's checkpoint
(``model_path``'s parent), after symbolic links are resolved, and must not be
writable by other users.

Swaps after the check (issue 25 item 6): the path is resolved once, then
opened component by component from ``/`` without following links; every
ancestor must be owned by root or us and not writable by others unless sticky,
the checkpoint directory and every file in it ours and not writable by others,
and no entry a link or special file. What was checked is then frozen: every
file is hard-linked, through the descriptor that was checked, into a
run-private directory (``<run dir>/rollouts/``, 0700; copied from the
descriptor where a link cannot be made), and that copy is verified and handed
to the fleet, so renaming or replacing anything on the original path after
``start`` changes nothing the replicas load. A path with a NUL byte, not
absolute, or too long is refused with 422.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import os
import re
import secrets
import shutil
import stat
from concurrent.futures import Future
from pathlib import Path
from typing import Callable, Collection, Optional

from fastapi import APIRouter, Header, HTTPException
from pydantic import BaseModel, Field

from exaserve_hpc.router.canary import Rollout, RolloutError, RolloutTable, check_version
from exaserve_hpc.controller.rollout_control import version_dir

ROUTE = "/v1/exaserve/rollouts"
ADMIN_KEY_FILE = "admin.key"

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


def admin_key_for(site, state_dir) -> str:
    """The deployment's admin key: the site's router.admin_key, else a new one for this run, written
    0600 to state_dir/admin.key (replacing any earlier run's) for `exaserve rollout` and `exaserve status`."""
    if site.router.admin_key:
        return site.router.admin_key
    key = secrets.token_urlsafe(32)
    path = Path(state_dir) / ADMIN_KEY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:  # a new file, so no earlier file's (or another user's) mode or owner carries over
        path.unlink()
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


def model_roots(site) -> list[Path]:
    """Where a rollout's checkpoint may lie: weight_cache.l3_path and each model's checkpoint's directory."""
    roots = {site.weight_cache.l3_dir, *(site.model_dir(m).parent for m in site.models)}
    return sorted({Path(os.path.realpath(r)) for r in roots})


MAX_PATH = 4096  # PATH_MAX
MAX_CHECKPOINT_ENTRIES = 100_000  # files and directories in one checkpoint
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def valid_path(model_dir: str) -> str:
    """The path as given, or 422: no NUL byte, absolute, not longer than PATH_MAX."""
    if not isinstance(model_dir, str) or not model_dir or "\x00" in model_dir:
        raise HTTPException(422, "checkpoint path is not a valid path (empty or holds a NUL byte)")
    if len(model_dir.encode(errors="surrogateescape")) > MAX_PATH:
        raise HTTPException(422, f"checkpoint path is longer than {MAX_PATH} bytes")
    if not os.path.isabs(model_dir):
        raise HTTPException(422, f"checkpoint path {model_dir!r} is not absolute; give the full path")
    return model_dir


def _unsafe_ancestor(info: os.stat_result) -> bool:
    """Another user could rename or replace entries of this directory: owned by someone else than root or us,
    or writable by group or others without the sticky bit."""
    if info.st_uid not in (0, os.getuid()):
        return True
    return bool(info.st_mode & _OTHERS_WRITE) and not info.st_mode & stat.S_ISVTX


def _not_ours(info: os.stat_result) -> bool:
    return info.st_uid != os.getuid() or bool(info.st_mode & _OTHERS_WRITE)


def open_checkpoint(model_dir: str, roots: list[Path]) -> tuple[str, int]:
    """Resolve ``model_dir`` once and open it along that path, checking every directory on the way.

    Returns (the resolved path, a descriptor of the checkpoint directory: the caller closes it). 403 outside the
    roots, under a directory another user may change, or for a checkpoint directory that is not ours or is
    writable by others; 422 for an invalid or unreadable path."""
    model_dir = valid_path(model_dir)
    try:
        real = Path(os.path.realpath(model_dir))
    except (OSError, ValueError) as exc:
        raise HTTPException(422, f"cannot resolve checkpoint path {model_dir!r}: {exc}") from exc
    if not any(real != root and real.is_relative_to(root) for root in roots):
        raise HTTPException(403, f"checkpoint {model_dir} is not under an allowed model root "
                                 f"({', '.join(map(str, roots))}: weight_cache.l3_path and the models' checkpoint "
                                 "directories); copy it there first")
    fd = os.open("/", _DIR_FLAGS)
    path = Path("/")
    try:
        for part in real.parts[1:]:
            info = os.fstat(fd)
            if _unsafe_ancestor(info):
                raise HTTPException(403, f"checkpoint {model_dir}: its directory {path} is owned by uid "
                                         f"{info.st_uid} or writable by others (mode {stat.filemode(info.st_mode)}"
                                         "), who could swap the checkpoint after it is verified; move it under a "
                                         "directory only you (or root, sticky) can change")
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:  # gone, or replaced by a link since it was resolved
                raise HTTPException(422 if exc.errno != errno.ELOOP else 403,
                                    f"cannot open checkpoint {model_dir} at {path / part}: "
                                    f"{exc.strerror}") from exc
            os.close(fd)
            fd, path = child, path / part
        info = os.fstat(fd)
        if _not_ours(info):
            raise HTTPException(403, f"checkpoint {model_dir} is owned by another user or writable by others "
                                     f"(mode {stat.filemode(info.st_mode)}); it could change after it is verified")
        return str(real), fd
    except BaseException:
        os.close(fd)
        raise


def check_location(model_dir: str, roots: list[Path]) -> None:
    """Refuse (403) a checkpoint outside the allowed roots or one another user could change under us."""
    os.close(open_checkpoint(model_dir, roots)[1])


def freeze_checkpoint(source_fd: int, shown: str, destination: Path) -> int:
    """Hard-link (else copy) every file under the open directory ``source_fd`` into ``destination`` (made
    here, 0700), each through the descriptor whose owner and mode were checked. 403 for a link, a special file,
    or a file not ours or writable by others. Returns the number of files."""
    count = [0]

    def walk(dir_fd: int, target: Path, relative: str) -> None:
        os.mkdir(target, 0o700)
        for entry in sorted(os.listdir(dir_fd)):
            count[0] += 1
            if count[0] > MAX_CHECKPOINT_ENTRIES:
                raise HTTPException(422, f"checkpoint {shown} holds more than {MAX_CHECKPOINT_ENTRIES} entries")
            name = f"{relative}{entry}"
            try:
                fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
            except OSError as exc:
                raise HTTPException(403 if exc.errno == errno.ELOOP else 422,
                                    f"checkpoint {shown}: {name} cannot be opened without following a link "
                                    f"({exc.strerror})") from exc
            try:
                info = os.fstat(fd)
                if stat.S_ISDIR(info.st_mode):
                    if _not_ours(info):
                        raise HTTPException(403, f"checkpoint {shown}: directory {name} is owned by another user "
                                                 f"or writable by others (mode {stat.filemode(info.st_mode)})")
                    walk(fd, target / entry, name + "/")
                    continue
                if not stat.S_ISREG(info.st_mode):
                    raise HTTPException(403, f"checkpoint {shown}: {name} is not a regular file")
                if _not_ours(info):
                    raise HTTPException(403, f"checkpoint {shown}: file {name} is owned by another user or "
                                             f"writable by others (mode {stat.filemode(info.st_mode)}); it could "
                                             "change after it is verified")
                try:  # the checked inode itself: its name in the checked directory, which only we can change
                    os.link(entry, target / entry, src_dir_fd=dir_fd, follow_symlinks=False)
                    linked = os.stat(target / entry, follow_symlinks=False)
                    if (linked.st_ino, linked.st_dev) != (info.st_ino, info.st_dev):
                        raise HTTPException(409, f"checkpoint {shown}: {name} changed while it was checked")
                except OSError:  # another filesystem, or links refused: copy what the descriptor reads
                    out = os.open(target / entry, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                    with os.fdopen(out, "wb") as dst, os.fdopen(os.dup(fd), "rb") as src:
                        src.seek(0)
                        shutil.copyfileobj(src, dst, 1 << 20)
            finally:
                os.close(fd)

    walk(source_fd, destination, "")
    return count[0]


def private_rollout_dir(private_root: Path, model: str, version: str) -> Path:
    """A new, unused name under the run-private ``private_root`` (made 0700 and checked to be ours)."""
    private_root.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(private_root)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise HTTPException(500, f"the run's rollout directory {private_root} is not a directory of ours")
    os.chmod(private_root, 0o700)
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", f"{model}@{version}")[:100]
    return private_root / f"{safe}.{secrets.token_hex(6)}"


def serving_admin_routes(site, router, controller, host: Optional[str] = None,
                         admin_key: Optional[str] = None) -> APIRouter:
    """The rollout routes of a running deployment: the router's table, the controller's fleet, the admin key
    (`admin_key_for`; None: the site's router.admin_key). A version's checkpoint defaults to the one next to
    the model's (`rollout_control.version_dir`). `host` is accepted for older callers and not used."""

    def resolve_dir(model: str, version: str) -> Optional[str]:
        path = version_dir(site, model, version)
        return str(path) if path is not None else None

    key = admin_key or site.router.admin_key
    if not key:
        raise ValueError("the admin routes need a key: pass admin_key_for(site, state_dir)")
    # the run's (or job's) own directory, on storage every node reads: the frozen copies of rollout checkpoints
    run_dir = getattr(getattr(controller, "fleet", None), "run_dir", None) or site.run_path
    return make_admin_router(router_apply(router), resolve_dir, admin_key=key,
                             on_change=controller.rollouts.changed, models=[m.model_name for m in site.models],
                             roots=model_roots(site), private_root=Path(run_dir) / "rollouts")


def make_admin_router(apply: Apply, resolve_dir: Callable[[str, str], Optional[str]] = lambda m, v: None,
                      admin_key: str = "", verify: Callable[[str], None] = check_version,
                      on_change: Optional[OnChange] = None, models: Optional[Collection[str]] = None,
                      roots: Optional[list[Path]] = None, private_root: Optional[Path] = None) -> APIRouter:
    """models: the served model names (None: any); a command for another model is refused with 404.
    admin_key: every request must carry it (an empty key refuses everyone). roots: where checkpoints
    may lie (None: anywhere; only for tests of the table). private_root: a run-private directory where a
    checked checkpoint is frozen (hard links or a copy) and from where it is verified and served (None: the
    checked path itself, opened again later: only for tests of the table)."""
    api = APIRouter()

    def authorize(authorization: Optional[str]) -> None:
        expected = f"Bearer {admin_key}".encode()
        if not admin_key or not hmac.compare_digest((authorization or "").encode(), expected):
            raise HTTPException(401, "admin routes need 'Authorization: Bearer <admin key>': the site's "
                                     f"router.admin_key, or the run's key in <run directory>/{ADMIN_KEY_FILE}")

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
        model_dir = valid_path(model_dir)
        frozen: Optional[Path] = None
        if roots is not None:
            model_dir, fd = open_checkpoint(model_dir, roots)  # what was checked is what the replicas load
            try:
                if private_root is not None:
                    frozen = private_rollout_dir(Path(private_root), body.model, body.version)
                    try:
                        try:
                            await asyncio.to_thread(freeze_checkpoint, fd, model_dir, frozen)
                        except OSError as exc:  # reading it, or writing the run's copy: said, not a traceback
                            raise HTTPException(500, f"cannot freeze checkpoint {model_dir} into {frozen}: "
                                                     f"{exc.strerror or exc}") from exc
                    except BaseException:
                        shutil.rmtree(frozen, ignore_errors=True)
                        raise
            finally:
                os.close(fd)
        checked = str(frozen) if frozen is not None else model_dir
        try:
            await asyncio.to_thread(verify, checked)
        except RolloutError as exc:
            if frozen is not None:
                shutil.rmtree(frozen, ignore_errors=True)
            raise HTTPException(exc.status, str(exc).replace(checked, model_dir)) from exc
        return checked

    return api

