"""`exaserve serve` as a user runs it: start, ask with the official openai client, status, SIGTERM, nothing left behind."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from exaserve_hpc.engine.hf_tokenizer import HfTokenizer

from serve_harness import alive, start_serve, stop_serve, write_local_site

pytestmark = pytest.mark.process


@pytest.fixture
def site_file(tmp_path: Path) -> Path:
    return write_local_site(tmp_path)


def test_serve_answers_then_stops_cleanly_on_sigterm(site_file, tmp_path):
    process, url, lines = start_serve(site_file)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        assert [m.id for m in client.models.list().data] == ["tiny-llama"]
        stream = client.chat.completions.create(model="tiny-llama", stream=True, max_tokens=12,
                                                messages=[{"role": "user", "content": "Hello"}])
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert len("".join(pieces)) > 0
        completion = client.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=8)
        assert completion.usage.completion_tokens >= 1
        # the tiny model's own BPE tokens, its BOS first (the tokenizer in the checkpoint serve created)
        tokenizer = HfTokenizer.from_dir(tmp_path / "models" / "tiny-llama")
        assert completion.usage.prompt_tokens == len(tokenizer.encode("Once upon a time")) < 16
        assert tokenizer.encode("Once upon a time")[0] == 480

        status = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "status", "--json",
                                 "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=30)
        assert status.returncode == 0, status.stderr
        state = json.loads(status.stdout)
        assert [a["state"] for a in state["agents"]] == ["alive"]
        replicas = state["replicas"]
        assert len(replicas) == 2 and {r["state"] for r in replicas} == {"serving"}
        pids = [r["pid"] for r in replicas] + [a["pid"] for a in state["agents"]]
        assert all(pid > 0 and alive(pid) for pid in pids)
        table = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "status", "--url", url],
                               capture_output=True, text=True, timeout=30)
        assert "tiny-llama/r0000" in table.stdout and "serving" in table.stdout
    except BaseException:
        process.kill()
        raise
    stop_serve(process, lines)
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if alive(pid)], "child processes outlived exaserve serve"
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.socket() as probe:
        assert probe.connect_ex((host, int(port))) != 0, "the gateway port is still accepting connections"
    assert not (tmp_path / "run" / "serve.json").exists()


def test_serve_refuses_a_busy_port_with_a_clear_error(site_file):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "serve", "--site", str(site_file),
                                 "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert f"127.0.0.1:{port}" in result.stderr and "--port" in result.stderr


def test_serve_with_a_bad_site_exits_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("site: x\nmodels: []\n")
    result = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "serve", "--site", str(bad)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "models" in result.stderr


def test_served_streams_reach_the_gateway_in_batched_frames(site_file):
    """Under `exaserve serve` with the official client: concurrent streams' token chunks go replica -> router
    and router -> gateway several to a frame (TokenChunks), as /metrics counts them, and every stream is whole."""
    import threading

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    def scrape(url: str) -> dict:
        text = httpx.get(f"{url}/metrics", timeout=30).text
        return {(s.name, s.labels.get("path")): s.value for family in text_string_to_metric_families(text)
                for s in family.samples if s.name.startswith(("exaserve_router_token_chunks",
                                                              "exaserve_router_chunk_frames"))}

    process, url, lines = start_serve(site_file)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        usage: list = []

        def stream(k: int) -> None:
            pieces = client.completions.create(model="tiny-llama", prompt=f"Story {k}: once upon a time",
                                               max_tokens=96, stream=True, stream_options={"include_usage": True})
            usage.extend(c.usage.completion_tokens for c in pieces if c.usage)

        threads = [threading.Thread(target=stream, args=(k,)) for k in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert len(usage) == 12 and all(n >= 1 for n in usage), usage
        deadline = time.monotonic() + 10  # the router publishes its counts a few times a second
        while True:
            counts = scrape(url)
            if counts.get(("exaserve_router_token_chunks_total", "to_gateways"), 0) >= 12 or \
                    time.monotonic() > deadline:
                break
            time.sleep(0.2)
        for path in ("from_replicas", "to_gateways"):
            chunks = counts[("exaserve_router_token_chunks_total", path)]
            frames = counts[("exaserve_router_chunk_frames_total", path)]
            assert chunks >= 12 and frames >= 1 and chunks > frames, (path, chunks, frames)
    except BaseException:
        process.kill()
        raise
    stop_serve(process, lines)
