"""Two `exaserve serve` of one user on one machine, started and stopped beside each other (issue 25 item 5).

Both sites put L2 under the same weight_cache.l2_path (a stand-in for /dev/shm). Each run's L2 directory holds
the run's identity (exaserve-l2-UID/AGENT@RUN), so neither server adopts, fills into or clears the other's
files: the first to stop leaves the other's L2 entries in place. For a bounded time the two are started together and stopped one after the other, each answering a
request while the other starts or stops: no agent crashes or restarts, every request is answered, every stop
exits 0. Before, both used exaserve-l2-UID/localhost: one server's exit removed the other's cache under it.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import openai
import pytest

from serve_harness import start_serve, stop_serve, write_local_site

pytestmark = pytest.mark.process

LOOP_SECONDS = 35  # no new cycle after this; with the last cycle the test takes about 60 s at most


def ask(url: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    return client.completions.create(model="tiny-llama", prompt="Hello there", max_tokens=4).choices[0].text


def test_two_servers_of_one_user_never_touch_each_others_l2(tmp_path: Path):
    shm = tmp_path / "shm"
    shm.mkdir()
    sites = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        sites.append(write_local_site(tmp_path / name, weight_cache={"l2_path": str(shm), "l3_path":
                                                                     str(tmp_path / "models")},
                                      model={"replicas": 1, "min_replicas": 1}))
    user_dir = shm / f"exaserve-l2-{os.getuid()}"
    crashes, outputs, cycles = [], [], 0
    deadline = time.monotonic() + LOOP_SECONDS
    while time.monotonic() < deadline:
        started: dict[int, tuple] = {}

        def start(i: int) -> None:
            started[i] = start_serve(sites[i])

        threads = [threading.Thread(target=start, args=(i,)) for i in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        try:
            assert set(started) == {0, 1}, "a server did not start"
            dirs = sorted(p.name for p in user_dir.iterdir())
            assert len(dirs) == 2 and all("@serve-" in d for d in dirs), dirs  # one L2 directory per run
            first, second = (0, 1) if cycles % 2 == 0 else (1, 0)
            assert ask(started[first][1]) and ask(started[second][1])
            process, url, lines = started[first]
            stop_serve(process, lines)  # one stops (its agent clears its L2) while the other serves
            left = [p.relative_to(user_dir) for p in user_dir.glob("*/*")] if user_dir.exists() else []
            assert left, "the stopped server's agent removed the running server's L2 entries"
            assert ask(started[second][1])
            process, url, lines = started[second]
            stop_serve(process, lines)
        finally:
            for process, _url, lines in started.values():
                if process.poll() is None:
                    process.kill()
                    process.wait()
                outputs.append("".join(lines))
        cycles += 1
    for text in outputs:
        crashes += [line for line in text.splitlines()
                    if "this node's agent (pid" in line or "Traceback" in line or "gave up" in line]
    assert cycles >= 2
    assert crashes == [], "\n".join(crashes)
    assert not user_dir.exists() or not list(user_dir.iterdir())  # both cleared their own, nothing left
