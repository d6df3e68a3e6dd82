"""KV events are private to the run (issue 25 item 4).

A real `exaserve serve` in precise prefix mode: its replica process publishes KV events on a CURVE PUB that
admits only the run's client key (the router's). A subscriber holding that key receives the events, and their
block hashes are the run's salted ones; a plain subscriber and one with a CURVE key pair of its own (knowing the
publisher's public key) receive nothing. The same prompt's block hashes differ from one run to the next (each
run's salt, RUN_DIR/keys/kv-salt, 0600), while the router of the run still routes by them (precise mode works).
Before this change every local user could subscribe and the hashes were unsalted blake2b of the token ids.
"""

from __future__ import annotations

import json
import re
import stat
import time
import urllib.request
from pathlib import Path

import openai
import pytest
import zmq
from serve_harness import start_serve, stop_serve, write_local_site

from exaserve_hpc.cache.checkpoint import TINY_TOKENIZER_DIR
from exaserve_hpc.engine.block_manager import (
    block_hash_salt, install_block_hash_salt, prompt_block_hashes, set_block_hash_salt
)
from exaserve_hpc.engine.hf_tokenizer import HfTokenizer
from exaserve_hpc.engine.kv_events import BlockStored, decode_batch
from exaserve_hpc.jobdir import JobDir, run_salt
from exaserve_hpc.router.prefix_index import EngineBlockHasher
from exaserve_hpc.transport import make_curve_keys

PROMPT = "The access code is 4711. A shared system prompt long enough to fill several KV blocks of tokens. " * 2
BLOCK = 16
REPLICAS = 2  # site-configs/local.yaml's
FOLLOWING = re.compile(r"following KV events of replica (\S+) at (\S+) \(CURVE server key (\S+)\)")


def subscriber(context: zmq.Context, publishers: list[tuple[str, str]], curve: bool = False,
               keys: tuple[bytes, bytes] | None = None, watch: list | None = None):
    """A SUB socket connected to every (endpoint, server key) publisher: plain, or CURVE with `keys` (default: a
    key pair of its own); with `watch`, its handshake monitor is appended to it first."""
    sock = context.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    if curve:
        sock.curve_publickey, sock.curve_secretkey = keys or zmq.curve_keypair()
    if watch is not None:
        watch.append(sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED))
    for endpoint, server_key in publishers:
        if curve:
            sock.curve_serverkey = server_key.encode()
        sock.connect(endpoint)
    return sock


def wait_handshakes(sock, monitor, count: int, timeout: float = 30.0) -> None:
    """Until `count` CURVE handshakes of `sock` succeeded (a PUB sends nothing to a peer before)."""
    from zmq.utils.monitor import recv_monitor_message
    try:
        for _ in range(count):
            if not monitor.poll(int(timeout * 1000)):
                raise AssertionError("the subscriber with the run's key completed no handshake")
            recv_monitor_message(monitor)
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)


def drain(sock) -> list:
    got = []
    while sock.poll(0):
        got.append(sock.recv_multipart())
    return got


