"""Two quota groups contend on one model through a real `exaserve serve` (reference engine, one replica of 4
batch slots): the guaranteed group is served while the other bursts, the burst is cut back at once when the
owner returns, and no accepted request fails."""

from __future__ import annotations

import threading
import time

import openai
import pytest
import yaml

from exaserve_hpc.quota.keys import hash_key
from serve_harness import ROOT, start_serve, stop_serve

pytestmark = pytest.mark.process

OWNER, BURST = "exa-owner-key-0123456789abcdef", "exa-burst-key-0123456789abcdef"


def test_guaranteed_group_is_served_while_another_bursts_and_borrowing_is_cut_back(tmp_path):
    data = yaml.safe_load((ROOT / "site-configs" / "local.yaml").read_text())
    data.update(run_dir=str(tmp_path / "run"), quota_groups=[
        {"name": "owner", "account": "own001", "guaranteed_share": 0.5, "burst_share": 0.5,
         "api_key_hashes": [hash_key(OWNER)]},
        {"name": "burst", "account": "bur002", "api_key_hashes": [hash_key(BURST)]}])
    data["weight_cache"]["l3_path"] = str(tmp_path / "models")
    data["batching"]["max_batch_size"] = 4
    data["models"][0]["replicas"] = 1
    data["scheduler"]["min_replicas_per_model"] = 1
    data["gateway"]["require_api_key"] = True
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump(data))
    process, url, lines = start_serve(site)
    clients = {key: openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120) for key in (OWNER, BURST)}
    results: list = []
    started = threading.Semaphore(0)

    def long_stream(key: str, tokens: int) -> None:
        try:
            stream = clients[key].completions.create(model="tiny-llama", prompt="tell me", max_tokens=tokens,
                                                     temperature=0, stream=True)
            count, reason = 0, None
            for i, chunk in enumerate(stream):
                if i == 0:
                    started.release()
                count += 1
                reason = chunk.choices[0].finish_reason or reason
            results.append((key, reason, count))
        except Exception as exc:  # noqa: BLE001 - recorded, asserted below
            started.release()
            results.append((key, exc, 0))

    def start(key: str, n: int, tokens: int) -> list[threading.Thread]:
        threads = [threading.Thread(target=long_stream, args=(key, tokens)) for _ in range(n)]
        for t in threads:
            t.start()
        for _ in threads:
            assert started.acquire(timeout=60)
        return threads

    try:
        threads = start(BURST, 3, 1900)  # the owner is idle: burst borrows one of its 2 guaranteed slots
        t0 = time.monotonic()
        threads += start(OWNER, 2, 600)  # the owner returns: both guaranteed requests admitted (5 in flight)
        with pytest.raises(openai.RateLimitError) as refused:  # burst, under its ceiling, cut back at once
            clients[BURST].completions.create(model="tiny-llama", prompt="x", max_tokens=2)
        still_running = sum(t.is_alive() for t in threads)
        assert "at capacity" in refused.value.message, refused.value.message
        assert time.monotonic() - t0 < 30 and still_running >= 4, ("the model was not full", results)
        for t in threads:
            t.join(timeout=300)
        assert len(results) == 5 and all(reason in ("length", "stop") for _, reason, _ in results), results
        # the model is free again: burst borrows again
        assert clients[BURST].completions.create(model="tiny-llama", prompt="x", max_tokens=2).usage.completion_tokens
    finally:
        stop_serve(process, lines)
