"""TimingEngine: virtual time, the reference engine's cache behaviour, scale."""

import heapq

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exaserve_hpc.cache.checkpoint import TinyModelSpec, create_tiny_checkpoint, load_checkpoint
from exaserve_hpc.engine.base import Engine, EngineRequest
from exaserve_hpc.engine.reference import ReferenceEngine
from exaserve_hpc.engine.batching import StepLimits
from exaserve_hpc.engine.timing import (DEFAULT_MAX_NUM_BATCHED_TOKENS, GPU_TIMINGS, GpuTimings, StepSample,
                                        TimingEngine, fit_timings)

SIMPLE = GpuTimings(step_overhead_s=1e-3, prefill_per_token_s=1e-4, decode_per_seq_s=2e-3,
                    kv_read_per_token_s=0.0, kv_bytes_per_token=1000)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_virtual_time_prefill_and_decode_costs():
    clock = Clock()
    engine = TimingEngine(timings=SIMPLE, clock=clock, max_wait_ms=0)
    assert isinstance(engine, Engine)
    engine.warmup()
    engine.add_request(EngineRequest("a", list(range(100)), 5, stop_token_ids=()))
    assert engine.step() == []                     # batch started, not done
    assert engine.next_event_time() == pytest.approx(1e-3 + 100 * 1e-4)
    clock.t = 0.005
    assert engine.step() == []                     # too early
    clock.t = engine.next_event_time()
    (first,) = engine.step()
    assert first.new_token_ids and not first.finished
    times = [clock.t]
    while engine.has_unfinished():
        clock.t = engine.next_event_time()
        if engine.step():
            times.append(clock.t)
    assert len(times) == 5
    assert [b - a for a, b in zip(times, times[1:])] == pytest.approx([3e-3] * 4)
    stats = engine.stats()
    assert stats["ttft_ms"]["p50"] == pytest.approx(11.0)
    assert stats["tpot_ms"]["p50"] == pytest.approx(3.0)
    assert engine.next_event_time() is None


def test_batching_window_and_abort_in_flight():
    clock = Clock()
    engine = TimingEngine(timings=SIMPLE, clock=clock, max_wait_ms=20, prefill_batch_size=4)
    engine.add_request(EngineRequest("a", [1, 2, 3], 3))
    assert engine.step() == [] and engine.next_event_time() == pytest.approx(0.02)
    clock.t = 0.02
    engine.step()
    engine.abort("a")
    (out,) = engine.step()                        # the abort answers at once
    assert out.finish_reason == "abort" and out.completion_tokens == 0
    clock.t = 1.0
    assert engine.step() == [] and not engine.has_unfinished()
    assert engine.stats()["kv_blocks_used"] == 0


def test_cache_behaviour_matches_the_reference_engine(tmp_path):
    loaded = load_checkpoint(create_tiny_checkpoint(
        tmp_path / "m", TinyModelSpec(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=48,
                                      max_position=256, shards=1)))
    system = list(range(40, 90))
    reqs = [EngineRequest(f"r{i}", system + [i] * (3 + i), 20, stop_token_ids=())
            for i in range(8)]
    knobs = dict(max_wait_ms=0, max_seq_len=256, block_size=8, num_kv_blocks=24,
                 max_batch_size=6, prefill_batch_size=3, chunked_prefill=True,
                 prefill_chunk_tokens=16)
    ref = ReferenceEngine.from_weights(*loaded, **knobs)
    clock = Clock()
    sim = TimingEngine(timings=SIMPLE, clock=clock, **knobs)
    for engine in (ref, sim):
        for r in reqs[:5]:
            engine.add_request(r)
    steps = 0
    while ref.has_unfinished() or sim.has_unfinished():
        ref.step()
        clock.t = sim.next_event_time() or clock.t
        sim.step()
        if steps == 3:
            for engine in (ref, sim):
                for r in reqs[5:]:
                    engine.add_request(r)
        steps += 1
        assert steps < 500
    keys = ("prefix_hit_tokens", "prefill_tokens", "preemptions", "tokens_generated",
            "requests_finished", "batch_size_hist", "kv_blocks_used")
    want, got = ref.stats(), sim.stats()
    assert {k: got[k] for k in keys} == {k: want[k] for k in keys}
    assert want["preemptions"] > 0 and want["prefix_hit_tokens"] > 0


