"""`exaserve serve`: the whole system on this machine (the embedded default).

The control plane (control_plane.py, the same one rank 0 of `exaserve launch` builds): model
checkpoints (created on first use for tiny models), the router, the controller, one node agent
process (which starts one process per replica), and the HTTP gateway in the main thread. Ctrl-C,
SIGTERM or SIGUSR1 writes the controller's state to RUN_DIR/controller-state.h5, stops the gateway,
drains and stops every replica, and exits 0 once every child has exited.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .config import SiteConfig
from .control_plane import ControlPlane, ControlPlaneError, PlaneSettings, console

ServeError = ControlPlaneError


@dataclass
class ServeOptions:
    host: Optional[str] = None
    port: Optional[int] = None
    run_dir: Optional[Path] = None
    ready_timeout: float = 120.0


def serve(site: SiteConfig, options: ServeOptions) -> int:
    plane = ControlPlane(site, PlaneSettings(
        node=site.cluster.hostnames()[0], state_dir=options.run_dir or site.run_path, host=options.host,
        port=options.port))
    wanted = sum(site.initial_replicas(m) for m in site.models)
    threading.Thread(target=announce_when_ready, args=(plane.controller, plane.url, site, wanted,
                                                       options.ready_timeout), daemon=True).start()
    return plane.run()


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
        time.sleep(0.2)
    model = site.models[0].model_name
    sys.stdout.write(
        f"\nexaserve is serving {', '.join(m.model_name for m in site.models)} at {url}/v1\n"
        f"  try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"         -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello\"}}], "
        f"\"max_tokens\": 16}}'\n"
        f"  status: exaserve status    metrics: {url}/metrics    stop: Ctrl-C\n\n")
    sys.stdout.flush()
