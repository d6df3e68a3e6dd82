"""`exaserve serve`: the whole system on this machine (the embedded default).

The control plane (app/control_plane.py, the same one rank 0 of `exaserve launch` builds): model
checkpoints (created on first use for tiny models), the router, the controller, one node agent
process (which starts one process per replica), and the HTTP gateway in the main thread. Ctrl-C,
SIGTERM or SIGUSR1 writes the controller's state to RUN_DIR/controller-state.h5, stops the gateway,
drains and stops every replica, and exits 0 once every child has exited.

Other users of this machine are kept out (loopback is not private on a shared login node): the run
directory is made 0700, and CURVE keys made for this run in RUN_DIR/keys (0600) make the router's
frontend and backend, the controller and the replicas' pipeline-stage links admit only this run's
client key, which the agent, the gateway and the replicas read from there (transport.py). A peer
without it is refused at the handshake and logged once per key.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from exaserve_hpc.agent.node_agent import L2_RUN_VARIABLE
from exaserve_hpc.app.control_plane import ControlPlane, ControlPlaneError, PlaneSettings, console
from exaserve_hpc.config.schema import SiteConfig
from exaserve_hpc.engine.block_manager import install_block_hash_salt
from exaserve_hpc.jobdir import JobDir
from exaserve_hpc.quota.keys import key_file_problems
from exaserve_hpc.transport import CURVE_JOB_DIR_VARIABLE, curve_available, make_curve_keys

ServeError = ControlPlaneError


@dataclass
class ServeOptions:
    host: Optional[str] = None
    port: Optional[int] = None
    run_dir: Optional[Path] = None
    ready_timeout: float = 120.0


def private_run_dir(path: Path) -> JobDir:
    """The run directory, 0700 (made so if it was not), with its keys/ directory (0700).

    An existing directory is made private only when it is ours and not a shared one (sticky and
    writable by others, like /tmp): that one is refused rather than closed to everybody else."""
    path = Path(path)
    try:
        info = path.stat()
    except FileNotFoundError:
        info = None
    except OSError as exc:
        raise ServeError(f"cannot use the run directory {path}: {exc.strerror}") from exc
    if info is not None and (info.st_uid != os.getuid() or info.st_mode & 0o1002 == 0o1002):
        raise ServeError(f"the run directory {path} is {'shared' if info.st_uid == os.getuid() else 'not yours'}; "
                         "set run_dir or --run-dir to a directory of its own (it is made 0700)")
    try:
        return JobDir(path).ensure()
    except OSError as exc:
        raise ServeError(f"cannot make the run directory {path} private (0700): {exc.strerror}; set run_dir "
                         f"or --run-dir to a directory of yours") from exc


def run_keys(run_dir: JobDir):
    """This run's CURVE keys, new at every start (a key read by a process of an earlier run is no use)."""
    if not curve_available():
        raise ServeError("this libzmq has no CURVE support, which exaserve serve needs to keep other users of "
                         "the machine off its sockets; install pyzmq from its wheels (they bundle libsodium)")
    return make_curve_keys(run_dir)


def l2_run(run_dir: Path) -> str:
    """The L2 identity of the server whose run directory this is: a digest of its resolved path."""
    return "serve-" + hashlib.blake2b(os.path.realpath(run_dir).encode(), digest_size=6).hexdigest()


def serve(site: SiteConfig, options: ServeOptions) -> int:
    # Whatever this server, its agent and replicas create (KV snapshots, L2 files, tiny checkpoints, logs)
    # is the user's own: 0700 directories, 0600 files (issue 13 item 14).
    os.umask(0o077)
    if problems := key_file_problems(site):  # before the run directory exists: nothing is left behind
        raise ServeError("; ".join(problems))
    run_dir = private_run_dir(options.run_dir or site.run_path)
    keys = run_keys(run_dir)
    install_block_hash_salt(run_dir)  # made with the keys: this run's router and gateway hash as its replicas do
    # The run's identity in its L2 directory (agent/node_agent.py default_l2_root; the agent inherits it): two
    # servers of this user never share, adopt or clear each other's L2 files; a restart finds its own.
    os.environ[L2_RUN_VARIABLE] = l2_run(run_dir.path)
    plane = ControlPlane(site, PlaneSettings(
        node=site.cluster.hostnames()[0], state_dir=run_dir.path, host=options.host, port=options.port,
        curve=keys, replica_env={CURVE_JOB_DIR_VARIABLE: str(run_dir.path.absolute())}))
    wanted = sum(site.initial_replicas(m) for m in site.models)
    threading.Thread(target=announce_when_ready, args=(plane.controller, plane.url, site, wanted,
                                                       options.ready_timeout), daemon=True).start()
    return plane.run()


def placed_count(controller) -> int:
    """Replicas the controller has placed on a node (the others wait for room: controller/cpu_bound.py)."""
    with controller.fleet.lock:
        return sum(r.assignment is not None for r in controller.replicas.values())


def announce_when_ready(controller, url: str, site: SiteConfig, wanted: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = -1
    while time.monotonic() < deadline:
        serving = controller.serving_count()
        if serving != last:
            console.print(f"replicas serving: {serving}/{wanted}")
            last = serving
        if serving >= wanted:
            break
        placed = placed_count(controller)
        if placed and serving >= placed:  # the rest have no room (the node's CPU bound, memory): not awaited
            break
        time.sleep(0.2)
    model = site.models[0].model_name
    sys.stdout.write(
        f"\nexaserve is serving {', '.join(m.model_name for m in site.models)} at {url}/v1\n"
        f"  try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"         -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], "
        f"\"max_tokens\": 16}}'\n"
        f"  status: exaserve status    metrics: {url}/metrics    stop: Ctrl-C\n\n")
    sys.stdout.flush()
