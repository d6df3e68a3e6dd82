"""A Hugging Face checkpoint served end to end: `exaserve model import`, then `exaserve serve`, asked with the
official openai client.

The checkpoint is the tiny random Llama-3-style one transformers wrote (tests/fixtures/hf/llama3: byte-level
BPE tokenizer, chat template with special tokens, two EOS ids in its generation config). What the replica
receives is pinned through what it answers: the expected continuations are computed here, in the test process,
by the reference engine from transformers' own token ids (golden.json), so a gateway that rendered or
tokenized the prompt differently would answer other text and another prompt token count.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import yaml

from exaserve_hpc.cache.checkpoint import load_checkpoint
from exaserve_hpc.engine.base import EngineRequest
from exaserve_hpc.engine.hf_tokenizer import HfTokenizer
from exaserve_hpc.engine.reference import ReferenceEngine
from serve_harness import ROOT, start_serve, stop_serve

pytestmark = pytest.mark.process

FIXTURE = ROOT / "tests" / "fixtures" / "hf" / "llama3"
GOLDEN = json.loads((FIXTURE.parent / "golden.json").read_text())["families"]["llama3"]
MODEL, EOS_MODEL = "llama3-tiny", "llama3-eos"


def exaserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", *args], capture_output=True, text=True,
                          timeout=120)


def continuation(prompt_ids: list[int], max_tokens: int, *, temperature: float = 0.0, seed=None,
                 eos=None) -> tuple[list[int], str]:
    """(tokens, finish reason) the reference engine gives for these ids, in this process."""
    config, weights = load_checkpoint(FIXTURE, verify=False)
    engine = ReferenceEngine.from_weights(config, weights, max_seq_len=256)
    if eos is not None:
        engine.eos_token_ids = tuple(eos)
    engine.add_request(EngineRequest("x", prompt_ids, max_tokens, temperature=temperature, seed=seed))
    tokens, reason = [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            reason = out.finish_reason or reason
    return tokens, reason


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One server with the fixture imported twice: as it is, and with EOS ids that greedy output meets."""
    tmp = tmp_path_factory.mktemp("hf-serve")
    store = tmp / "models"
    result = exaserve("model", "import", str(FIXTURE), "--name", MODEL, "--store", str(store))
    assert result.returncode == 0, result.stdout + result.stderr
    # An EOS list each of whose ids ends a request: the completion prompt's 4th greedy token, and a token the
    # first chat case's greedy answer meets before that one.
    greedy = GOLDEN["greedy_ids"]
    chat, _ = continuation(GOLDEN["chat"][0]["ids"], 12, eos=[])
    first = greedy[3]
    second = next(t for i, t in enumerate(chat) if i >= 2 and t != first and t not in greedy[:4]
                  and first not in chat[:i])
    eos_ids = [first, second]
    eos_source = tmp / "eos-source"
    shutil.copytree(FIXTURE, eos_source)
    (eos_source / "generation_config.json").write_text(json.dumps({"bos_token_id": 480, "eos_token_id": eos_ids}))
    result = exaserve("model", "import", str(eos_source), "--name", EOS_MODEL, "--store", str(store))
    assert result.returncode == 0, result.stdout + result.stderr

    site = yaml.safe_load((ROOT / "site-configs" / "local.yaml").read_text())
    site["weight_cache"]["l3_path"] = str(store)
    site["run_dir"] = str(tmp / "run")
    site["scheduler"]["min_replicas_per_model"] = 1
    site["models"] = [{"model_name": name, "engine": "reference", "replicas": 1, "max_seq_len": 256}
                      for name in (MODEL, EOS_MODEL)]
    site_file = tmp / "site.yaml"
    site_file.write_text(yaml.safe_dump(site))
    process, url, lines = start_serve(site_file)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        yield client, eos_ids
    except BaseException:
        process.kill()
        raise
    stop_serve(process, lines)


def text_of(stream) -> tuple[str, str, object]:
    """(streamed text, finish reason, usage) of a chat or completion stream."""
    pieces, reason, usage = [], None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = getattr(choice, "delta", None)
            pieces.append((delta.content if delta is not None else choice.text) or "")
            reason = choice.finish_reason or reason
    return "".join(pieces), reason, usage


