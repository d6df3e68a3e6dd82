"""`exaserve rollout` against a running `exaserve serve`: a canary version gets replicas of its own and its share
of the traffic, promote replaces the old version's replicas, rollback drains the canary's, and no request fails.

Which version answered is read from the answers themselves: each version is a tiny checkpoint with its own
seed, so greedy (temperature 0) completions differ between versions, and the router's sticky bucket of a
prompt (canary.sticky_bucket, over the prompt's tokens) says which version it must go to.

The site: one replica of tiny-llama (min 1), a 0.2 s scheduler tick, and a router admin key.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from exaserve_hpc.cache.checkpoint import TINY_TOKENIZER_DIR
from exaserve_hpc.engine.hf_tokenizer import HfTokenizer
from exaserve_hpc.protocol import GenerateRequest
from exaserve_hpc.router.canary import sticky_bucket
from serve_harness import start_serve, stop_serve, write_local_site

pytestmark = pytest.mark.process

MODEL = "tiny-llama"
KEY = "rollout-admin-key"
ROLLOUTS = "/v1/exaserve/rollouts"


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """One `exaserve serve` for the module, and checkpoints for versions v2 and v3 (other seeds)."""
    tmp = tmp_path_factory.mktemp("rollout")
    site_file = write_local_site(tmp, scheduler=dict(tick_interval="200ms", min_replicas_per_model=1,
                                                     max_replicas_per_node=4),
                                 router=dict(admin_key=KEY), model=dict(replicas=1, min_replicas=1))
    versions = {}
    for version, seed in (("v2", 1), ("v3", 2)):
        versions[version] = tmp / "models" / f"{MODEL}-{version}"  # under weight_cache.l3_path: a model root
        done = cli("model", "create-tiny", str(versions[version]), "--seed", str(seed))
        assert done.returncode == 0, done.stderr
    process, url, lines = start_serve(site_file)
    try:
        yield {"url": url, "run_dir": tmp / "run", "versions": versions, "tmp": tmp}
    except BaseException:
        process.kill()
        raise
    stop_serve(process, lines)


def cli(*args: str, key: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "EXASERVE_ADMIN_KEY": key}
    return subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def rollout(deployment, *args: str) -> subprocess.CompletedProcess:
    return cli("rollout", *args, "--run-dir", str(deployment["run_dir"]), key=KEY)


def status(url: str) -> dict:
    return httpx.get(f"{url}/v1/exaserve/status", timeout=10).json()


def routed(status_: dict) -> dict[str, str]:
    """replica id -> version, for the replicas serving and registered with the router."""
    return {r["replica_id"]: r["version"] for r in status_["replicas"]
            if r["state"] == "serving" and r["endpoint"]}


def wait_replicas(url: str, predicate, what: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        current = status(url)
        if predicate(current):
            return current
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}: "
                         f"{[(r['replica_id'], r['version'], r['state']) for r in current['replicas']]}")


def versions_of(status_: dict) -> list[str]:
    return sorted(r["version"] for r in status_["replicas"])


TOKENIZER = HfTokenizer.from_dir(TINY_TOKENIZER_DIR)


def bucket(prompt: str) -> float:
    tokens = TOKENIZER.encode(prompt)  # as the gateway tokenises a completions prompt (the tiny model's BPE)
    return sticky_bucket(GenerateRequest(request_id="", model=MODEL, prompt_token_ids=tokens, max_tokens=1))


# Prompts that the sticky split at weight 0.5 sends to the canary, and ones it keeps on the stable version.
PROMPTS = [f"Tell me about request number {i}" for i in range(40)]
CANARY = [p for p in PROMPTS if bucket(p) < 0.5][:3]
STABLE = [p for p in PROMPTS if bucket(p) >= 0.5][:3]


def answers(client: openai.OpenAI, prompts: list[str]) -> dict[str, str]:
    return {p: client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0).choices[0].text
            for p in prompts}


class Traffic:
    """Requests one after another in a thread for as long as the test runs; every one must succeed."""

    def __init__(self, client: openai.OpenAI):
        self.client, self.outcomes, self.stop = client, [], threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            try:
                self.client.completions.create(model=MODEL, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=16)
                self.outcomes.append("ok")
            except openai.OpenAIError as exc:
                self.outcomes.append(f"{type(exc).__name__}: {exc}")
            i += 1

    def __enter__(self) -> "Traffic":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(30)


def test_a_bad_checkpoint_is_refused_and_the_admin_key_is_required(deployment):
    url, tmp = deployment["url"], deployment["tmp"]
    bad = tmp / "models" / "corrupt"
    shutil.copytree(deployment["versions"]["v2"], bad)
    shard = next(p for p in sorted(bad.iterdir()) if p.name != "manifest.json" and p.stat().st_size > 64)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))

    refused = rollout(deployment, "start", MODEL, "corrupt", "--model-dir", str(bad), "--weight", "0.5")
    assert refused.returncode == 1
    assert "(422)" in refused.stderr and "failed verification" in refused.stderr, refused.stderr

    command = {"model": MODEL, "version": "v2", "model_dir": str(deployment["versions"]["v2"]), "weight": 0.5}
    for headers in ({}, {"Authorization": "Bearer not-the-key"}):
        assert httpx.post(f"{url}{ROLLOUTS}/start", json=command, headers=headers, timeout=30).status_code == 401
        assert httpx.get(f"{url}{ROLLOUTS}", headers=headers, timeout=10).status_code == 401
    wrong = cli("rollout", "start", MODEL, "v2", "--model-dir", str(deployment["versions"]["v2"]),
                "--run-dir", str(deployment["run_dir"]), key="not-the-key")
    assert wrong.returncode == 1 and "(401)" in wrong.stderr, wrong.stderr

    nothing = rollout(deployment, "promote", MODEL, "corrupt")
    assert nothing.returncode == 1 and "(404)" in nothing.stderr and "no rollout in progress" in nothing.stderr
    unknown = rollout(deployment, "rollback", "no-such-model", "v2")
    assert unknown.returncode == 1 and "not served here" in unknown.stderr, unknown.stderr

    table = httpx.get(f"{url}{ROLLOUTS}", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    assert all(r["canary"] != "corrupt" and r["stable"] != "corrupt" for r in table["rollouts"])
    time.sleep(1.0)  # several controller ticks: a refused version must not have been given replicas
    assert "corrupt" not in versions_of(status(url))


def test_canary_takes_its_share_then_promote_replaces_and_rollback_drains(deployment):
    url, run_dir = deployment["url"], deployment["run_dir"]
    auth = {"Authorization": f"Bearer {KEY}"}
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    assert CANARY and STABLE
    wait_replicas(url, lambda s: list(routed(s).values()) == [""], "the site's one replica")
    v1 = answers(client, CANARY + STABLE)

    with Traffic(client) as traffic:
        # start: the canary gets a replica of its own, from its checkpoint, and then half the prompts.
        started = rollout(deployment, "start", MODEL, "v2", "--model-dir", str(deployment["versions"]["v2"]),
                          "--weight", "0.5")
        assert started.returncode == 0, started.stderr
        assert "50% to v2" in started.stdout
        table = httpx.get(f"{url}{ROLLOUTS}", headers=auth, timeout=10).json()["rollouts"]
        assert table == [{"model": MODEL, "stable": "", "canary": "v2", "weight": 0.5}]
        wait_replicas(url, lambda s: sorted(routed(s).values()) == ["", "v2"], "a serving v2 replica")
        shown = cli("status", "--json", "--run-dir", str(run_dir))
        assert shown.returncode == 0, shown.stderr
        state = json.loads(shown.stdout)
        assert versions_of(state) == ["", "v2"] and state["router"]["rollouts"] == table
        shown = cli("status", "--run-dir", str(run_dir))  # the table names each replica's version
        assert shown.returncode == 0 and f"{MODEL}@v2" in shown.stdout, shown.stdout + shown.stderr
        canary = answers(client, CANARY + STABLE)
        for prompt in CANARY:
            assert canary[prompt] != v1[prompt], f"{prompt!r} (bucket {bucket(prompt):.2f}) was not answered by v2"
        for prompt in STABLE:
            assert canary[prompt] == v1[prompt], f"{prompt!r} (bucket {bucket(prompt):.2f}) left the stable version"

        # promote: v2 takes all traffic; the old replica is drained and stopped, the model keeps one replica.
        promoted = rollout(deployment, "promote", MODEL, "v2")
        assert promoted.returncode == 0 and "all traffic to v2" in promoted.stdout, promoted.stderr
        after = wait_replicas(url, lambda s: versions_of(s) == ["v2"] and list(routed(s).values()) == ["v2"],
                              "the v1 replica replaced by v2")
        assert after["models"][0]["current"] == 1
        v2 = answers(client, CANARY + STABLE)
        assert all(v2[p] == canary[p] for p in CANARY) and all(v2[p] != v1[p] for p in STABLE)

        # start v3, then roll it back: its replica drains and goes, v2 answers everything again.
        started = rollout(deployment, "start", MODEL, "v3", "--model-dir", str(deployment["versions"]["v3"]),
                          "--weight", "0.5")
        assert started.returncode == 0, started.stderr
        wait_replicas(url, lambda s: sorted(routed(s).values()) == ["v2", "v3"], "a serving v3 replica")
        v3 = answers(client, CANARY)
        assert all(v3[p] != v2[p] for p in CANARY), "v3 took none of its share"
        rolled_back = rollout(deployment, "rollback", MODEL, "v3")
        assert rolled_back.returncode == 0 and "all traffic to v2" in rolled_back.stdout, rolled_back.stderr
        assert answers(client, CANARY + STABLE) == v2  # at once: the table changed before the drain
        wait_replicas(url, lambda s: versions_of(s) == ["v2"], "the v3 replica drained and stopped")
        time.sleep(0.5)
    assert len(traffic.outcomes) > 10 and set(traffic.outcomes) == {"ok"}, \
        [o for o in traffic.outcomes if o != "ok"][:5]
    final = status(url)
    assert final["router"]["failed"] == 0
    assert httpx.get(f"{url}{ROLLOUTS}", headers=auth, timeout=10).json()["rollouts"] == [
        {"model": MODEL, "stable": "v2", "canary": None, "weight": 0.0}]