def test_a_thousand_engines_under_one_virtual_clock():
    clock = Clock()
    engines = [TimingEngine(gpu_kind="h100-sxm", clock=clock, max_wait_ms=0) for _ in range(1000)]
    for i, engine in enumerate(engines):
        engine.add_request(EngineRequest(f"r{i}", list(range(1, 2 + i % 200)), 8,
                                         stop_token_ids=()))
    events = [(engine.next_event_time(), i) for i, engine in enumerate(engines)]
    heapq.heapify(events)
    finished = 0
    while events:
        clock.t, i = heapq.heappop(events)
        finished += sum(o.finished for o in engines[i].step())
        nxt = engines[i].next_event_time()
        if nxt is not None:
            heapq.heappush(events, (nxt, i))
    assert finished == 1000
    # The longest prompt (200 tokens) bounds the makespan: prefill + 7 decode steps.
    t = GPU_TIMINGS["h100-sxm"]
    assert clock.t == pytest.approx(t.step_overhead_s * 8 + t.prefill_per_token_s * 200
                                    + t.prefill_per_pair_s * (200 * 201 // 2)
                                    + t.decode_per_seq_s * 7
                                    + t.kv_read_per_token_s * sum(range(201, 208)), rel=1e-9)


def test_gpu_table_and_fp8():
    with pytest.raises(ValueError, match="no timing constants for GPU kind 'tpu'; known kinds:"):
        TimingEngine(gpu_kind="tpu")
    fp16 = TimingEngine(gpu_kind="h200")
    fp8 = TimingEngine(gpu_kind="h200", kv_cache_dtype="fp8")
    assert fp8.stats()["kv_bytes_per_token"] * 2 == fp16.stats()["kv_bytes_per_token"]
    assert fp8.timings.kv_read_per_token_s * 2 == fp16.timings.kv_read_per_token_s
    assert fp16.stats()["gpu_kind"] == "h200"


def test_fit_recovers_known_constants():
    true = GpuTimings(2e-3, 3e-5, 1e-4, 2e-8, prefill_per_pair_s=1e-9, kv_bytes_per_token=64)
    work = [StepSample(n, n * (n + 1) // 2, 0, 0) for n in (64, 256, 1024, 4096)] + \
        [StepSample(0, 0, b, b * c) for b in (1, 8, 64) for c in (100, 2000)]
    samples = [StepSample(w.prefill_tokens, w.prefill_pairs, w.decode_seqs,
                          w.decode_context_tokens, seconds=true.seconds(w)) for w in work]
    fit = fit_timings(samples, kv_bytes_per_token=64)
    for name in ("step_overhead_s", "prefill_per_token_s", "decode_per_seq_s",
                 "kv_read_per_token_s", "prefill_per_pair_s"):
        assert getattr(fit, name) == pytest.approx(getattr(true, name), rel=1e-6), name
    # Noise that would make a constant negative clamps it to zero instead.
    flat = [StepSample(0, 0, b, b * 10, seconds=1e-3) for b in (1, 2, 4, 8)]
    assert min(vars(fit_timings(flat, 64)).values()) >= 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30), st.integers(0, 3),
                          st.booleans()), min_size=1, max_size=12),
       st.integers(6, 20), st.sampled_from([2, 4, 8]), st.booleans())
def test_random_workloads_on_a_tiny_pool_never_wedge(reqs, num_blocks, block_size, chunked):
    """Scheduler + block manager under pressure: every request ends exactly
    once, with max_tokens or an abort, and the pool ends empty and consistent."""
    clock = Clock()
    engine = TimingEngine(timings=SIMPLE, clock=clock, max_wait_ms=0, max_seq_len=512,
                          block_size=block_size, num_kv_blocks=num_blocks, max_batch_size=4,
                          prefill_batch_size=2, chunked_prefill=chunked, prefill_chunk_tokens=16)
    expected = {}
    for i, (prompt, max_tokens, family, abort) in enumerate(reqs):
        req = EngineRequest(f"r{i}", [family] * 5 + list(range(prompt)), max_tokens,
                            stop_token_ids=())
        try:
            engine.add_request(req)
        except ValueError as e:
            assert "KV blocks" in str(e)
            continue
        expected[req.request_id] = (max_tokens, abort)
    final = {}
    for step in range(20_000):
        if not engine.has_unfinished():
            break
        if step == 3:
            for rid, (_, abort) in expected.items():
                if abort:
                    engine.abort(rid)
        clock.t = engine.next_event_time() or clock.t
        for out in engine.step():
            assert out.request_id not in final
            if out.finished:
                final[out.request_id] = out
        engine.blocks.check_invariants()
    assert set(final) == set(expected)
    for rid, out in final.items():
        max_tokens, abort = expected[rid]
        assert out.finish_reason == "length" and out.completion_tokens == max_tokens or \
            abort and out.finish_reason == "abort"
    assert engine.stats()["kv_blocks_used"] == 0


