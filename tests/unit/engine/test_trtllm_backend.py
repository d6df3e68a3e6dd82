"""TensorRT-LLM backend against the stand-in that refuses what the real library refuses (no GPU here).

The stand-in (tests/engine/trtllm_standin/tensorrt_llm) enforces the rules of TensorRT-LLM 1.2's LLM API
that the backend relies on, each citing the real file: the asyncio-queue rule of GenerationResult, the
exact keywords of LLM / SamplingParams / KvCacheConfig, what abort and shutdown do, the stop criteria and
the KV-event format. Here: the old add_request pattern fails against it, and the backend streams, stops on
EOS and stop ids, aborts, bounds its KV pool by the reservation and publishes KV events as ours.
"""

import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from exaserve_hpc.config.schema import BatchingConfig, ModelConfig
from exaserve_hpc.engine.base import Engine, EngineError, EngineRequest
from exaserve_hpc.engine.block_manager import prompt_block_hashes
from exaserve_hpc.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from exaserve_hpc.engine.trtllm_backend import (
    BOUNDED_FRACTION, INSTALL_HINT, KV_EVENT_BUFFER, KvEventTranslator, TrtLlmEngine, import_tensorrt_llm,
    kv_bytes_per_token, kv_token_budget, llm_args, llm_args_from_config,
)

STANDIN = Path(__file__).resolve().parents[2] / "engine" / "trtllm_standin"
GiB = 1 << 30
LLAMA_8B = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "hidden_size": 4096, "torch_dtype": "bfloat16"}


def test_llm_args_map_our_settings():
    args = llm_args("/models/llama", tensor_parallel_size=4, pipeline_parallel_size=2,
                    max_batch_size=64, max_seq_len=8192, enable_prefix_caching=True,
                    kv_cache_dtype="fp8", gpu_memory_utilization=0.85, chunked_prefill=True,
                    prefill_chunk_tokens=1024, block_size=64)
    assert args == {
        "model": "/models/llama", "skip_tokenizer_init": True, "tensor_parallel_size": 4,
        "pipeline_parallel_size": 2, "max_batch_size": 64, "max_seq_len": 8192, "enable_chunked_prefill": True,
        "max_num_tokens": 1024 + 64,
        "kv_cache_config": {"enable_block_reuse": True, "dtype": "fp8",
                            "free_gpu_memory_fraction": 0.85, "tokens_per_block": 64},
    }
    bounded = llm_args("m", kv_max_tokens=4096, kv_events=True)
    assert bounded["kv_cache_config"]["max_tokens"] == 4096
    assert bounded["kv_cache_config"]["free_gpu_memory_fraction"] == BOUNDED_FRACTION
    assert bounded["kv_cache_config"]["event_buffer_max_size"] == KV_EVENT_BUFFER
    assert "event_buffer_max_size" not in llm_args("m", kv_events=True, enable_prefix_caching=False)["kv_cache_config"]
    plain = llm_args("m", enable_prefix_caching=False, kv_cache_dtype="fp16",
                     chunked_prefill=False)
    assert plain["kv_cache_config"]["enable_block_reuse"] is False
    assert plain["kv_cache_config"]["dtype"] == "auto" and "max_num_tokens" not in plain
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' is not supported"):
        llm_args("m", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="block_size 48 must be a power of two"):
        llm_args("m", block_size=48)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        llm_args("m", tensor_parallel_size=0)


def test_llm_args_from_site_config():
    model = ModelConfig(model_name="llama", engine="trtllm", tensor_parallel=8,
                        max_seq_len=4096, kv_cache_dtype="fp8",
                        enable_prefix_caching=False, gpu_memory_utilization=0.5)
    args = llm_args_from_config("/m", model, BatchingConfig(max_batch_size=128,
                                                            prefill_chunk_tokens=256))
    assert (args["tensor_parallel_size"], args["pipeline_parallel_size"]) == (8, 1)
    assert (args["max_batch_size"], args["max_seq_len"], args["max_num_tokens"]) == (128, 4096, 384)
    assert args["kv_cache_config"]["dtype"] == "fp8"
    assert args["kv_cache_config"]["enable_block_reuse"] is False
    assert args["kv_cache_config"]["free_gpu_memory_fraction"] == 0.5


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # import fails like a missing package
    with pytest.raises(EngineError, match="pip install 'exaserve-hpc\\[trtllm\\]'") as info:
        import_tensorrt_llm()
    assert INSTALL_HINT in str(info.value) and isinstance(info.value.__cause__, ImportError)
    with pytest.raises(EngineError, match="tensorrt_llm package"):
        TrtLlmEngine("/m", max_seq_len=64)


