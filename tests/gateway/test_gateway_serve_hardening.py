"""The gateway's door against a real `exaserve serve` (issue 13 items 3, 8, 9, 12, 13, 15): the admin key made
for the run (0600) and used by `exaserve rollout` / `exaserve status`, a local attacker (uid 65534 through
setpriv) refused by the admin routes and the fleet endpoints, a rollout checkpoint outside the model roots
refused even with the key, the body cap with the server's memory flat, and the fast 503 while nothing serves.

Echo replicas (no model): the figures are the serving path's own.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from serve_harness import start_serve, stop_serve

pytestmark = pytest.mark.process

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
GROUPS = [{"name": "climate", "api_keys": ["key-climate-0001"]}, {"name": "bio", "api_keys": ["key-bio-0002"]}]


def write_site(tmp: Path, models: list[dict], **gateway) -> Path:
    site = {"site": "hardening", "cluster": {"nodes": 1, "nodelist": "localhost"},
            "heartbeat": {"interval": "1s"}, "scheduler": {"tick_interval": "500ms"},
            "run_dir": str(tmp / "run"), "weight_cache": {"l3_path": str(tmp / "models")},
            "gateway": {"require_api_key": True, "max_body_bytes": "1MiB", **gateway},
            "quota_groups": GROUPS, "models": models}
    path = tmp / "site.yaml"
    path.write_text(yaml.safe_dump(site))
    return path


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "EXASERVE_ADMIN_KEY": "", **(env or {})})


@pytest.fixture(scope="module")
def served():
    # A directory every user may enter (tmp_path's parents are private): the key file's own mode must keep
    # other users out, not a parent directory.
    tmp = Path(tempfile.mkdtemp(prefix="exaserve-door-"))
    tmp.chmod(0o755)
    (tmp / "models").mkdir(mode=0o755)
    site = write_site(tmp, [{"model_name": "echo", "engine": "echo", "replicas": 1, "max_seq_len": 4096}])
    process, url, lines = start_serve(site)
    try:
        yield {"url": url, "tmp": tmp, "run": tmp / "run", "pid": process.pid, "lines": lines}
    except BaseException:
        process.kill()
        raise
    finally:
        if process.poll() is None:
            stop_serve(process, lines)
        shutil.rmtree(tmp, ignore_errors=True)


def admin_key(served) -> str:
    return (served["run"] / "admin.key").read_text().strip()


def test_the_run_makes_an_admin_key_0600_that_rollout_and_status_use(served):
    key_file = served["run"] / "admin.key"
    info = key_file.stat()
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == os.getuid() and len(admin_key(served)) >= 32
    # promote with nothing rolled out: authorised (404, not 401), the key read from the run directory
    done = cli("rollout", "promote", "echo", "v9", "--run-dir", str(served["run"]))
    assert done.returncode == 1 and "(404)" in done.stderr and "no rollout in progress" in done.stderr, done.stderr
    status = cli("status", "--run-dir", str(served["run"]), "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["replicas"], status.stderr


ATTACK = r"""
import json, sys, urllib.request, urllib.error
url, key_file, evil = sys.argv[1:4]
def call(method, path, body=None, key=""):
    headers = {"Content-Type": "application/json", **({"Authorization": "Bearer " + key} if key else {})}
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, data=data, headers=headers, method=method),
                                    timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
result = {}
try:
    open(key_file).read()
    result["key_file"] = "read"
except PermissionError:
    result["key_file"] = "denied"
