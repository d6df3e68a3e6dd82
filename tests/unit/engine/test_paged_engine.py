"""ReferenceEngine over the paged KV cache: prefix caching, chunked prefill,
preemption, fp8, stats."""

import numpy as np
import pytest

from exaserve_hpc.cache.checkpoint import TinyModelSpec, create_tiny_checkpoint, load_checkpoint
from exaserve_hpc.engine.base import EngineRequest
from exaserve_hpc.engine.kv_cache import DecodeBatchKV, PagedKVCache
from exaserve_hpc.engine.reference import ReferenceEngine
from exaserve_hpc.engine.tokenizer import ByteTokenizer

SPEC = TinyModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=172,
                     max_position=512, shards=1, seed=1)
TOK = ByteTokenizer()
SYSTEM = "You are a helpful assistant on a supercomputer. Answer briefly and precisely. "


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_checkpoint(create_tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny", SPEC))


@pytest.fixture
def make(loaded):
    def factory(**kwargs):
        kwargs.setdefault("max_wait_ms", 0)
        kwargs.setdefault("max_seq_len", 512)
        return ReferenceEngine.from_weights(*loaded, **kwargs)
    return factory


def drain(engine, max_steps=20_000, check=False):
    tokens, final = {}, {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                final[out.request_id] = out
        if check:
            engine.blocks.check_invariants()
    assert not engine.has_unfinished()
    return {rid: tokens.get(rid, []) for rid in final}, final


def questions(n):
    return [EngineRequest(f"q{i}", TOK.encode(SYSTEM + f"Question {i}: what is {i} squared?"),
                          12, stop_token_ids=()) for i in range(n)]


def run_one_by_one(engine, reqs):
    out = {}
    for r in reqs:
        engine.add_request(r)
        out.update(drain(engine)[0])
    return out


def test_prefix_caching_skips_shared_blocks_and_keeps_greedy_output(make):
    shared = len(TOK.encode(SYSTEM + "Question "))  # 88 tokens: 5 full blocks of 16 shared
    assert shared == 88
    reqs = questions(4)
    on, off = make(enable_prefix_caching=True), make(enable_prefix_caching=False)
    got_on, got_off = run_one_by_one(on, reqs), run_one_by_one(off, reqs)
    assert got_on == got_off and all(len(t) == 12 for t in got_on.values())
    s_on, s_off = on.stats(), off.stats()
    assert s_on["prefix_hit_tokens"] == 3 * (shared // 16) * 16
    assert s_off["prefix_hit_tokens"] == 0
    assert s_off["prefill_tokens"] - s_on["prefill_tokens"] == s_on["prefix_hit_tokens"]
    assert 0 < s_on["prefix_hit_rate"] < 1
    # Finished requests leave their full blocks cached (free, reusable).
    assert s_on["kv_blocks_used"] == 0 and s_on["kv_blocks_cached"] > 0
    assert s_off["kv_blocks_cached"] == 0


def test_concurrent_requests_share_prefix_blocks(make):
    engine = make(kv_cache_dtype="fp32")
    first, *rest = questions(5)
    engine.add_request(first)
    early = engine.step()  # first request's prompt is now computed and its blocks named
    for r in rest:
        engine.add_request(r)
    early += engine.step()
    assert engine.stats()["prefix_hit_tokens"] == 4 * 80
    used_shared = engine.stats()["kv_blocks_used"]
    tokens, _ = drain(engine, check=True)
    head = {}
    for out in early:
        head.setdefault(out.request_id, []).extend(out.new_token_ids)
    tokens = {rid: head.get(rid, []) + t for rid, t in tokens.items()}
    alone = run_one_by_one(make(kv_cache_dtype="fp32", enable_prefix_caching=False), questions(5))
    assert tokens == alone
    # 5 sequences of ~115 tokens would need 5 * 8 blocks without sharing.
    assert used_shared <= 5 * 8 - 4 * 5


def test_chunked_prefill_interleaves_and_keeps_greedy_output(make):
    long = EngineRequest("long", TOK.encode("x" * 300 + "long tail"), 8, stop_token_ids=())
    short = EngineRequest("short", TOK.encode("hi"), 8, stop_token_ids=())
    results = {}
    for chunked in (True, False):
        engine = make(chunked_prefill=chunked, prefill_chunk_tokens=32, kv_cache_dtype="fp32")
        engine.add_request(long)
        engine.add_request(short)
        first_step, last_step = {}, {}
        for step in range(200):
            for out in engine.step():
                first_step.setdefault(out.request_id, step)
                last_step[out.request_id] = step
            if not engine.has_unfinished():
                break
        results[chunked] = first_step
        if chunked:  # the short one decoded all 8 tokens while the long one prefilled
            assert last_step["short"] == 7 < first_step["long"]
        assert engine.stats()["prefill_tokens"] == len(long.prompt_token_ids) + 3
    # Chunked: the long prompt takes ceil(310 / 32) = 10 steps; the short one answers at once.
    assert results[True] == {"short": 0, "long": 9}
    assert results[False] == {"short": 0, "long": 0}
    tokens = {}
    for chunked in (True, False):
        engine = make(chunked_prefill=chunked, prefill_chunk_tokens=32, kv_cache_dtype="fp32")
        engine.add_request(long)
        tokens[chunked] = drain(engine)[0]
    assert tokens[True] == tokens[False]


def test_preemption_with_a_tiny_pool_finishes_everything_identically(make):
    reqs = [EngineRequest(f"p{i}", TOK.encode(f"request number {i} " * 2), 30,
                          stop_token_ids=()) for i in range(6)]
    roomy = make(kv_cache_dtype="fp32")
    for r in reqs:
        roomy.add_request(r)
    want, _ = drain(roomy)
    # Each request needs ceil((37 + 29) / 8) = 9 blocks; 12 hold one and a bit.
    tiny = make(kv_cache_dtype="fp32", block_size=8, num_kv_blocks=12)
    for r in reqs:
        tiny.add_request(r)
    got, final = drain(tiny, check=True)
    assert got == want
    assert all(f.finish_reason == "length" and f.completion_tokens == 30 for f in final.values())
    stats = tiny.stats()
    assert stats["preemptions"] > 0 and stats["kv_blocks_used"] == 0
    with pytest.raises(ValueError, match="need 13 KV blocks of 8 but the pool has 12"):
        tiny.add_request(EngineRequest("huge", [256] * 50, 50))


def test_fp8_halves_memory_and_stays_close_to_fp16(make, loaded):
    fp16, fp8 = make(kv_cache_dtype="fp16"), make(kv_cache_dtype="fp8")
    assert fp8.kv.bytes_per_token * 2 == fp16.kv.bytes_per_token
    assert fp8.kv.nbytes * 2 == fp16.kv.nbytes
    assert fp8.stats()["kv_bytes_per_token"] == 2 * 2 * 2 * 16  # K+V, 2 layers, 2 heads, hd 16
    # Logits of a 120-token prompt's last position through each cache dtype.
    model = fp16.model
    ids = TOK.encode(SYSTEM + "Compare the caches.")
    logits = {}
    for dtype in ("fp32", "fp16", "fp8"):
        pool = PagedKVCache(model.num_layers, model.kv_heads, model.head_dim, 8, 16, dtype)
        logits[dtype] = model.prefill(ids, pool.view(range(8), 0))
    # Measured: max |diff| / std(logits) = 3.7e-5 for fp16, 5.1e-3 for fp8 (vs fp32).
    scale = logits["fp32"].std()
    err16 = np.abs(logits["fp16"] - logits["fp32"]).max() / scale
    err8 = np.abs(logits["fp8"] - logits["fp32"]).max() / scale
    assert err16 < 2e-4
    assert 20 * err16 < err8 < 0.03, (err16, err8)  # really quantised, still close
    assert np.argmax(logits["fp8"]) == np.argmax(logits["fp32"])
    # Greedy continuations: measured agreement of the first tokens.
    outs = {d: run_one_by_one(e, questions(4)) for d, e in (("fp16", fp16), ("fp8", fp8))}
    agree = [sum(a == b for a, b in zip(outs["fp16"][k], outs["fp8"][k])) for k in outs["fp16"]]
    assert sum(agree) >= 0.5 * 4 * 12, agree


def test_unsupported_kv_dtype_is_rejected(make):
    with pytest.raises(ValueError, match="kv_cache_dtype 'int4' is not supported; choose one of"):
        make(kv_cache_dtype="int4")


def test_stats_report_batches_latency_and_blocks(make):
    now = [0.0]
    engine = make(clock=lambda: now[0], max_batch_size=4)
    for r in questions(6):
        engine.add_request(r)
    while engine.has_unfinished():
        now[0] += 0.01
        engine.step()
    stats = engine.stats()
    for key in ("queue_depth", "running", "tokens_generated", "requests_finished", "kv_used"):
        assert key in stats
    assert stats["tokens_generated"] == 6 * 12 and stats["requests_finished"] == 6
    assert stats["batch_size_hist"]["4"] >= 11 and set(stats["batch_size_hist"]) <= {"1", "2", "4"}
    # Every step advances the clock 10 ms after the step is scheduled.
    assert stats["tpot_ms"]["count"] == 6 and stats["tpot_ms"]["p50"] == pytest.approx(10.0)
    assert stats["ttft_ms"]["count"] == 6
    assert stats["ttft_ms"]["p99"] > stats["ttft_ms"]["p50"]  # two waited for a free slot
    assert stats["kv_blocks_total"] == 4 * 512 // 16 and stats["kv_cache_dtype"] == "fp16"


def test_batched_decode_attention_equals_per_sequence(make):
    model = make().model
    prompts = [list(range(1, 1 + n)) for n in (30, 40, 20)]
    tables = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    results = {}
    for mode in ("per-sequence", "batched", "too ragged"):
        pool = PagedKVCache(model.num_layers, model.kv_heads, model.head_dim, 12, 16, "fp32")
        counts = [len(p) for p in prompts]
        for ids, table in zip(prompts, tables):
            model.prefill(ids, pool.view(table, 0))
        rows, tokens = [], [65, 66, 67]
        for _ in range(3):
            views = [pool.view(t, c) for t, c in zip(tables, counts)]
            if mode == "per-sequence":
                logits = model.decode(list(zip(tokens, views)))
            else:
                batch = DecodeBatchKV(views)
                if mode == "too ragged":  # padding would exceed the useful tokens: per sequence
                    batch.padded = lambda: False
                else:
                    assert batch.padded()
                logits = model.decode_tokens(tokens, batch)
            rows.append(logits)
            counts = [c + 1 for c in counts]
            tokens = [int(t) for t in logits.argmax(axis=1)]
        results[mode] = np.stack(rows)
    np.testing.assert_allclose(results["batched"], results["per-sequence"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(results["too ragged"], results["per-sequence"])
    with pytest.raises(ValueError, match="have no room for one more"):
        DecodeBatchKV([PagedKVCache(1, 1, 8, 4, 4).view([0], 4)])
    pool = PagedKVCache(1, 1, 8, 40, 4)
    lopsided = DecodeBatchKV([pool.view([i], 1) for i in range(3)] + [pool.view(range(3, 40), 140)])
    assert not lopsided.padded()  # 4 x 37 blocks of 4 for 147 tokens: the model goes per sequence
