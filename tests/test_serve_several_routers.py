"""Several routers sharing the fleet (router.count: 2) in the running system.

1. `exaserve serve` as a user runs it: two gateways, each over its own router, both answer; every router
   sees every replica; serve.json and `exaserve status` list both routers and gateways; SIGTERM stops all.
2. The control plane `exaserve serve` builds (ControlPlane, in this process so the test can take one router
   away; real agent and replica processes, real ZeroMQ with CURVE, real HTTP): a stream of requests through
   gateway 0 while router 1 stops: 0 failures there; status marks router 1 lost; the replicas go on serving.
3. router.prefix_mode: precise (the control plane in this process, to watch router 1's index): a prompt served
   through gateway 0 reaches router 1's index through the engine's KV events (not its own choices), and is
   routed by affinity the first time it comes through gateway 1.
Echo replicas in 1 and 2: the figures are the serving path's own; the reference engine in 3 (KV events).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from serve_harness import start_serve, stop_serve
from waiting import wait_for

pytestmark = pytest.mark.process


def echo_site(tmp_path: Path, count: int = 2) -> Path:
    site = {"site": "two-routers", "cluster": {"nodes": 1, "nodelist": "localhost"},
            "heartbeat": {"interval": "1s"}, "scheduler": {"tick_interval": "500ms"},
            "router": {"count": count, "replica_heartbeat": "500ms"},
            "run_dir": str(tmp_path / "run"), "weight_cache": {"l3_path": str(tmp_path / "models")},
            "models": [{"model_name": "echo", "engine": "echo", "replicas": 2, "min_replicas": 2,
                        "max_seq_len": 4096}]}
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump(site))
    return path


def complete(http: httpx.Client, url: str, text: str = "hello routers") -> int:
    response = http.post(f"{url}/v1/completions", json={"model": "echo", "prompt": text, "max_tokens": 8})
    return response.status_code


def routers_seeing_every_replica(status: dict, replicas: int = 2) -> bool:
    routers = status["router"].get("routers", [])
    return len(routers) == 2 and all(r["state"] == "serving" and r["replicas"] == replicas for r in routers)


def test_serve_with_two_routers_answers_on_both_gateways_and_lists_them(tmp_path):
    process, url, lines = start_serve(echo_site(tmp_path))
    try:
        state = json.loads((tmp_path / "run" / "serve.json").read_text())
        gateways = state["gateways"]
        assert len(gateways) == 2 and gateways[0] == url and len({r["backend"] for r in state["routers"]}) == 2
        with httpx.Client(timeout=30) as http:
            wait_for(lambda: routers_seeing_every_replica(http.get(f"{url}/v1/exaserve/status").json()), 30,
                     "both routers to see both replicas")
            for gateway in gateways:
                assert [complete(http, gateway) for _ in range(5)] == [200] * 5
            # each gateway's requests went through its own router (the counts of both reach status)
            wait_for(lambda: [r["accepted"] for r in http.get(f"{url}/v1/exaserve/status").json()["router"]["routers"]]
                     == [5, 5], 10, "5 requests counted by each router")
        table = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "status", "--run-dir", str(tmp_path / "run")],
                               capture_output=True, text=True, timeout=30, env={**os.environ, "COLUMNS": "250"})
        assert table.returncode == 0, table.stderr
        assert "routers" in table.stdout, table.stdout
        for router in state["routers"]:
            assert router["backend"] in table.stdout and router["gateway"] in table.stdout
    except BaseException:
        process.kill()
        raise
    stop_serve(process, lines)


def in_process_plane(site_file: Path, tmp_path: Path):
    """The control plane `exaserve serve` builds, in this process (so a test can look into its routers), with
    gateway 0 served on a thread: (plane, gateway 0's server, the signal handlers to put back)."""
    import uvicorn

    from exaserve_hpc.transport import CURVE_JOB_DIR_VARIABLE
    from exaserve_hpc.engine.block_manager import install_block_hash_salt
    from exaserve_hpc.config.schema import load_site
    from exaserve_hpc.app.control_plane import ControlPlane, PlaneSettings
    from exaserve_hpc.app.serve import private_run_dir, run_keys

    site = load_site(site_file)
    run_dir = private_run_dir(tmp_path / "run")
    keys = run_keys(run_dir)
    install_block_hash_salt(run_dir)  # as serve does: this run's router and gateway hash as its replicas
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    plane = ControlPlane(site, PlaneSettings(node="localhost", state_dir=run_dir.path, port=0, curve=keys,
                                             replica_env={CURVE_JOB_DIR_VARIABLE: str(run_dir.path.absolute())},
                                             show_progress=False))
    gateway0 = uvicorn.Server(uvicorn.Config(plane.app, log_level="warning"))
    threading.Thread(target=gateway0.run, kwargs={"sockets": [plane.listener]}, daemon=True).start()
    return plane, gateway0, handlers


def stop_plane(plane, gateway0, handlers: dict) -> None:
    from exaserve_hpc.engine.block_manager import set_block_hash_salt
    gateway0.should_exit = True
    plane.shutdown()
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    set_block_hash_salt(b"")  # the run's salt was this test process's: later tests hash unsalted


def test_losing_one_router_leaves_the_other_serving_with_no_failure(tmp_path):
    plane, gateway0, handlers = in_process_plane(echo_site(tmp_path), tmp_path)
    try:
        url0, url1 = plane.gateway_urls
        wait_for(lambda: routers_seeing_every_replica(plane.controller.status()), 60, "both routers, both replicas")
        results: dict[str, list[int]] = {url0: [], url1: []}
        done = threading.Event()

        def stream(url: str) -> None:
            with httpx.Client(timeout=5) as http:
                while not done.is_set():
                    try:
                        results[url].append(complete(http, url, f"request {len(results[url])}"))
                    except httpx.HTTPError:
                        results[url].append(0)

        clients = [threading.Thread(target=stream, args=(u,), daemon=True) for u in (url0, url1)]
        for client in clients:
            client.start()
        wait_for(lambda: len(results[url0]) >= 20 and len(results[url1]) >= 20, 30, "requests on both gateways")
        before = len(results[url0])
        plane.routers.local[1].stop()  # router 1 is lost; its gateway's requests have nowhere to go
        wait_for(lambda: len(results[url0]) >= before + 50, 60, "gateway 0 serving after router 1 was lost")
        done.set()
        for client in clients:
            client.join(10)
        assert results[url0] and set(results[url0]) == {200}, f"gateway 0 failed: {sorted(set(results[url0]))}"
        status = plane.controller.status()
        assert [r["state"] for r in status["router"]["routers"]] == ["serving", "lost"]
        assert [r["state"] for r in status["replicas"]] == ["serving", "serving"]
        assert plane.controller.liveness() == []  # /health stays 200: a router still routes
        with httpx.Client(timeout=10) as http:
            assert http.get(f"{url0}/health").status_code == 200
            assert complete(http, url0) == 200
    finally:
        stop_plane(plane, gateway0, handlers)


def test_in_precise_mode_a_router_finds_the_prefix_another_router_placed(tmp_path):
    """KV events keep every router's index: a prompt first served through gateway 0 (router 0) is routed
    by affinity when it comes again through gateway 1, whose router never routed it."""
    from exaserve_hpc.cache.checkpoint import TINY_TOKENIZER_DIR
    from exaserve_hpc.engine.hf_tokenizer import HfTokenizer
    from serve_harness import write_local_site

    site_file = write_local_site(tmp_path, router={"count": 2, "policy": "prefix_affinity",
                                                   "prefix_mode": "precise"})
    plane, gateway0, handlers = in_process_plane(site_file, tmp_path)
    try:
        url0, url1 = plane.gateway_urls
        router1 = plane.routers.local[1]
        prompt = "A shared system prompt that is long enough to fill several KV blocks of sixteen tokens. " * 2
        prompt_ids = HfTokenizer.from_dir(TINY_TOKENIZER_DIR).encode(prompt)  # what the gateways send the routers

        def indexed_blocks(dispatcher) -> tuple[int, int]:  # (blocks of the prompt router 1's index holds, of all)
            hashes = dispatcher.policy.routing_key(prompt_ids).block_hashes
            return dispatcher.policy.index.deepest(hashes), len(hashes)

        wait_for(lambda: routers_seeing_every_replica(plane.controller.status()), 60, "both routers, both replicas")
        assert router1.call(indexed_blocks).result(5)[0] == 0  # nothing cached yet
        with httpx.Client(timeout=30) as http:
            first = http.post(f"{url0}/v1/completions", json={"model": "tiny-llama", "prompt": prompt,
                                                               "max_tokens": 2})
            assert first.status_code == 200, first.text
            # the engine's KV events (published as blocks fill) reach router 1, which never routed the prompt
            held, blocks = wait_for(lambda: (n := router1.call(indexed_blocks).result(5))[0] == n[1] and n, 20,
                                    "router 1's index to hold every block of the prompt")
            assert held == blocks >= 2
            repeat = http.post(f"{url1}/v1/completions", json={"model": "tiny-llama", "prompt": prompt,
                                                                "max_tokens": 2})
            assert repeat.status_code == 200, repeat.text
        # Once: in approximate mode router 1 would know nothing of this prompt yet.
        router = wait_for(lambda: (r := plane.controller.status()["router"])["prefix_hit_tokens"] >= 16
                          and [x["accepted"] for x in r["routers"]] == [1, 1] and r,
                          20, "both requests and the engine's prefix hit in status")
        assert router["routing"].get("affinity") == 1, router["routing"]
    finally:
        stop_plane(plane, gateway0, handlers)


def test_a_groups_concurrency_limit_holds_over_both_gateways(tmp_path):
    """One admission for every gateway of `exaserve serve`: max_concurrent_requests 2, three concurrent long
    streams of the group, two through gateway 0 and one through gateway 1: exactly one is refused (each gateway
    counting on its own would admit all three), the other two are answered whole."""
    from exaserve_hpc.quota.keys import hash_key
    from serve_harness import write_local_site

    key = "exa-split-key-0123456789abcdef"
    site_file = write_local_site(tmp_path, router={"count": 2}, gateway={"require_api_key": True})
    site = yaml.safe_load(site_file.read_text())
    site["quota_groups"] = [{"name": "lab", "account": "lab001", "max_concurrent_requests": 2,
                             "api_key_hashes": [hash_key(key)]}]
    site_file.write_text(yaml.safe_dump(site))
    process, url, lines = start_serve(site_file)
    try:
        gateways = json.loads((tmp_path / "run" / "serve.json").read_text())["gateways"]
        auth = {"Authorization": f"Bearer {key}"}
        with httpx.Client(timeout=30) as http:
            wait_for(lambda: http.get(f"{url}/health").status_code == 200, 60, "a replica serving")
        results: list[tuple] = []  # (gateway, status, completion tokens, when it ended)
        start = threading.Barrier(3)

        def long_stream(gateway: str) -> None:
            body = {"model": "tiny-llama", "prompt": "tell me", "max_tokens": 1200, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            with httpx.Client(timeout=300) as http:
                start.wait()
                with http.stream("POST", f"{gateway}/v1/completions", json=body, headers=auth) as response:
                    text = response.read().decode() if response.status_code != 200 else "".join(response.iter_text())
                usage = [json.loads(line[6:])["usage"] for line in text.splitlines()
                         if line.startswith("data: {") and '"usage":{' in line]
                results.append((gateway, response.status_code, usage[-1]["completion_tokens"] if usage else text,
                                time.monotonic()))

        threads = [threading.Thread(target=long_stream, args=(g,)) for g in (gateways[0], gateways[1], gateways[0])]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        statuses = sorted(status for _, status, _, _ in results)
        assert statuses == [200, 200, 429], results
        refused = next(r for r in results if r[1] == 429)
        assert "max_concurrent_requests" in refused[2], refused
        served = [r for r in results if r[1] == 200]
        assert all(tokens == 1200 for _, _, tokens, _ in served), results
        assert all(ended > refused[3] for *_, ended in served), "the streams were not in flight together"
        with httpx.Client(timeout=60) as http:  # both slots free again, whichever gateway took them
            for gateway in gateways:
                assert http.post(f"{gateway}/v1/completions", headers=auth,
                                 json={"model": "tiny-llama", "prompt": "x", "max_tokens": 2}).status_code == 200
    except BaseException:
        process.kill()
        raise
    stop_serve(process, lines)
