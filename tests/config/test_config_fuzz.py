"""`exaserve config check` is bounded: every file of a deterministic corpus of 300 mutated site files
(fuzz_corpus.py, fixed seed) gives exit 0 or exit 2, each within a few seconds, never a traceback; the
hostile inputs found by hand each give exit 2 with a place in the file and what is allowed; a handful run
through the real CLI process."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from exaserve_hpc.cli import main as cli
from exaserve_hpc.config.schema import ConfigError, load_site

from tests.config.fuzz_corpus import ROOT, write_corpus

# A bound against hangs and blow-ups (an alias bomb or a huge hostlist used to run for minutes or until memory
# ran out), generous enough for a loaded 2-core CI machine; typical files take well under 0.1 s.
PER_FILE_SECONDS = 10.0


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("fuzz"), 300)


def test_every_mutated_site_file_exits_0_or_2_in_a_few_seconds(corpus_files, capsys):
    codes: dict[int, int] = {}
    slow = []
    for path in corpus_files:
        started = time.monotonic()
        code = cli.main(["config", "check", str(path)])
        took = time.monotonic() - started
        capsys.readouterr()
        codes[code] = codes.get(code, 0) + 1
        assert code in (0, 2), f"{path.name}: exit {code}"
        if took > PER_FILE_SECONDS:
            slow.append(f"{path.name}: {took:.1f}s")
    assert not slow, slow
    assert codes.get(2, 0) > 200, codes  # most mutations break the file: the corpus tests the error paths


def test_a_few_corpus_files_through_the_real_cli(corpus_files):
    for path in corpus_files[::60]:
        started = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "config", "check", str(path)],
                             capture_output=True, text=True, timeout=30, cwd=ROOT)
        assert run.returncode in (0, 2), f"{path.name}: exit {run.returncode}\n{run.stderr[-2000:]}"
        assert "Traceback" not in run.stderr, run.stderr[-2000:]
        assert time.monotonic() - started < 15


BOMB = "\n".join(['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
                 + [f"a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)])
BASE = "site: t\nmodels: [{model_name: m}]\n"


@pytest.mark.parametrize("text, where, allowed", [
    (BOMB + "\nsite: b\nmodels: *a8\n", "line 1", "at most 100000 values"),
    ("site: b\nmodels: [{model_name: m, engine: *a}]\nx: &a " + "[" * 12 + "1" + "]" * 12 + "\n", "line",
     "valid YAML"),  # an alias used before its anchor
    ("site: d\nmodels: " + "[" * 20000 + "]" * 20000 + "\n", "line 2", "at most 32 levels"),
    (BASE + "cluster: {gpu_memory: .inf}\n", "cluster.gpu_memory", "a finite number"),
    (BASE + "weight_cache: {l2_capacity: .nan}\n", "weight_cache.l2_capacity", "a finite number"),
    (BASE + "cluster: {nodelist: 'n[1-9999999999]', nodes: 4}\n", "cluster.nodelist", "at most 65536"),
    (BASE + "scheduler: {max_replicas_per_node: " + "9" * 5000 + "}\n", "line 3", "at most 40 digits"),
    (BASE + "scheduler: {max_moves_per_round: " + "9" * 30 + "}\n", "scheduler.max_moves_per_round",
     "at most 9223372036854775807"),
    (BASE + "scheduler: {max_replicas_per_node: true}\n", "scheduler.max_replicas_per_node", "integer"),
    (BASE + "cluster: {exclusive: 1}\n", "cluster.exclusive", "boolean"),
    (BASE + "heartbeat: {interval: 0}\n", "heartbeat.interval", "greater than 0"),
    (BASE + "scheduler: {tick_interval: .inf}\n", "scheduler.tick_interval", "a finite number"),
    (BASE + "router: {request_timeout: 0s}\n", "router.request_timeout", "greater than 0"),
    (BASE + "router: {first_token_timeout: 400d}\n", "router.first_token_timeout", "a year"),
    (BASE + "cluster: {host_memory: 5EiB}\n", "cluster.host_memory", "512MiB"),
    (BASE + "cluster: {host_memory: 99999999TiB}\n", "cluster.host_memory", "1 PiB"),
    (BASE + "batching: {max_wait_ms: .nan}\n", "batching.max_wait_ms", "finite"),
    (BASE + "gateway: {port: 8000}\ngateway: {port: 9000}\n", "line 4", "each key once per mapping"),
    ("site: t\nmodels: [{model_name: m, engine: echo, engine: reference}]\n", "line 2", "each key once"),
])
def test_each_hostile_input_is_one_clear_problem(tmp_path, text, where, allowed):
    path = tmp_path / "site.yaml"
    path.write_text(text)
    started = time.monotonic()
    with pytest.raises(ConfigError) as caught:
        load_site(path)
    assert time.monotonic() - started < PER_FILE_SECONDS
    message = str(caught.value)
    assert len(message) < 4000, message[:500]
    assert any(p.path.startswith(where) and allowed in p.allowed for p in caught.value.problems), message


def test_a_file_that_is_not_utf8_names_the_byte(tmp_path):
    path = tmp_path / "site.yaml"
    path.write_bytes(b"site: t\nmodels: [{model_name: \xff}]\n")
    with pytest.raises(ConfigError) as caught:
        load_site(path)
    (problem,) = caught.value.problems
    assert problem.path == "line 2 (byte 30)" and "0xff" in problem.found and "UTF-8" in problem.allowed


def test_the_shipped_site_files_still_pass():
    for path in sorted((ROOT / "site-configs").glob("*.yaml")):
        load_site(path)


def test_a_file_past_the_size_limit_is_refused_unread_and_one_just_under_it_answers_in_seconds(tmp_path):
    from exaserve_hpc.config.bounds import MAX_FILE_BYTES
    big = tmp_path / "big.yaml"
    big.write_text("site: b\nx:\n" + "- a\n" * (MAX_FILE_BYTES // 4))
    with pytest.raises(ConfigError) as caught:
        load_site(big)
    assert caught.value.problems[0].path == "(file)" and str(MAX_FILE_BYTES) in caught.value.problems[0].allowed
    under = tmp_path / "under.yaml"
    under.write_text("site: b\nmodels: [{model_name: m}]\nx:\n" + "- a\n" * (MAX_FILE_BYTES // 4 - 20))
    started = time.monotonic()
    with pytest.raises(ConfigError):
        load_site(under)
    assert time.monotonic() - started < 3 * PER_FILE_SECONDS
