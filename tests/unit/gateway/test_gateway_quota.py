"""Quota groups at the gateway: hashed keys (401 for a wrong one), private models, the usage ledger."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from fastapi.testclient import TestClient

from tests.unit.gateway.conftest import MODEL, make_site
from exaserve_hpc.config.schema import parse_site
from exaserve_hpc.quota.keys import hash_key
from exaserve_hpc.quota.ledger import UsageLedger, read_usage, summarize
from exaserve_hpc.gateway.backend import ModelInfo
from exaserve_hpc.gateway.app import create_app
from tests.unit.gateway.fake_backend import FakeBackend

CLIMATE, BIO = "exa-climate-key-0123456789abcdef", "exa-bio-key-0123456789abcdef01"


def quota_site(**extra):
    return parse_site({
        "site": "quota-test", "gateway": {"require_api_key": True},
        "models": [{"model_name": MODEL, "max_seq_len": 256, "engine": "echo"},
                   {"model_name": "private", "max_seq_len": 256, "visible_to": ["climate"], "engine": "echo"}],
        "quota_groups": [{"name": "climate", "account": "clim001", "api_key_hashes": [hash_key(CLIMATE)]},
                         {"name": "bio", "account": "bio002", "api_key_hashes": [hash_key(BIO)]}], **extra})


def test_hashed_keys_admit_their_group_and_a_wrong_key_is_401(start_gateway):
    gw = start_gateway(quota_site())
    answer = gw.client(api_key=CLIMATE).completions.create(model=MODEL, prompt="hello", max_tokens=3)
    assert answer.usage.completion_tokens == 3 and gw.backend.requests[-1].quota_group == "climate"
    assert gw.client(api_key=BIO).models.list().data
    for wrong in (hash_key(CLIMATE), CLIMATE[:-1], CLIMATE + "x", "sha256:" + "0" * 64):
        with pytest.raises(openai.AuthenticationError) as caught:
            gw.client(api_key=wrong).completions.create(model=MODEL, prompt="hello", max_tokens=3)
        assert caught.value.status_code == 401 and wrong not in str(caught.value.body)


def test_a_private_model_is_404_and_unlisted_for_other_groups(start_gateway):
    gw = start_gateway(quota_site())
    climate, bio = gw.client(api_key=CLIMATE), gw.client(api_key=BIO)
    assert {m.id for m in climate.models.list().data} == {MODEL, "private"}
    assert {m.id for m in bio.models.list().data} == {MODEL}
    assert climate.completions.create(model="private", prompt="hi", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.NotFoundError) as caught:
        bio.completions.create(model="private", prompt="hi", max_tokens=2)
    unknown = caught.value.body
    with pytest.raises(openai.NotFoundError) as absent:
        bio.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    # answered exactly as a model that does not exist: the name given, and only bio's models listed
    assert unknown["message"].replace("'private'", "X") == absent.value.body["message"].replace("'no-such-model'", "X")
    with pytest.raises(openai.NotFoundError):
        bio.chat.completions.create(model="private", messages=[{"role": "user", "content": "hi"}])


def test_every_finished_request_is_in_the_ledger_with_its_group_account_and_model(tmp_path):
    site = quota_site(batching={"max_batch_size": 4})
    models = [ModelInfo(m.model_name, m.max_seq_len, created=1) for m in site.models]
    ledger = UsageLedger(tmp_path)
    client = TestClient(create_app(FakeBackend(models), site, ledger=ledger))
    counted = {"climate": [0, 0], "bio": [0, 0]}
    for key, group, prompt, model in ((CLIMATE, "climate", "abcdef", MODEL), (BIO, "bio", "xy", MODEL),
                                      (CLIMATE, "climate", "private prompt", "private")):
        body = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 4},
                           headers={"Authorization": f"Bearer {key}"}).json()
        counted[group][0] += body["usage"]["prompt_tokens"]
        counted[group][1] += body["usage"]["completion_tokens"]
    refused = client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 300},
                          headers={"Authorization": f"Bearer {BIO}"})
    assert refused.status_code == 400  # never admitted, never billed
    ledger.close()
    records = list(read_usage(tmp_path))
    assert len(records) == 3 and {r.account for r in records} == {"clim001", "bio002"}
    assert all(r.gpu_seconds >= 0 and r.request_id for r in records)
    rows = {r["group"]: r for r in summarize(records, by="group")}
    assert {g: [rows[g]["prompt_tokens"], rows[g]["completion_tokens"]] for g in rows} == counted
    assert {r["model"]: r["requests"] for r in summarize(records, by="model")} == {MODEL: 2, "private": 1}


# ------------------------------------------------------------ through the gateway


def test_two_groups_contend_on_one_model_at_the_gateway(start_gateway):
    site = parse_site({
        "site": "shares", "gateway": {"require_api_key": True}, "batching": {"max_batch_size": 8},
        "models": [{"model_name": "m", "replicas": 1, "max_seq_len": 256, "engine": "echo"}],
        "quota_groups": [{"name": "owner", "guaranteed_share": 0.5, "burst_share": 0.5,
                          "api_key_hashes": [hash_key("key-owner-0123456789")]},
                         {"name": "burst", "burst_share": 0.75, "api_key_hashes": [hash_key("key-burst-0123456789")]}]})
    gw = start_gateway(site, hold=True)  # streams wait until released: requests stay in flight
    owner, burst = (gw.client(api_key=f"key-{g}-0123456789") for g in ("owner", "burst"))
    pool = ThreadPoolExecutor(12)

    def held(client, n):
        before = len(gw.backend.requests)
        futures = [pool.submit(client.completions.create, model="m", prompt="hello", max_tokens=3) for _ in range(n)]
        deadline = time.monotonic() + 10
        while len(gw.backend.requests) < before + n:
            assert time.monotonic() < deadline, "requests were not admitted"
            time.sleep(0.01)
        return futures

    # 8 slots: owner is guaranteed 4 (and may hold no more), burst none but may hold 6
    accepted = held(burst, 5)  # the owner is idle: burst borrows one of its slots
    accepted += held(owner, 4)  # the owner returns: all 4 guaranteed slots admitted, 9 in flight now
    with pytest.raises(openai.RateLimitError) as refused:  # burst, under its ceiling, is cut back at once
        burst.completions.create(model="m", prompt="hello", max_tokens=3)
    assert "at capacity" in refused.value.message and refused.value.response.headers["Retry-After"] == "1"
    with pytest.raises(openai.RateLimitError) as ceiling:
        owner.completions.create(model="m", prompt="hello", max_tokens=3)
    assert "burst_share" in ceiling.value.message
    gw.backend.release.set()
    assert all(f.result(timeout=10).usage.completion_tokens == 3 for f in accepted)  # no accepted request failed
    assert burst.completions.create(model="m", prompt="hello", max_tokens=3).usage.completion_tokens == 3
    pool.shutdown()