def serve_run(tmp: Path, site_file: Path):
    """One serve run: (its hashes of PROMPT's blocks seen by a keyed subscriber, what the strangers got,
    the run's salt, the router's routing counters)."""
    process, url, lines = start_serve(site_file, env={"EXASERVE_LOG_LEVEL": "INFO"})  # the router names the PUB
    context = zmq.Context()
    try:
        deadline = time.monotonic() + 30
        publishers: dict[str, tuple[str, str]] = {}  # every replica's: a request may go to any of them
        while len(publishers) < REPLICAS and time.monotonic() < deadline:
            publishers = {m.group(1): m.groups()[1:] for m in map(FOLLOWING.search, list(lines)) if m}
            time.sleep(0.1)
        assert len(publishers) == REPLICAS, "the router did not follow CURVE KV-event publishers:\n" + "".join(lines)
        publishers = list(publishers.values())
        keys_dir = tmp / "run" / "keys"
        assert stat.S_IMODE((keys_dir / "kv-salt").stat().st_mode) == 0o600
        run_keys = ((keys_dir / "client.pub").read_bytes(), (keys_dir / "client.key").read_bytes())
        plain = subscriber(context, publishers)
        foreign = subscriber(context, publishers, curve=True)  # its own key pair: knows the public keys only
        watch: list = []
        keyed = subscriber(context, publishers, curve=True, keys=run_keys, watch=watch)
        wait_handshakes(keyed, watch[0], REPLICAS)
        time.sleep(0.5)  # its subscription reaches the publisher; the strangers had as long to try
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
        router: dict = {}
        keyed_got, plain_got, foreign_got = [], [], []
        for i in range(20):
            client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2)
            time.sleep(0.2)
            keyed_got += drain(keyed)
            plain_got += drain(plain)
            foreign_got += drain(foreign)
            with urllib.request.urlopen(f"{url}/v1/exaserve/status", timeout=10) as response:
                router = json.load(response)["router"]
            if keyed_got and router["routing"].get("affinity") and router["prefix_hit_tokens"] > 0 and i >= 3:
                break
        time.sleep(0.5)
        plain_got += drain(plain)
        foreign_got += drain(foreign)
        stored = [h for _t, _s, payload in keyed_got for e in decode_batch(payload).events
                  if isinstance(e, BlockStored) for h in e.block_hashes]
        for sock in (keyed, plain, foreign):
            sock.close()
        salt = (keys_dir / "kv-salt").read_bytes()
    except BaseException:
        process.kill()
        process.wait()
        raise
    finally:
        context.term()
    stop_serve(process, lines)
    return stored, plain_got + foreign_got, salt, router


@pytest.mark.process
def test_only_the_runs_key_receives_kv_events_and_each_run_salts_its_hashes(tmp_path: Path):
    site_file = write_local_site(tmp_path, router={"policy": "prefix_affinity", "prefix_mode": "precise",
                                                   "block_size": BLOCK})
    tokens = HfTokenizer.from_dir(TINY_TOKENIZER_DIR).encode(PROMPT)
    unsalted = EngineBlockHasher(BLOCK, salt=b"")(tokens)
    runs = []
    for _ in range(2):  # two runs of the same server: new keys, new salt each
        stored, strangers, salt, router = serve_run(tmp_path, site_file)
        assert strangers == [], f"a subscriber without the run's key received {len(strangers)} messages"
        assert stored, "the run's key received no KV events"
        salted = EngineBlockHasher(BLOCK, salt=salt)(tokens)
        assert salted[0] in stored and not set(unsalted) & set(stored)  # the run's salted names, never plain ones
        assert router["routing"].get("affinity", 0) >= 1 and router["prefix_hit_tokens"] >= BLOCK, router
        runs.append((salt, salted))
    assert runs[0][0] != runs[1][0] and not set(runs[0][1]) & set(runs[1][1])


def test_runs_salt_their_block_hashes_and_engine_and_router_agree(tmp_path: Path):
    before = block_hash_salt()
    try:
        tokens = list(range(100, 164))
        hashes = []
        for name in ("a", "b"):
            run = JobDir(tmp_path / name).ensure()
            make_curve_keys(run)
            assert len(run_salt(run)) == 32
            install_block_hash_salt(run)
            engine_side = prompt_block_hashes(tokens, BLOCK)  # what a replica of the run publishes
            assert EngineBlockHasher(BLOCK)(tokens) == engine_side  # what its router and gateway compute
            hashes.append(engine_side)
        assert not set(hashes[0]) & set(hashes[1])
        assert EngineBlockHasher(BLOCK).scheme != EngineBlockHasher(BLOCK, salt=b"").scheme  # never mixed up
    finally:
        set_block_hash_salt(before)
