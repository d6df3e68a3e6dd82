"""A stop never cuts a stream (issue 25 item 7), through a real `exaserve serve`: SIGTERM while 16 streams
run; the ones that fit gateway.stop_grace complete, the rest end with an SSE error event and
`data: [DONE]`; the server exits 0 and logs no traceback."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from serve_harness import start_serve

pytestmark = pytest.mark.process

GRACE = 4.0
SHORT, LONG = 200, 1500  # completion tokens: the timing engine paces 16 streams at ~7 ms a token here


def paced_site(tmp: Path, **gateway) -> Path:
    """One replica of the timing engine (paced like a GPU; every request runs to max_tokens)."""
    site = {"site": "stopgrace", "cluster": {"nodes": 1, "nodelist": "localhost"},
            "heartbeat": {"interval": "1s"}, "scheduler": {"tick_interval": "500ms"},
            "run_dir": str(tmp / "run"), "weight_cache": {"l3_path": str(tmp / "models")},
            "gateway": {"stop_grace": f"{GRACE}s", **gateway},
            "models": [{"model_name": "paced", "engine": "timing", "replicas": 1, "max_seq_len": 4096}]}
    path = tmp / "site.yaml"
    path.write_text(yaml.safe_dump(site))
    return path


class Stream(threading.Thread):
    def __init__(self, url: str, max_tokens: int, chat: bool):
        super().__init__(daemon=True)
        self.url, self.max_tokens, self.chat = url, max_tokens, chat
        self.events: list[str] = []  # the data: payloads, in order
        self.first = threading.Event()
        self.cut = ""  # how the connection broke, if it did
        self.ended_at = 0.0

    def run(self) -> None:
        path = "/v1/chat/completions" if self.chat else "/v1/completions"
        body = {"model": "paced", "max_tokens": self.max_tokens, "stream": True,
                "stream_options": {"include_usage": True}}
        body.update({"messages": [{"role": "user", "content": "a long answer"}]} if self.chat
                    else {"prompt": "a long answer"})
        try:
            with httpx.stream("POST", self.url + path, json=body, timeout=120) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        if len(self.events) >= 2:  # chat's role event, then text
                            self.first.set()
        except Exception as exc:  # noqa: BLE001 - a broken stream is what this test looks for
            self.cut = f"{type(exc).__name__}: {exc}"
        finally:
            self.ended_at = time.monotonic()
            self.first.set()

    def terminal(self) -> str:
        """'finished' (a finish_reason, then [DONE]), 'error' (an error event, then [DONE]) or what is wrong."""
        if self.cut:
            return f"cut ({self.cut})"
        if not self.events or self.events[-1] != "[DONE]":
            return f"no [DONE] (last: {self.events[-1:]})"
        bodies = [json.loads(e) for e in self.events[:-1]]
        if bodies and "error" in bodies[-1]:
            return "error"
        reasons = [c.get("finish_reason") for b in bodies for c in b.get("choices", [])]
        return "finished" if any(reasons) else f"no finish_reason and no error ({self.events[-3:]})"

    def completion_tokens(self) -> int:
        usage = [json.loads(e)["usage"] for e in self.events[:-1] if '"usage":{' in e.replace(" ", "")]
        return usage[-1]["completion_tokens"] if usage else -1


def test_sigterm_under_16_long_streams_ends_each_with_a_terminal_event_and_the_short_ones_complete(tmp_path):
    process, url, lines = start_serve(paced_site(tmp_path))
    try:
        streams = [Stream(url, LONG if i % 2 else SHORT, chat=i % 4 >= 2) for i in range(16)]
        for stream in streams:
            stream.start()
        deadline = time.monotonic() + 60
        for stream in streams:
            assert stream.first.wait(max(0.0, deadline - time.monotonic())), "a stream got no first token"
        assert not [s.cut for s in streams if s.cut], [s.cut for s in streams]
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        for stream in streams:
            stream.join(GRACE + 30)
        assert process.wait(timeout=60) == 0, "".join(lines)
    finally:
        if process.poll() is None:
            process.kill()
    output = "".join(lines)
    outcomes = [(s.max_tokens, s.terminal()) for s in streams]
    assert all(t in ("finished", "error") for _, t in outcomes), outcomes
    short = [s for s in streams if s.max_tokens == SHORT]
    long = [s for s in streams if s.max_tokens == LONG]
    # the short ones fit the grace: complete, every token
    assert [(s.terminal(), s.completion_tokens()) for s in short] == [("finished", SHORT)] * len(short), outcomes
    # the long ones cannot: ended by the gateway with its error event, soon after the grace
    assert [s.terminal() for s in long] == ["error"] * len(long), outcomes
    for s in long:
        error = json.loads(s.events[-2])["error"]
        assert error["code"] == "server_stopping", error
        assert s.ended_at - signalled < GRACE + 5, s.ended_at - signalled
    assert "Traceback" not in output, output
    assert "ended with an error event" in output, output
    # after the stop the port is closed: new requests are refused, not accepted and then cut
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=5)
