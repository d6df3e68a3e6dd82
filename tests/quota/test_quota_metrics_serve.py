"""Per-group metrics through a real `exaserve serve` (reference engine, one replica of 4 batch slots): /metrics
shows each group's requests, prompt and completion tokens (equal to what the clients counted from the
responses' usage fields), a refusal by its reason, and the share of the model's slots a group holds while its
request runs; every series is labelled with the group's Slurm account from the site config."""

from __future__ import annotations

import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from exaserve_hpc.quota.keys import hash_key
from serve_harness import ROOT, start_serve, stop_serve

pytestmark = pytest.mark.process

CLIMATE, BIO = "exa-climate-key-0123456789abcdef", "exa-bio-key-0123456789abcdef0"
METRICS_KEY = "exa-metrics-key-0123456789abcdef"
MODEL = "tiny-llama"


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from the gateway's /metrics."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {METRICS_KEY}"}, timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_group_metrics_move_with_two_groups_requests_and_a_refusal(tmp_path):
    data = yaml.safe_load((ROOT / "site-configs" / "local.yaml").read_text())
    data.update(run_dir=str(tmp_path / "run"), quota_groups=[
        {"name": "climate", "account": "clim001", "guaranteed_share": 0.5, "api_key_hashes": [hash_key(CLIMATE)]},
        {"name": "bio", "account": "bio002", "burst_share": 0.25, "api_key_hashes": [hash_key(BIO)]}])
    data["weight_cache"]["l3_path"] = str(tmp_path / "models")
    data["batching"]["max_batch_size"] = 4
    data["models"][0]["replicas"] = 1
    data["scheduler"]["min_replicas_per_model"] = 1
    data["gateway"].update(require_api_key=True, metrics_key=METRICS_KEY)
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump(data))
    process, url, lines = start_serve(site)
    clients = {key: openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
               for key in (CLIMATE, BIO)}
    counted = {"climate": [0, 0, 0], "bio": [0, 0, 0]}  # requests, prompt tokens, completion tokens
    bio = {"account": "bio002", "group": "bio", "model": MODEL}
    climate = {"account": "clim001", "group": "climate", "model": MODEL}

    def count(group: str, usage) -> None:
        counted[group][0] += 1
        counted[group][1] += usage.prompt_tokens
        counted[group][2] += usage.completion_tokens

    try:
        before = scrape(url)
        assert value(before, "exaserve_group_share_ratio", group="climate", account="clim001",
                     kind="guaranteed_share") == 0.5
        assert value(before, "exaserve_group_share_ratio", group="bio", account="bio002", kind="burst_share") == 0.25

        # bio holds one of the 4 slots with a long stream: its share use is 1/4, its burst_share
        stream = clients[BIO].completions.create(model=MODEL, prompt="tell me a long story", max_tokens=600,
                                                 temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = iter(stream)
        first = next(chunks)
        during = scrape(url)
        assert value(during, "exaserve_group_share_used_ratio", **bio) == 0.25, first
        assert value(during, "exaserve_group_share_used_ratio", **climate) == 0.0
        # a second bio request is past its burst ceiling: refused, counted by reason
        with pytest.raises(openai.RateLimitError):
            clients[BIO].completions.create(model=MODEL, prompt="x", max_tokens=2)
        # climate is served meanwhile: two plain requests and a streamed chat
        for i in range(2):
            count("climate", clients[CLIMATE].completions.create(
                model=MODEL, prompt=f"climate request {i}", max_tokens=5 + i, temperature=0).usage)
        count("climate", [c for c in clients[CLIMATE].chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=7, stream=True,
            stream_options={"include_usage": True}) if c.usage][-1].usage)
        count("bio", [c for c in chunks if c.usage][-1].usage)

        after = scrape(url)
        for group, labels in (("climate", climate), ("bio", bio)):
            requests, prompt, completion = counted[group]
            assert value(after, "exaserve_group_requests_total", **labels) == requests, (group, counted)
            assert value(after, "exaserve_group_prompt_tokens_total", **labels) == prompt, (group, counted)
            assert value(after, "exaserve_group_completion_tokens_total", **labels) == completion, (group, counted)
            assert value(after, "exaserve_group_share_used_ratio", **labels) == 0.0, group
        # the refused request was never admitted: 1 admitted bio request, the refusal counted once, by reason
        assert value(after, "exaserve_quota_rejections_total", **bio, limit="burst_ceiling") == 1
        assert value(after, "exaserve_quota_rejections_total", **climate, limit="burst_ceiling") == 0
        assert counted["bio"][2] > 0 and counted["climate"][2] > 0
    finally:
        stop_serve(process, lines)