def test_the_kv_pool_is_bounded_by_the_reservation_not_by_free_memory(tmp_path):
    # Llama-3.1-8B: 2 (K, V) x 8 KV heads x 128 x 32 layers x 2 bytes = 128 KiB a token; fp8 half; TP splits heads
    assert kv_bytes_per_token(LLAMA_8B, "fp16") == 128 << 10
    assert kv_bytes_per_token(LLAMA_8B, "fp8") == 64 << 10
    assert kv_bytes_per_token(LLAMA_8B, "fp8", tp=4) == 16 << 10
    assert kv_bytes_per_token(LLAMA_8B, "fp16", pp=2) == 64 << 10
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.truncate(16 * GiB)  # sparse: 16 GiB of "weights"
    reserved = 24 * GiB  # gpu_memory_utilization 0.3 of an 80 GiB A100
    tokens = kv_token_budget(tmp_path, reserved, tp=1, pp=1, kv_cache_dtype="fp8", block_size=32, max_seq_len=8192)
    expected = (reserved - 16 * GiB - int(0.1 * reserved)) // (64 << 10) // 32 * 32
    assert tokens == expected and tokens % 32 == 0
    # the same replica on two GPUs: half the weights each, a quarter... of the heads: more tokens per byte
    assert kv_token_budget(tmp_path, reserved, tp=2, pp=1, kv_cache_dtype="fp8", block_size=32,
                           max_seq_len=8192) > 2 * tokens
    with pytest.raises(EngineError, match="fewer than max_seq_len 8192; raise the model's gpu_memory_utilization"):
        kv_token_budget(tmp_path, 17 * GiB, tp=1, pp=1, kv_cache_dtype="fp8", block_size=32, max_seq_len=8192)


def test_trtllm_kv_events_are_renamed_with_the_routers_block_hashes():
    """TensorRT-LLM's own block hashes become ours (hash_block_tokens, chained) from the token ids its
    "stored" events carry (tensorrt_llm/_utils.py KVCacheEventSerializer format)."""
    def stored(parent, blocks):
        return {"event_id": 1, "window_size": 256, "data": {"type": "stored", "parent_hash": parent, "blocks": [
            {"type": "stored_block", "block_hash": h, "cache_level": 0, "priority": 35,
             "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in ids]}
            for h, ids in blocks]}}

    prompt = list(range(100, 112))
    ours = prompt_block_hashes(prompt, 4)
    t = KvEventTranslator(block_size=4)
    out = t.translate([{"event_id": 0, "window_size": 256,
                        "data": {"type": "created", "num_blocks_per_cache_level": [64, 0]}},
                       stored(None, [(9001, prompt[0:4]), (9002, prompt[4:8])])])
    assert out == [AllBlocksCleared(), BlockStored(ours[:2], None, prompt[:8], 4)]
    out = t.translate([[stored(9002, [(9003, prompt[8:12])])], json.dumps(stored(777, [(1, prompt[:4])]))])
    assert out == [BlockStored(ours[2:], ours[1], prompt[8:12], 4)]  # the unknown parent 777: skipped
    out = t.translate([{"event_id": 5, "window_size": 256, "data": {"type": "removed", "block_hashes": [9003, 4242]}},
                       {"event_id": 6, "window_size": 256, "data": {"type": "updated", "block_hash": 9001}},
                       stored(None, [(9100, [1, 2, 3])])])  # a partial block is not a prefix block
    assert out == [BlockRemoved([ours[2]])]


# ---------------------------------------------------------------- against the stand-in


@pytest.fixture
def trtllm(monkeypatch):
    """The stand-in as `tensorrt_llm`, imported fresh and forgotten after the test."""
    def forget():
        for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
            del sys.modules[name]
    forget()
    monkeypatch.syspath_prepend(str(STANDIN))
    monkeypatch.delenv("TRTLLM_STANDIN_RECORD", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    import tensorrt_llm
    yield tensorrt_llm
    forget()


def hf_checkpoint(path: Path, eos=(257,)) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**LLAMA_8B, "num_hidden_layers": 2}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(eos)}))
    return path


