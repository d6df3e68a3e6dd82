"""The gateway's HTTP server: its listening socket and a uvicorn server whose stop never cuts a stream.

    sock = listen_socket(host, port)                   # bound here: port 0 works, a busy port is a clear error
    server = gateway_server(app, on_signal=..., grace=site.gateway.stop_grace, limits=HttpLimits.from_site(site))
    server.run(sockets=[sock])
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from typing import Callable

import uvicorn

from exaserve_hpc.gateway.http_limits import ConnectionGuard, HttpLimits, raise_fd_limit

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class StartError(Exception):
    """A problem that stops a control plane or a gateway before it serves; the message names the setting."""


def listen_socket(host: str, port: int, setting: str = "gateway.port"):
    """Bind the gateway's socket ourselves, so port 0 works and a busy port is a clear error at start."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise StartError(f"cannot listen on {host}:{port}: {exc.strerror}; choose another port with "
                                f"--port (0 picks a free one) or set {setting}") from exc
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


def gateway_server(app, on_signal: Callable[[int], None] = lambda sig: None, *, grace: float = 10.0,
                   limits=None, **config):
    """A uvicorn server that stops on SIGINT, SIGTERM and SIGUSR1 and returns, so our shutdown runs.

    uvicorn re-raises the captured signal after its own shutdown, which would kill this process
    before the replicas are drained; we take that part out. on_signal(sig) runs first, in the handler
    (only when run in the main thread; a gateway in another thread is stopped with should_exit).

    Its stop never cuts a stream (issue 25 item 7): new connections are refused at once (the listener
    closes), requests already open get `grace` seconds (gateway.stop_grace) to finish, and those still
    open then end as the app's stop gate ends them (gateway/generation.py StopGate: an SSE error event
    `server_stopping` and `data: [DONE]`, or a 503), so uvicorn's own cut (its timeout_graceful_shutdown,
    a cancellation and a traceback per stream) is only a backstop 5 s later.
    `limits` (http_limits.HttpLimits; default the class's): the connection cap and timeouts.
    """


    raise_fd_limit()
    limits = limits or HttpLimits()
    guard = ConnectionGuard(limits)
    gate = getattr(getattr(app, "state", None), "stop_gate", None)

    class GatewayServer(uvicorn.Server):
        async def shutdown(self, sockets=None):
            timer = None
            if gate is not None:
                gate.stopping = True  # new requests on open connections: 503; /health: 503

                def end_open_requests() -> None:
                    ended = gate.interrupt_all(f"the server is stopping and the request did not finish within "
                                               f"the stop grace ({grace:g}s, gateway.stop_grace); retry it")
                    if ended:
                        print(f"exaserve: stop grace ({grace:g}s) over: {ended} open request(s) ended with an "
                              "error event", flush=True)
                timer = asyncio.get_running_loop().call_later(grace, end_open_requests)
            try:
                await super().shutdown(sockets)
            finally:
                if timer is not None:
                    timer.cancel()

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return

            def handle(sig, frame):
                on_signal(sig)
                self.handle_exit(sig if sig == signal.SIGINT else signal.SIGTERM, frame)

            previous = {sig: signal.signal(sig, handle) for sig in STOP_SIGNALS}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    config.setdefault("log_config", None)  # uvicorn's lines go through our handlers (rate-limited, logs.py)
    config.setdefault("timeout_keep_alive", max(1, int(limits.keep_alive_timeout)))
    config["timeout_graceful_shutdown"] = int(grace) + 5  # the backstop (see above)
    server = GatewayServer(uvicorn.Config(app, http=guard.protocol_class(), **config))
    server.guard = guard
    return server
