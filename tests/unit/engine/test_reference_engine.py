"""ReferenceEngine: continuous batching, sampling, limits, abort, warm-up."""

import time

import numpy as np
import pytest

from exaserve_hpc.cache.checkpoint import TinyModelSpec, create_tiny_checkpoint, load_checkpoint
from exaserve_hpc.engine.base import Engine, EngineError, EngineRequest
from exaserve_hpc.engine.reference import ReferenceEngine
from exaserve_hpc.engine.sampling import sample
from exaserve_hpc.engine.tokenizer import EOS, ByteTokenizer

SPEC = TinyModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=172,
                     max_position=256, shards=2, seed=1)
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return create_tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny", SPEC)


@pytest.fixture(scope="module")
def loaded(ckpt):
    return load_checkpoint(ckpt)


@pytest.fixture
def make(loaded):
    def factory(**kwargs):
        kwargs.setdefault("max_wait_ms", 0)
        kwargs.setdefault("max_seq_len", 256)
        return ReferenceEngine.from_weights(*loaded, **kwargs)
    return factory


def req(rid, text="Hello, world", max_tokens=16, **kwargs):
    return EngineRequest(rid, TOK.encode(text), max_tokens, **kwargs)


def drain(engine, max_steps=10_000):
    """Run to completion; returns {id: (tokens, final StepOutput)}."""
    tokens, final = {}, {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            assert out.request_id not in final, "output after the final one"
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                final[out.request_id] = out
    assert not engine.has_unfinished()
    return {rid: (tokens.get(rid, []), final[rid]) for rid in final}


def test_engine_satisfies_protocol_and_loads_from_disk(ckpt):
    seen = []
    engine = ReferenceEngine(ckpt, max_seq_len=256, progress=lambda d, t: seen.append((d, t)))
    assert isinstance(engine, Engine)
    assert seen and seen[-1][0] == seen[-1][1]
    engine.warmup()
    with pytest.raises(ValueError, match="max_seq_len=512 exceeds the model's max_position=256"):
        ReferenceEngine(ckpt, max_seq_len=512)


def test_greedy_matches_a_plain_model_loop_and_is_deterministic(make, loaded):
    prompts = ["Hello, world", "The quick brown fox", "What is HPC?"]
    runs = []
    for dtype in ("fp32", "fp16"):  # fp16 K/V happen to change no greedy token here
        engine = make(kv_cache_dtype=dtype)
        for i, p in enumerate(prompts):
            engine.add_request(req(f"r{i}", p, max_tokens=24))
        runs.append(drain(engine))
    assert {k: v[0] for k, v in runs[0].items()} == {k: v[0] for k, v in runs[1].items()}
    engine = make()
    for i, p in enumerate(prompts):
        cache = engine.model.new_cache()
        logits, want = engine.model.prefill(TOK.encode(p), cache), []
        while len(want) < 24:
            want.append(int(np.argmax(logits)))
            if want[-1] == EOS:
                break
            logits = engine.model.decode([(want[-1], cache)])[0]
        tokens, final = runs[0][f"r{i}"]
        assert tokens == [t for t in want if t != EOS]
        # The tiny model must say something before any EOS.
        assert len(tokens) >= 3, (p, tokens, final)


def test_seeded_sampling_is_reproducible_and_seeds_differ(make):
    def run(seed):
        engine = make()
        engine.add_request(req("s", max_tokens=32, temperature=1.0, top_p=0.9, seed=seed,
                               stop_token_ids=()))
        return drain(engine)["s"][0]

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_request_joining_mid_batch_gets_the_same_tokens(make):
    target = dict(text="Join me later", max_tokens=20, temperature=0.7, seed=5)
    alone = make()
    alone.add_request(req("x", **target))
    want = drain(alone)["x"][0]

    engine = make(max_batch_size=8, decode_batch_size=3)
    for i in range(4):
        engine.add_request(req(f"bg{i}", f"background {i}" * (i + 1), max_tokens=30,
                               temperature=0.9 * (i % 2), seed=i, stop_token_ids=()))
    collected, final = {}, {}
    for step in range(60):
        if step == 5:
            assert engine.stats()["running"] == 4
            engine.add_request(req("x", **target))
        for out in engine.step():
            collected.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                final[out.request_id] = out
        if not engine.has_unfinished():
            break
    assert collected["x"] == want
    assert set(final) == {"x", "bg0", "bg1", "bg2", "bg3"}
    assert all(final[f"bg{i}"].completion_tokens == 30 for i in range(4))


def test_max_tokens_finishes_with_length(make):
    engine = make()
    engine.add_request(req("a", max_tokens=7, stop_token_ids=()))
    tokens, final = drain(engine)["a"]
    assert len(tokens) == 7
    assert (final.finish_reason, final.completion_tokens) == ("length", 7)
    assert final.prompt_tokens == len(TOK.encode("Hello, world"))


def test_stop_token_finishes_with_stop_and_is_not_returned(make):
    probe = make()
    probe.add_request(req("p", max_tokens=3, stop_token_ids=()))
    first = drain(probe)["p"][0][0]
    engine = make()
    engine.add_request(req("a", max_tokens=10, stop_token_ids=(first,)))
    outputs = engine.step()
    assert len(outputs) == 1
    out = outputs[0]
    assert (out.finished, out.finish_reason, out.new_token_ids, out.completion_tokens) == \
        (True, "stop", [], 1)
    assert not engine.has_unfinished()


def test_prompt_plus_max_tokens_over_max_seq_len_is_rejected(make):
    engine = make(max_seq_len=32)
    prompt = TOK.encode("x" * 19)  # 20 tokens with BOS
    with pytest.raises(ValueError, match=r"20 tokens \+ max_tokens 13 = 33 exceeds max_seq_len 32"):
        engine.add_request(EngineRequest("long", prompt, 13))
    engine.add_request(EngineRequest("fits", prompt, 12, stop_token_ids=()))  # exactly 32
    tokens, final = drain(engine)["fits"]
    assert (len(tokens), final.finish_reason) == (12, "length")


def test_abort_waiting_running_and_unknown(make):
    engine = make(max_batch_size=1)
    engine.add_request(req("run", max_tokens=50, stop_token_ids=()))
    engine.add_request(req("wait", max_tokens=50))
    engine.step()
    engine.step()
    assert engine.stats()["queue_depth"] == 1 and engine.stats()["running"] == 1
    stats = engine.stats()
    # 13 prompt tokens + 1 fed back = 14 computed; 15 tokens held need one 16-token block.
    assert stats["kv_tokens"] == 14 and stats["kv_blocks_used"] == 1
    assert stats["kv_blocks_total"] == 256 // 16 and stats["kv_used"] == pytest.approx(1 / 16)
    engine.abort("nobody")  # no-op
    engine.abort("wait")
    engine.abort("run")
    engine.abort("run")  # twice is fine
    outputs = {o.request_id: o for o in engine.step()}
    assert set(outputs) == {"run", "wait"}
    assert outputs["run"].finish_reason == "abort" and outputs["run"].completion_tokens == 2
    assert outputs["wait"].finish_reason == "abort" and outputs["wait"].completion_tokens == 0
    assert not engine.has_unfinished() and engine.step() == []
    assert engine.stats()["requests_aborted"] == 2


def test_batch_limits_and_stats(make):
    engine = make(max_batch_size=3, prefill_batch_size=2, decode_batch_size=2)
    for i in range(7):
        engine.add_request(req(f"r{i}", f"prompt {i}", max_tokens=5, stop_token_ids=()))
    admitted_per_step = []
    while engine.has_unfinished():
        before = engine.stats()["prefill_tokens"]
        engine.step()
        stats = engine.stats()
        assert stats["running"] <= 3
        admitted_per_step.append(stats["prefill_tokens"] - before)
    assert max(admitted_per_step) <= 2 * len(TOK.encode("prompt 0"))
    stats = engine.stats()
    assert stats["tokens_generated"] == 7 * 5 and stats["requests_finished"] == 7
    assert stats["prefill_tokens"] == 7 * len(TOK.encode("prompt 0"))
    assert stats["queue_depth"] == 0 and stats["kv_tokens"] == 0 and stats["kv_used"] == 0.0


def test_batching_window_holds_an_idle_engine(make):
    now = [100.0]
    engine = make(max_wait_ms=50, prefill_batch_size=4, clock=lambda: now[0])
    engine.add_request(req("a"))
    assert engine.step() == []  # waiting for company
    now[0] += 0.049
    assert engine.step() == []
    now[0] += 0.002
    assert [o.request_id for o in engine.step()] == ["a"]
    for rid in "bcde":  # a full prefill batch goes at once
        engine.add_request(req(rid))
    engine.abort("a")
    engine.step()
    assert engine.stats()["running"] == 4


def test_bad_requests_are_rejected_clearly(make):
    engine = make()
    engine.add_request(req("dup"))
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request(req("dup"))
    with pytest.raises(ValueError, match="token id 900 is outside"):
        engine.add_request(EngineRequest("v", [256, 900], 4))
    with pytest.raises(ValueError, match="temperature must be between 0 and 100"):
        req("t", temperature=-1.0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        req("p", top_p=0.0)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        req("m", max_tokens=0)
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        EngineRequest("e", [], 4)


def test_warmup_detects_broken_weights_and_shutdown(loaded, make):
    make().warmup()
    config, weights = loaded
    broken = {**weights, "lm_head": np.full_like(weights["lm_head"], np.nan)}
    engine = ReferenceEngine.from_weights(config, broken, max_seq_len=256)
    with pytest.raises(EngineError, match="non-finite"):
        engine.warmup()
    engine = make()
    engine.add_request(req("a"))
    engine.shutdown()
    engine.shutdown()
    assert not engine.has_unfinished()
    with pytest.raises(EngineError, match="shut down"):
        engine.step()
    with pytest.raises(EngineError, match="shut down"):
        engine.add_request(req("b"))


def test_sampling_rules():
    rng = np.random.default_rng(0)
    logits = np.array([0.0, 3.0, 2.9, -1.0])
    assert sample(logits, 0.0, 1.0, rng) == 1
    # top_p small enough keeps only the most likely token.
    assert {sample(logits, 1.0, 0.3, rng) for _ in range(50)} == {1}
    # Nucleus 0.9 of softmax([0,3,2.9,-1]) keeps tokens 1 and 2 only.
    assert {sample(logits, 1.0, 0.9, rng) for _ in range(200)} == {1, 2}
    draws = [sample(logits, 1.0, 1.0, np.random.default_rng(s)) for s in range(400)]
    assert set(draws) == {0, 1, 2, 3}
    assert draws == [sample(logits, 1.0, 1.0, np.random.default_rng(s)) for s in range(400)]
    with pytest.raises(ValueError, match="NaN or inf"):
        sample(np.array([0.0, np.nan]), 1.0, 1.0, rng)
    with pytest.raises(ValueError, match="1-D logits"):
        sample(np.zeros((2, 2)), 1.0, 1.0, rng)


def test_decode_throughput_batch_of_8(make):
    engine = make()
    for i in range(8):
        engine.add_request(req(f"r{i}", f"throughput {i}", max_tokens=100, stop_token_ids=()))
    engine.step()  # prefill
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    rate = 8 * steps / (time.perf_counter() - start)
    assert rate > 1000, f"{rate:.0f} tokens/s"
