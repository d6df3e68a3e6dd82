"""Limits at the gateway's door (issue 13): the body cap, keys on the operations endpoints, each quota
group's share of the gateway, the fast 503 while nothing serves, lone surrogates, SSE line separators.

A real uvicorn server on loopback runs the gateway over the in-process FakeBackend (conftest.py); the
bodies are sent over real sockets, so the 413 is seen before the body is sent.
"""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.unit.gateway.conftest import MODEL, make_site

LIMIT = 64 * 1024


def raw_exchange(url: str, head: bytes, body: bytes = b"", wait: float = 5.0) -> bytes:
    """Send a request head (and maybe part of a body) on a plain socket; what the server answers."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as sock:
        sock.sendall(head + body)
        answer = b""
        try:
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                data = sock.recv(65536)
                if not data:
                    break
                answer += data
        except socket.timeout:
            pass
        return answer


def test_a_declared_body_over_the_limit_is_refused_unread(start_gateway):
    gw = start_gateway(make_site(gateway={"max_body_bytes": LIMIT}))
    # 200 MB announced, 10 bytes sent: the answer comes without the server waiting for the rest.
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 200000000\r\n\r\n")
    started = time.monotonic()
    answer = raw_exchange(gw.url, head, b'{"model": ')
    assert time.monotonic() - started < 3
    status_line, _, rest = answer.partition(b"\r\n")
    assert b" 413 " in status_line, answer[:300]
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "request_too_large" and "gateway.max_body_bytes" in error["message"]
    assert str(LIMIT) in error["message"] and "200000000" in error["message"]
    assert gw.backend.requests == []


def test_a_chunked_body_is_cut_at_the_limit(start_gateway):
    gw = start_gateway(make_site(gateway={"max_body_bytes": LIMIT}))

    def pieces():  # no Content-Length: Transfer-Encoding chunked, counted as it arrives
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        for _ in range(64):
            yield b"x" * 4096
        yield b'"}'

    response = httpx.post(f"{gw.url}/v1/completions", content=pieces(), timeout=10,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert "gateway.max_body_bytes" in response.json()["error"]["message"]
    assert gw.backend.requests == []
    small = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=10)
    assert small.status_code == 200 and small.json()["choices"][0]["text"] == "hi"


def test_a_lone_surrogate_in_a_completions_prompt_is_400(gateway):
    for prompt in (b'"a\\ud800b"', b'["\\udfff"]'):
        response = httpx.post(f"{gateway.url}/v1/completions", timeout=10,
                              content=b'{"model": "' + MODEL.encode() + b'", "prompt": ' + prompt + b"}",
                              headers={"Content-Type": "application/json"})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "prompt" and "lone surrogate" in error["message"]
    chat = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=10, headers={"Content-Type": "application/json"},
                      content=b'{"model": "tiny-echo", "messages": [{"role": "user", "content": "\\ud800"}]}')
    assert chat.status_code == 400


def test_sse_events_never_carry_unicode_line_separators(gateway):
    text = "one\u2028two\u2029three\u0085four"
    for path, body in (("/v1/completions", {"prompt": text}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})):
        with httpx.stream("POST", f"{gateway.url}{path}", timeout=10,
                          json={"model": MODEL, "stream": True, "max_tokens": 64, **body}) as response:
            raw = response.read()
        for separator in ("\u2028", "\u2029", "\u0085"):
            assert separator.encode() not in raw
        events = [line for line in raw.decode().splitlines() if line.startswith("data: {")]
        pieces = [json.loads(e[6:])["choices"] for e in events]
        got = "".join(c[0].get("text") or c[0].get("delta", {}).get("content") or "" for c in pieces if c)
        assert text in got  # escaped, not lost: a JSON parser gives the characters back (chat: templated)


KEYED = dict(gateway={"require_api_key": True, "metrics_key": "metrics-key-0123456789"},
             quota_groups=[{"name": "climate", "api_keys": ["key-climate"]}, {"name": "bio", "api_keys": ["key-bio"]}])


def test_operations_endpoints_need_the_right_key_when_keys_are_required(start_gateway):
    gw = start_gateway(make_site(**KEYED), admin_key="the-admin-key")

    def get(path: str, key: str = "") -> int:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(f"{gw.url}{path}", headers=headers, timeout=10).status_code

    assert get("/metrics") == 401 and get("/metrics", "key-bio") == 401
    assert get("/metrics", "metrics-key-0123456789") == 200 and get("/metrics", "the-admin-key") == 200
    assert get("/v1/exaserve/status") == 401 and get("/v1/exaserve/status", "key-climate") == 401
    assert get("/v1/exaserve/status", "metrics-key-0123456789") == 401
    assert get("/v1/exaserve/status", "the-admin-key") == 200
    assert get("/openapi.json") == 401 and get("/openapi.json", "key-bio") == 200
    assert get("/docs") == 404  # its page would fetch the schema without a key
    assert get("/health") == 200  # liveness stays open: it names nothing
    body = httpx.get(f"{gw.url}/metrics", timeout=10).json()["error"]
    assert body["code"] == "invalid_api_key" and "gateway.metrics_key" in body["message"]


def test_without_required_keys_the_operations_endpoints_stay_open(gateway):
    for path in ("/metrics", "/v1/exaserve/status", "/openapi.json"):
        assert httpx.get(f"{gateway.url}{path}", timeout=10).status_code == 200


def test_a_group_without_its_own_cap_holds_at_most_its_share(start_gateway):
    site = make_site(gateway={"require_api_key": True, "max_queued_requests": 4, "group_share": 0.5},
                     quota_groups=KEYED["quota_groups"])
    gw = start_gateway(site, hold=True)
    with ThreadPoolExecutor(4) as pool:
        held = [pool.submit(gw.client(api_key="key-climate").completions.create, model=MODEL, prompt=p)
                for p in "ab"]
        assert gw.backend.wait_for(lambda: len(gw.backend.requests) == 2)
        refused = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "c"}, timeout=10,
                             headers={"Authorization": "Bearer key-climate"})
        assert refused.status_code == 429 and "retry-after" in refused.headers
        assert "'climate'" in refused.json()["error"]["message"]
        other = pool.submit(gw.client(api_key="key-bio").completions.create, model=MODEL, prompt="d")
        assert gw.backend.wait_for(lambda: len(gw.backend.requests) == 3)  # bio still gets a slot
        gw.backend.release.set()
        assert [f.result(timeout=5).choices[0].text for f in (*held, other)] == ["a", "b", "d"]


def test_nothing_serving_is_503_at_once_except_for_a_model_scaling_from_zero(start_gateway):
    gw = start_gateway(make_site(other_min_replicas=0))
    gw.backend.is_ready = False
    time.sleep(0.3)  # past the gateway's 0.2 s readiness cache
    started = time.monotonic()
    response = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=10)
    assert time.monotonic() - started < 1
    assert response.status_code == 503 and int(response.headers["retry-after"]) >= 1
    assert response.json()["error"]["code"] == "no_replica" and "/health" in response.json()["error"]["message"]
    assert httpx.get(f"{gw.url}/health").status_code == 503
    assert gw.backend.requests == []
    # min_replicas 0: its request goes to the backend, which brings up the first replica
    waiting = httpx.post(f"{gw.url}/v1/completions", json={"model": "other", "prompt": "hi"}, timeout=10)
    assert waiting.status_code == 200 and [r.model for r in gw.backend.requests] == ["other"]


@pytest.mark.parametrize("share, expected", [(0.5, {"a": 2, "b": 2}), (0.25, {"a": 1, "b": 1})])
def test_group_limits_policy(share, expected):
    from exaserve_hpc.gateway.app import group_limits
    groups = [{"name": "a", "api_keys": ["ka"]}, {"name": "b", "api_keys": ["kb"]}]
    assert group_limits(make_site(gateway={"max_queued_requests": 4, "group_share": share},
                                  quota_groups=groups)) == expected
    one = [{"name": "a", "api_keys": ["ka"]}]  # alone, a group may use the whole gateway
    assert group_limits(make_site(gateway={"max_queued_requests": 4}, quota_groups=one)) == {}
    capped = [{"name": "a", "api_keys": ["ka"], "max_concurrent_requests": 3}, {"name": "b", "api_keys": ["kb"]}]
    assert group_limits(make_site(gateway={"max_queued_requests": 4, "group_share": share},
                                  quota_groups=capped))["a"] == 3
