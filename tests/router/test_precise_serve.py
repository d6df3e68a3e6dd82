"""`exaserve serve` with router.prefix_mode: precise: the running system routes a repeated prompt by the
KV events its replicas announce, and its status shows the engines' prefix-cache hits."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from serve_harness import start_serve, stop_serve, write_local_site

pytestmark = pytest.mark.process


def test_serve_in_precise_mode_routes_a_repeat_by_the_engines_events(tmp_path: Path):
    site_file = write_local_site(tmp_path, router={"policy": "prefix_affinity", "prefix_mode": "precise"})
    process, url, lines = start_serve(site_file)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        prompt = "A shared system prompt that is long enough to fill several KV blocks of sixteen tokens. " * 2
        router: dict = {}
        for _ in range(20):  # the first request stores the prefix; the engine's events reach the router
            client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=2)
            with urllib.request.urlopen(f"{url}/v1/exaserve/status", timeout=10) as response:
                router = json.load(response)["router"]
            if router["routing"].get("affinity") and router["prefix_hit_tokens"] > 0:
                break
            time.sleep(0.2)
        assert router["routing"].get("affinity", 0) >= 1, router
        assert router["prefix_hit_tokens"] >= 16 and router["prefix_query_tokens"] > router["prefix_hit_tokens"]
    except BaseException:
        process.kill()
        raise
    stop_serve(process, lines)