def test_token_budget_decodes_first_then_prefill_chunks_in_arrival_order():
    """vLLM's max_num_batched_tokens: a long prompt ahead takes the budget; a short one behind it
    waits for it (first come, first served) instead of getting its own chunk every step."""
    clock = Clock()
    engine = TimingEngine(timings=SIMPLE, clock=clock, max_wait_ms=0, max_seq_len=8192,
                          prefill_chunk_tokens=4096, max_num_batched_tokens=1024, max_batch_size=8)
    engine.add_request(EngineRequest("long", [7] * 3000, 4, stop_token_ids=()))
    engine.add_request(EngineRequest("short", [9] * 100, 4, stop_token_ids=()))
    sched = engine.scheduler
    steps = []
    while engine.has_unfinished():
        engine.step()
        if engine._inflight is not None:
            b = engine._inflight
            steps.append(([(s.request_id, n) for s, n in b.prefills], [s.request_id for s in b.decodes]))
        clock.t = engine.next_event_time() or clock.t
    assert steps[0] == ([("long", 1024)], [])                  # the budget, all to the older prompt
    assert steps[1] == ([("long", 1024)], [])
    assert steps[2] == ([("long", 952), ("short", 72)], [])    # what it leaves goes to the next
    assert steps[3] == ([("short", 28)], ["long"])             # decodes first, then the chunk
    assert all(sum(n for _, n in p) + len(d) <= 1024 for p, d in steps)
    assert sched.config.max_num_batched_tokens == 1024
    with pytest.raises(ValueError, match="max_num_batched_tokens must be None or an integer >= max_batch_size"):
        StepLimits(max_batch_size=8, max_num_batched_tokens=4)


def test_reference_engine_has_no_token_budget_by_default():
    assert StepLimits().max_num_batched_tokens is None
    assert TimingEngine(gpu_kind="h200").scheduler.config.max_num_batched_tokens == DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert TimingEngine(gpu_kind="h200", max_num_batched_tokens=None).scheduler.config.max_num_batched_tokens is None


def test_gpu_constants_follow_the_datasheets_and_published_figures():
    """The roofline's checks in engine/gpu_specs.py, pinned: Llama-3-8B bf16."""
    h100, h200 = GPU_TIMINGS["h100-sxm"], GPU_TIMINGS["h200"]
    assert h100.kv_bytes_per_token == 131072
    # batch-1 decode = weights over 80% of 3.35 TB/s + launch: ~6.5 ms a token
    assert h100.seconds(StepSample(0, 0, 1, 1000)) == pytest.approx(6.5e-3, rel=0.05)
    # batch 256 at ~600 tokens of context: ~12k tok/s (published: ~12.5k for vLLM on one H100)
    step = h100.seconds(StepSample(0, 0, 256, 256 * 600))
    assert 10_000 < 256 / step < 14_000
    # attention's quadratic term at its real order: ~15% of an 8k prefill, ~40% of a 32k one
    for n, share in ((8192, 0.15), (32768, 0.42)):
        pairs = n * (n + 1) // 2
        attn = h100.prefill_per_pair_s * pairs
        assert attn / (attn + h100.prefill_per_token_s * n) == pytest.approx(share, abs=0.05)
    # H200: same compute, 4.8/3.35 the bandwidth
    assert h200.prefill_per_token_s == h100.prefill_per_token_s
    assert h100.kv_read_per_token_s / h200.kv_read_per_token_s == pytest.approx(4.8 / 3.35)
