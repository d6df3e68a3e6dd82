"""Another local user against the ZeroMQ sockets of a real `exaserve serve` (issue 13 item 1).

The attacker runs as uid 65534 (setpriv) and knows every endpoint (read here from the status) and even the
server's public key, but not the run's client key (RUN_DIR/keys, 0700/0600): it must not get a request past
the gateway, register a replica or an agent, or abort another user's request; a CURVE peer with a foreign
key is logged once. Before the run made CURVE keys, every one of these got through.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx
import pytest
import yaml

from serve_harness import start_serve, stop_serve

pytestmark = [pytest.mark.process,
              pytest.mark.skipif(os.getuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")]

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
ATTACKER = Path(__file__).with_name("attacker.py")


@pytest.fixture(scope="module")
def served():
    tmp = Path(tempfile.mkdtemp(prefix="exaserve-sockets-"))
    site = {"site": "sockets", "cluster": {"nodes": 1, "nodelist": "localhost"},
            "heartbeat": {"interval": "1s"}, "scheduler": {"tick_interval": "500ms"},
            "run_dir": str(tmp / "run"), "weight_cache": {"l3_path": str(tmp / "models")},
            "models": [{"model_name": "echo", "engine": "echo", "replicas": 1, "max_seq_len": 4096},
                       # paced like a GPU: a stream that lasts long enough to be aborted
                       {"model_name": "paced", "engine": "timing", "replicas": 1, "max_seq_len": 4096}]}
    path = tmp / "site.yaml"
    path.write_text(yaml.safe_dump(site))
    process, url, lines = start_serve(path)
    try:
        status = httpx.get(f"{url}/v1/exaserve/status", timeout=10).json()
        yield {"url": url, "lines": lines, "status": status, "run": tmp / "run",
               "server_key": (tmp / "run" / "keys" / "server.pub").read_text()}
    finally:
        if process.poll() is None:
            stop_serve(process, lines)
        shutil.rmtree(tmp, ignore_errors=True)


def attack(mode: str, endpoint: str, server_key: str = "", arg: str = "") -> dict:
    done = subprocess.run([*NOBODY, sys.executable, str(ATTACKER), mode, endpoint, server_key, arg],
                          capture_output=True, text=True, timeout=60, cwd="/",
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
                               "HOME": "/nonexistent"})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def endpoints(served) -> dict:
    return served["status"]["controller"]


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "own-curve-key"])
def test_a_foreign_client_gets_no_request_past_the_gateway(served, keyed):
    got = attack("generate", endpoints(served)["router_frontend"], served["server_key"] if keyed else "", "echo")
    assert got["received"] == [], got


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "own-curve-key"])
@pytest.mark.parametrize("takeover", [False, True], ids=["new-id", "real-replica-id"])
def test_a_foreign_replica_is_not_registered_and_sees_no_prompt(served, keyed, takeover):
    answers: list[dict] = []
    attacking = threading.Event()

    def victims() -> None:  # prompts sent all the while the stranger is connected
        i = 0
        while attacking.is_set() or i < 10:
            r = httpx.post(f"{served['url']}/v1/completions", timeout=30,
                           json={"model": "echo", "prompt": f"secret number {i}", "max_tokens": 8})
            answers.append({"status": r.status_code, "text": r.json()["choices"][0]["text"]})
            i += 1

    real = next(r["replica_id"] for r in served["status"]["replicas"] if r["model"] == "echo")
    attacking.set()
    thread = threading.Thread(target=victims)
    thread.start()
    try:
        got = attack("replica", endpoints(served)["router_backend"], served["server_key"] if keyed else "",
                     f"echo,{real if takeover else 'evil-replica'}")
    finally:
        attacking.clear()
        thread.join()
    assert got["received"] == [], got
    assert {a["status"] for a in answers} == {200} and all(a["text"].startswith("secret") for a in answers), answers
    replicas = httpx.get(f"{served['url']}/v1/exaserve/status", timeout=10).json()["replicas"]
    assert "evil-replica" not in json.dumps(replicas)


@pytest.mark.parametrize("keyed", [False, True], ids=["plain", "own-curve-key"])
def test_a_foreign_agent_is_not_admitted(served, keyed):
    got = attack("agent", endpoints(served)["endpoint"], served["server_key"] if keyed else "")
    assert got["received"] == [], got
    status = httpx.get(f"{served['url']}/v1/exaserve/status", timeout=10).json()
    assert "evil-agent" not in json.dumps(status["agents"])


def test_a_foreign_client_cannot_abort_another_users_stream(served):
    with httpx.stream("POST", f"{served['url']}/v1/completions", timeout=60,
                      json={"model": "paced", "prompt": "a long answer", "max_tokens": 200, "stream": True}) as r:
        request_id = r.headers["x-request-id"]
        events = r.iter_lines()
        first = next(line for line in events if line.startswith("data:"))
        assert first
        for keyed in ("", served["server_key"]):
            attack("abort", endpoints(served)["router_frontend"], keyed, request_id)
        rest = [line for line in events if line.startswith("data:")]
    assert rest[-1] == "data: [DONE]"
    last = json.loads(rest[-2][5:])
    assert last["choices"][0]["finish_reason"] == "length", rest[-3:]


def test_a_foreign_curve_key_is_refused_and_logged_once(served):
    before = sum("refused a CURVE client" in line for line in served["lines"])
    attack("generate", endpoints(served)["router_frontend"], served["server_key"], "echo")
    refused = [line for line in served["lines"] if "refused a CURVE client" in line]
    assert len(refused) == before + 1, refused  # four attempts with one key: one line
    assert "router frontend" in refused[-1]


def test_run_keys_are_private(served):
    keys = served["run"] / "keys"
    assert oct(keys.stat().st_mode & 0o777) == oct(0o700)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in keys.iterdir()} == {
        n: oct(0o600) for n in ("server.key", "server.pub", "client.key", "client.pub", "kv-salt")}