def test_the_standin_refuses_what_the_real_library_refuses(trtllm, tmp_path, monkeypatch):
    from pydantic import ValidationError
    from tensorrt_llm.llmapi import KvCacheConfig

    model = str(hf_checkpoint(tmp_path / "m"))
    with pytest.raises(TypeError, match="unexpected keyword argument 'random_seed'"):
        trtllm.SamplingParams(random_seed=3)  # the LLM API's name is seed
    with pytest.raises(TypeError):
        trtllm.SamplingParams(16)  # keyword-only
    with pytest.raises(ValueError, match="best_of"):
        trtllm.SamplingParams(n=2, best_of=1)
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        KvCacheConfig(free_gpu_memory=0.5)
    with pytest.raises(ValidationError, match="free_gpu_memory_fraction must be a float between 0 and 1"):
        KvCacheConfig(free_gpu_memory_fraction=1.5)
    with pytest.raises(ValidationError, match="max_tokens"):
        KvCacheConfig(max_tokens="many")
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        trtllm.LLM(model=model, max_batch=4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(RuntimeError, match="Only 1 GPUs are available, but 2 are required"):
        trtllm.LLM(model=model, tensor_parallel_size=2)
    llm = trtllm.LLM(model=model, skip_tokenizer_init=True, max_seq_len=64)
    with pytest.raises(AssertionError, match="KV Event IterationResult is not properly instantiated"):
        llm.get_kv_cache_events(timeout=0.01)  # before any request
    with pytest.raises(ValueError, match="tokenizer is required to reset end_id"):
        llm.generate_async([1, 2], sampling_params=trtllm.SamplingParams(max_tokens=2))
    with pytest.raises(TypeError, match="incompatible constructor arguments"):
        llm.generate_async([1, 2], sampling_params=trtllm.SamplingParams(max_tokens=2, end_id=0, seed=1.5))
    out = llm.generate([5, 6], sampling_params=trtllm.SamplingParams(max_tokens=3, end_id=0))
    assert out.outputs[0].token_ids == [6, 7, 32] and out.outputs[0].finish_reason == "length"
    llm.shutdown()
    llm.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="LLM is shutting down"):
        llm.generate_async([1], sampling_params=trtllm.SamplingParams(max_tokens=1, end_id=0))


def test_the_old_add_request_pattern_fails_against_the_standin(trtllm, tmp_path):
    """Yesterday's TrtLlmEngine.add_request: generate_async from the replica's loop (no event loop running
    there), `async for` on another thread's loop -> the real assertion, so every stream ended as an abort."""
    llm = trtllm.LLM(model=str(hf_checkpoint(tmp_path / "m")), skip_tokenizer_init=True, max_seq_len=64)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        stream = llm.generate_async([1, 2, 3], sampling_params=trtllm.SamplingParams(max_tokens=4, end_id=0),
                                    streaming=True)  # made here: no running loop in this thread

        async def consume():
            return [list(out.outputs[0].token_ids) async for out in stream]

        with pytest.raises(AssertionError, match="The asyncio event loop was not present during "
                                                 "initialization, so async operations are not available"):
            asyncio.run_coroutine_threadsafe(consume(), loop).result(timeout=10)

        async def made_on_the_loop():  # the backend's pattern: create and read on the same loop
            result = llm.generate_async([1, 2, 3], sampling_params=trtllm.SamplingParams(max_tokens=4, end_id=0),
                                        streaming=True)
            return [list(out.outputs[0].token_ids) async for out in result]

        assert asyncio.run_coroutine_threadsafe(made_on_the_loop(), loop).result(timeout=10) == [
            [2], [2, 3], [2, 3, 4], [2, 3, 4, 32]]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        llm.shutdown()


def run(engine: TrtLlmEngine, timeout: float = 20.0) -> tuple[dict, dict]:
    tokens, final, deadline = {}, {}, time.monotonic() + timeout
    while engine.has_unfinished():
        assert time.monotonic() < deadline, (tokens, final)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                assert out.request_id not in final, "one final output per request"
                final[out.request_id] = out
    return tokens, final


