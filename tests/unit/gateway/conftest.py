"""Fixtures: a real uvicorn server running the gateway over a FakeBackend.

The server runs in a background thread on 127.0.0.1, on a socket bound to
port 0 before uvicorn starts (no race for a "free" port), and is stopped
cleanly (should_exit, thread joined) when the test ends.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import openai
import pytest
import uvicorn

from exaserve_hpc.config.schema import SiteConfig, parse_site
from exaserve_hpc.gateway.backend import ModelInfo
from exaserve_hpc.gateway.app import create_app
from tests.unit.gateway.fake_backend import FakeBackend

MODEL = "tiny-echo"
MAX_SEQ_LEN = 256


@dataclass
class RunningGateway:
    url: str  # http://127.0.0.1:PORT
    backend: FakeBackend
    site: SiteConfig

    def client(self, api_key: str = "unused", **kwargs: Any) -> openai.OpenAI:
        # max_retries=0: the official client retries 429/5xx by default, which would hide
        # the status under test and send the request twice.
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=10, **kwargs)


def make_site(gateway: Optional[dict] = None, quota_groups: Optional[list] = None,
              other_min_replicas: Optional[int] = None) -> SiteConfig:
    return parse_site({
        "site": "gateway-test",
        # echo: an engine without weights, so the gateway tokenizes with the byte tokenizer the fake backend echoes
        "models": [{"model_name": MODEL, "max_seq_len": MAX_SEQ_LEN, "engine": "echo"},
                   {"model_name": "other", "max_seq_len": 64, "min_replicas": other_min_replicas, "engine": "echo"}],
        "gateway": gateway or {},
        "quota_groups": quota_groups or [],
    })


def _serve(app, ready_timeout: float = 10.0):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="gateway-under-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + ready_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test gateway did not start")
        time.sleep(0.005)
    return server, thread, sock


@pytest.fixture
def start_gateway():
    """start_gateway(site=None, **fake_knobs) -> RunningGateway; every one started is stopped at teardown."""
    running = []

    def start(site: Optional[SiteConfig] = None, admin_key: Optional[str] = None, **fake_knobs: Any) -> RunningGateway:
        site = site or make_site()
        models = [ModelInfo(m.model_name, m.max_seq_len, created=1700000000) for m in site.models]
        backend = FakeBackend(models, **fake_knobs)
        server, thread, sock = _serve(create_app(backend, site, admin_key=admin_key))
        running.append((server, thread, sock, backend))
        return RunningGateway(f"http://127.0.0.1:{sock.getsockname()[1]}", backend, site)

    yield start
    for server, thread, sock, backend in running:
        backend.release.set()  # let held streams finish so shutdown is not waiting on them
        server.should_exit = True
        thread.join(timeout=10)
        assert not thread.is_alive(), "the test gateway did not shut down"
        sock.close()


@pytest.fixture
def gateway(start_gateway) -> RunningGateway:
    return start_gateway()