start = {"model": "echo", "version": "evil", "weight": 1.0, "model_dir": evil}
result["start"] = call("POST", "/v1/exaserve/rollouts/start", start)
result["start_group_key"] = call("POST", "/v1/exaserve/rollouts/start", start, key="key-bio-0002")
result["list"] = call("GET", "/v1/exaserve/rollouts")
result["status"] = call("GET", "/v1/exaserve/status")
result["status_group_key"] = call("GET", "/v1/exaserve/status", key="key-bio-0002")
result["metrics"] = call("GET", "/metrics")
result["openapi"] = call("GET", "/openapi.json")
print(json.dumps(result))
"""


@pytest.mark.skipif(os.getuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv")
def test_another_local_user_cannot_roll_out_or_read_the_fleet(served):
    evil_root = Path(tempfile.mkdtemp(prefix="evil-"))
    evil_root.chmod(0o777)  # world-writable, as /tmp is
    evil = evil_root / "ckpt"
    made = cli("model", "create-tiny", str(evil))
    assert made.returncode == 0, made.stderr
    try:
        attack = subprocess.run([*NOBODY, sys.executable, "-c", ATTACK, served["url"],
                                 str(served["run"] / "admin.key"), str(evil)],
                                capture_output=True, text=True, timeout=120, cwd="/")
        assert attack.returncode == 0, attack.stderr
        result = json.loads(attack.stdout)
        assert result == {"key_file": "denied", "start": 401, "start_group_key": 401, "list": 401, "status": 401,
                          "status_group_key": 401, "metrics": 401, "openapi": 401}, result
        # With the admin key, a checkpoint outside the model roots is still refused, and nothing changed.
        auth = {"Authorization": f"Bearer {admin_key(served)}"}
        r = httpx.post(f"{served['url']}/v1/exaserve/rollouts/start", headers=auth, timeout=60,
                       json={"model": "echo", "version": "evil", "weight": 1.0, "model_dir": str(evil)})
        assert r.status_code == 403 and "allowed model root" in r.text, r.text
        listed = httpx.get(f"{served['url']}/v1/exaserve/rollouts", headers=auth, timeout=10)
        assert listed.status_code == 200 and listed.json()["rollouts"] == []
    finally:
        shutil.rmtree(evil_root, ignore_errors=True)


def rss_kib(pid: int) -> int:
    """Resident memory of a process and its threads (the gateway runs in exaserve serve's process)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_huge_body_is_refused_before_it_is_read_and_memory_stays_flat(served):
    url, before = served["url"], rss_kib(served["pid"])
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:  # 200 MB announced
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer key-bio-0002\r\nContent-Length: 200000000\r\n\r\n" + b"{" * 65536)
        answer = b""
        while not answer.endswith(b"}"):  # the head, then the JSON error body
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    assert b" 413 " in answer.split(b"\r\n")[0] and b"gateway.max_body_bytes" in answer, answer[:300]

    def chunks():  # 64 MB with no length announced: cut after the first MiB
        for _ in range(1024):
            yield b" " * 65536

    started = time.monotonic()
    try:
        r = httpx.post(f"{url}/v1/completions", content=chunks(), timeout=30,
                       headers={"Authorization": "Bearer key-bio-0002", "Content-Type": "application/json"})
        assert r.status_code == 413 and "1048576" in r.json()["error"]["message"]
    except httpx.WriteError:  # the server answered and closed while we were still sending: refused too
        pass
    assert time.monotonic() - started < 10
    assert rss_kib(served["pid"]) - before < 64 * 1024, "the gateway read the body into memory"
    ok = httpx.post(f"{url}/v1/completions", json={"model": "echo", "prompt": "still here", "max_tokens": 10},
                    headers={"Authorization": "Bearer key-bio-0002"}, timeout=30)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "still here"


def test_bad_text_is_a_400_and_sse_lines_stay_whole(served):
    url, auth = served["url"], {"Authorization": "Bearer key-bio-0002", "Content-Type": "application/json"}
    r = httpx.post(f"{url}/v1/completions", headers=auth, timeout=30,
                   content=b'{"model": "echo", "prompt": "x\\ud800"}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    text = "a\u2028b\u2029c\u0085d"
    with httpx.stream("POST", f"{url}/v1/completions", headers=auth, timeout=30,
                      json={"model": "echo", "prompt": text, "max_tokens": len(text.encode()), "stream": True}) as s:
        raw = s.read()
    assert s.status_code == 200 and raw.endswith(b"data: [DONE]\n\n")
    assert not any(sep.encode() in raw for sep in "\u2028\u2029\u0085")
    events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == text


def test_nothing_serving_is_a_503_at_once_but_a_model_from_zero_waits_for_its_replica(tmp_path):
    # "broken": an engine whose package is not installed, so its replica never serves; "lazy" starts at 0.
    site = write_site(tmp_path, [
        {"model_name": "broken", "engine": "trtllm", "replicas": 1, "min_replicas": 1, "max_seq_len": 4096,
         "weight_bytes": "1MiB"},
        {"model_name": "lazy", "engine": "echo", "replicas": 0, "min_replicas": 0, "max_seq_len": 4096}])
    made = cli("model", "create-tiny", str(tmp_path / "models" / "broken"))  # a checkpoint it cannot run
    assert made.returncode == 0, made.stderr
    process = subprocess.Popen([sys.executable, "-m", "exaserve_hpc.cli", "serve", "--site", str(site), "--port",
                                "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        state, deadline = tmp_path / "run" / "serve.json", time.monotonic() + 60
        while not state.exists():
            assert process.poll() is None and time.monotonic() < deadline, process.stdout.read()
            time.sleep(0.2)
        url = json.loads(state.read_text())["url"]
        auth = {"Authorization": "Bearer key-bio-0002"}
        while httpx.get(f"{url}/health", timeout=10).status_code != 503:  # the gateway is up; nothing serves
            time.sleep(0.2)
        started = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json={"model": "broken", "prompt": "hi"}, headers=auth, timeout=90)
        assert time.monotonic() - started < 2, "waited for a replica that /health already says is not there"
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "no_replica"
        r = httpx.post(f"{url}/v1/completions", json={"model": "lazy", "prompt": "woken", "max_tokens": 5},
                       headers=auth, timeout=90)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "woken", r.text
    finally:
        process.terminate()
        try:
            process.wait(45)
        except subprocess.TimeoutExpired:
            process.kill()