def test_the_engine_streams_stops_on_eos_and_stop_ids_and_aborts(trtllm, tmp_path):
    # The stand-in answers prompt token t with t + 1. EOS ids (4, 8): 4 becomes end_id (END_ID, left in the
    # output by TensorRT-LLM), both are stop_token_ids (STOP_WORDS, cut by TensorRT-LLM): neither reaches us.
    engine = TrtLlmEngine(hf_checkpoint(tmp_path / "m", eos=(4, 8)), max_seq_len=128, max_batch_size=8)
    assert isinstance(engine, Engine)
    engine.warmup()
    engine.add_request(EngineRequest("length", [1, 2, 5], 5, stop_token_ids=()))  # no stop ids: ignore_eos
    engine.add_request(EngineRequest("eos-end-id", [1, 3, 9], 10))     # 2, 4 = end_id
    engine.add_request(EngineRequest("eos-stop-word", [1, 7, 9], 10))  # 2, 8 = second EOS id
    engine.add_request(EngineRequest("stop", [1, 2, 5, 9], 10, stop_token_ids=(6,)))  # 2, 3, 6
    engine.add_request(EngineRequest("sampled", [10, 20], 2, temperature=0.7, top_p=0.9, seed=11))
    engine.add_request(EngineRequest("long", [1], 100, stop_token_ids=()))
    engine.add_request(EngineRequest("early", [1], 100, stop_token_ids=()))
    engine.abort("early")  # before TensorRT-LLM saw it
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request(EngineRequest("length", [1], 1))
    with pytest.raises(ValueError, match="exceeds max_seq_len 128"):
        engine.add_request(EngineRequest("huge", [1] * 100, 29))
    time.sleep(0.05)
    engine.abort("long")
    engine.abort("no-such-request")  # ignored
    tokens, final = run(engine)
    assert tokens["length"] == [2, 3, 6, 32, 32] and final["length"].finish_reason == "length"
    assert tokens["eos-end-id"] == [2] and final["eos-end-id"].finish_reason == "stop"
    assert final["eos-end-id"].completion_tokens == 2  # the EOS token counts, and is not returned
    assert tokens["eos-stop-word"] == [2] and final["eos-stop-word"].finish_reason == "stop"
    assert final["eos-stop-word"].completion_tokens == 2
    assert tokens["stop"] == [2, 3] and final["stop"].finish_reason == "stop"
    assert tokens["sampled"] == [11, 21] and final["sampled"].finish_reason == "length"
    assert final["long"].finish_reason == "abort" and len(tokens.get("long", [])) < 100
    assert final["early"].finish_reason == "abort" and tokens.get("early", []) == []
    stats = engine.stats()
    assert stats["requests_aborted"] == 2 and stats["requests_finished"] == 7 and stats["running"] == 0
    p = engine.sampling_params(EngineRequest("p", [1], 3))
    assert (p.end_id, p.stop_token_ids, p.top_k, p.temperature, p.detokenize) == (4, [4, 8], 1, None, False)
    p = engine.sampling_params(EngineRequest("p", [1], 3, temperature=0.5, top_p=0.8, seed=9, stop_token_ids=()))
    assert (p.ignore_eos, p.stop_token_ids, p.temperature, p.top_p, p.seed) == (True, None, 0.5, 0.8, 9)
    engine.add_request(EngineRequest("again", [1, 2], 1, stop_token_ids=()))  # an id may come back once done
    assert run(engine)[0]["again"] == [2]
    engine.add_request(EngineRequest("cut", [1], 100, stop_token_ids=()))
    engine.shutdown()  # aborts what runs, then shuts TensorRT-LLM down
    engine.shutdown()
    assert engine._llm._executor is None
    with pytest.raises(EngineError, match="shut down"):
        engine.add_request(EngineRequest("late", [1], 1))


def test_the_engine_bounds_the_kv_pool_by_its_reservation(trtllm, tmp_path):
    model = hf_checkpoint(tmp_path / "m")
    engine = TrtLlmEngine(model, max_seq_len=128, reserved_bytes=2 * GiB, kv_cache_dtype="fp8")
    try:
        kv = engine._llm.args.kv_cache_config  # what the stand-in's pydantic model accepted
        assert kv.max_tokens == kv_token_budget(model, 2 * GiB, tp=1, pp=1, kv_cache_dtype="fp8", block_size=32,
                                                max_seq_len=128)
        assert kv.free_gpu_memory_fraction == BOUNDED_FRACTION and kv.dtype == "fp8"
    finally:
        engine.shutdown()
    with pytest.raises(EngineError, match="reservation"):
        TrtLlmEngine(model, max_seq_len=128, reserved_bytes=GiB)


def test_the_engine_publishes_kv_events_named_as_the_router_names_blocks(trtllm, tmp_path):
    engine = TrtLlmEngine(hf_checkpoint(tmp_path / "m"), max_seq_len=256, block_size=16,
                          kv_events_endpoint="tcp://127.0.0.1:*", replica_id="trt/r0")
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(engine.kv_events_endpoint)
    try:
        time.sleep(0.2)  # the subscription reaches the publisher
        prompt = list(range(10, 50))  # 2 full blocks of 16
        engine.add_request(EngineRequest("a", prompt, 2, stop_token_ids=()))
        run(engine)
        stored, deadline = [], time.monotonic() + 10
        while not stored and time.monotonic() < deadline:
            if sub.poll(100):
                topic, seq, payload = sub.recv_multipart()
                batch = decode_batch(payload)
                assert batch.replica_id == "trt/r0"
                stored += [e for e in batch.events if isinstance(e, BlockStored)]
        assert stored and stored[0].block_hashes == prompt_block_hashes(prompt, 16)
        assert stored[0].parent_block_hash is None and stored[0].block_size == 16
        engine.add_request(EngineRequest("again", prompt, 2, stop_token_ids=()))  # its 2 blocks are held
        run(engine)
        stats = engine.stats()
        assert (stats["prefix_hit_tokens"], stats["prefix_query_tokens"]) == (32, 80)
    finally:
        engine.shutdown()
        sub.close()
        context.term()