def test_chat_sends_the_replica_transformers_rendering_of_the_chat_template(served):
    client, _ = served
    tokenizer = HfTokenizer.from_dir(FIXTURE)
    for case in (c for c in GOLDEN["chat"] if c.get("add_generation_prompt") and "ids" in c):
        tokens, reason = continuation(case["ids"], 12)
        answer = client.chat.completions.create(model=MODEL, messages=case["messages"], max_tokens=12,
                                                temperature=0)
        assert answer.usage.prompt_tokens == len(case["ids"]), case["messages"]
        assert answer.choices[0].message.content == tokenizer.decode(tokens), case["messages"]
        assert answer.usage.completion_tokens == len(tokens) + (reason == "stop")
        streamed, stream_reason, usage = text_of(client.chat.completions.create(
            model=MODEL, messages=case["messages"], max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        assert streamed == answer.choices[0].message.content and stream_reason == answer.choices[0].finish_reason
        assert usage.prompt_tokens == len(case["ids"]) and usage.completion_tokens == answer.usage.completion_tokens


def test_completions_use_the_model_tokens_and_greedy_output_matches_transformers(served):
    client, _ = served
    tokenizer = HfTokenizer.from_dir(FIXTURE)
    answer = client.completions.create(model=MODEL, prompt=GOLDEN["prompt_text"], max_tokens=15, temperature=0)
    assert answer.usage.prompt_tokens == len(GOLDEN["prompt_ids"])  # BOS added, as transformers encodes it
    assert answer.usage.completion_tokens == 15 and answer.choices[0].finish_reason == "length"
    assert answer.choices[0].text == tokenizer.decode(GOLDEN["greedy_ids"][:15])


def test_streamed_text_equals_the_whole_text_with_multibyte_characters(served):
    """Sampled output (seeded, so both requests draw the same tokens) that holds characters split over
    several byte-level tokens: the stream never shows half of one."""
    client, _ = served
    tokenizer = HfTokenizer.from_dir(FIXTURE)
    prompt = "Café in 東京 🙂 and"
    ids = tokenizer.encode(prompt)
    seed = next(s for s in range(200) if any(ord(ch) > 127 and ch != "\ufffd" for ch in
                                              tokenizer.decode(continuation(ids, 24, temperature=1.0, seed=s)[0])))
    tokens, _ = continuation(ids, 24, temperature=1.0, seed=seed)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=1.0, seed=seed)
    assert whole.choices[0].text == tokenizer.decode(tokens)
    streamed, _, _ = text_of(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=1.0,
                                                       seed=seed, stream=True))
    assert streamed == whole.choices[0].text


def test_stop_strings_end_the_text_before_them_streamed_or_not(served):
    client, _ = served
    full = client.completions.create(model=MODEL, prompt=GOLDEN["prompt_text"], max_tokens=15, temperature=0)
    text = full.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    want = text[:text.index(stop)]
    answer = client.completions.create(model=MODEL, prompt=GOLDEN["prompt_text"], max_tokens=15, temperature=0,
                                       stop=[stop])
    assert answer.choices[0].text == want and answer.choices[0].finish_reason == "stop"
    streamed, reason, _ = text_of(client.completions.create(model=MODEL, prompt=GOLDEN["prompt_text"],
                                                            max_tokens=15, temperature=0, stop=[stop], stream=True))
    assert streamed == want and reason == "stop"


def test_every_eos_id_of_the_generation_config_ends_a_request(served):
    client, eos_ids = served
    tokenizer = HfTokenizer.from_dir(FIXTURE)
    greedy = GOLDEN["greedy_ids"]
    answer = client.completions.create(model=EOS_MODEL, prompt=GOLDEN["prompt_text"], max_tokens=15, temperature=0)
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].text == tokenizer.decode(greedy[:3])
    assert answer.usage.completion_tokens == 4  # the EOS token counts, and is not returned
    case = GOLDEN["chat"][0]
    chat, _ = continuation(case["ids"], 12, eos=[])
    stop_at = chat.index(eos_ids[1])
    for stream in (False, True):
        reply = client.chat.completions.create(model=EOS_MODEL, messages=case["messages"], max_tokens=12,
                                               temperature=0, stream=stream)
        text, reason, _ = text_of(reply) if stream else (reply.choices[0].message.content,
                                                         reply.choices[0].finish_reason, None)
        assert (text, reason) == (tokenizer.decode(chat[:stop_at]), "stop")


def test_a_corrupted_shard_of_an_imported_model_is_refused_by_name_when_served(tmp_path):
    """Imported, then one byte of the shard flipped in the store: the replica never serves the bad bytes; the
    controller names the file and says the store's copy must be repaired (no restart loop over every node)."""
    store = tmp_path / "models"
    result = exaserve("model", "import", str(FIXTURE.parent / "qwen2"), "--name", "qwen2-tiny", "--store", str(store))
    assert result.returncode == 0, result.stdout + result.stderr
    shard = store / "qwen2-tiny" / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-50] ^= 0xFF
    shard.write_bytes(bytes(data))
    site = yaml.safe_load((ROOT / "site-configs" / "local.yaml").read_text())
    site["weight_cache"]["l3_path"] = str(store)
    site["run_dir"] = str(tmp_path / "run")
    site["scheduler"]["min_replicas_per_model"] = 1
    site["models"] = [{"model_name": "qwen2-tiny", "engine": "reference", "replicas": 1, "max_seq_len": 256}]
    site_file = tmp_path / "site.yaml"
    site_file.write_text(yaml.safe_dump(site))
    process = subprocess.Popen([sys.executable, "-m", "exaserve_hpc.cli", "serve", "--site", str(site_file),
                                "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 90
        for line in process.stdout:
            lines.append(line)
            if "stays failed" in line or time.monotonic() > deadline:
                break
        log = "".join(lines)
        assert "stays failed" in log, log
        refused = [line for line in lines if "ChecksumError" in line]
        assert refused and all(str(shard) in line for line in refused), log
        assert not any("serving" in line and " at http" in line for line in lines), log
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=45)
        finally:
            if process.poll() is None:
                process.kill()
