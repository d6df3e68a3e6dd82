"""TensorRT-LLM backend: settings mapping, missing-package error, and the
stream adapter against a fake tensorrt_llm (no GPU here)."""

import asyncio
import sys
import types

import pytest

from exaserve_hpc.config import BatchingConfig, ModelConfig
from exaserve_hpc.engine.base import Engine, EngineError, EngineRequest
from exaserve_hpc.engine.trtllm_backend import (
    INSTALL_HINT, TrtLlmEngine, import_tensorrt_llm, llm_args, llm_args_from_config,
)


def test_llm_args_map_our_settings():
    args = llm_args("/models/llama", tensor_parallel_size=4, pipeline_parallel_size=2,
                    max_batch_size=64, max_seq_len=8192, enable_prefix_caching=True,
                    kv_cache_dtype="fp8", gpu_memory_utilization=0.85, chunked_prefill=True,
                    prefill_chunk_tokens=1024, block_size=64)
    assert args == {
        "model": "/models/llama", "tensor_parallel_size": 4, "pipeline_parallel_size": 2,
        "max_batch_size": 64, "max_seq_len": 8192, "enable_chunked_prefill": True,
        "max_num_tokens": 1024 + 64,
        "kv_cache_config": {"enable_block_reuse": True, "dtype": "fp8",
                            "free_gpu_memory_fraction": 0.85, "tokens_per_block": 64},
    }
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
                        pipeline_parallel=2, max_seq_len=4096, kv_cache_dtype="fp8",
                        enable_prefix_caching=False, gpu_memory_utilization=0.5)
    args = llm_args_from_config("/m", model, BatchingConfig(max_batch_size=128,
                                                            prefill_chunk_tokens=256))
    assert (args["tensor_parallel_size"], args["pipeline_parallel_size"]) == (8, 2)
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


class FakeStream:
    """Streams cumulative outputs like tensorrt_llm's GenerationResult."""

    def __init__(self, prompt, params):
        self.params, self.cancelled = params, False
        self.tokens = [(t + 1) % 250 for t in range(len(prompt), len(prompt) + params.max_tokens)]

    def abort(self):
        self.cancelled = True

    async def __aiter__(self):
        for n in range(1, len(self.tokens) + 1):
            await asyncio.sleep(0.001)
            if self.cancelled:
                yield types.SimpleNamespace(finished=True, outputs=[types.SimpleNamespace(
                    token_ids=self.tokens[:n - 1], finish_reason="cancelled")])
                return
            ids = self.tokens[:n]
            stop = ids[-1] in self.params.stop_token_ids
            done = stop or n == len(self.tokens)
            yield types.SimpleNamespace(finished=done, outputs=[types.SimpleNamespace(
                token_ids=ids, finish_reason=("stop" if stop else "length") if done else None)])
            if done:
                return


@pytest.fixture
def fake_trtllm(monkeypatch):
    made = {}

    class LLM:
        def __init__(self, **kwargs):
            made.update(kwargs)

        def generate_async(self, prompt, sampling_params, streaming):
            assert streaming
            return FakeStream(prompt, sampling_params)

        def generate(self, prompts, sampling_params):
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[5, 6])])]

        def shutdown(self):
            made["shutdown"] = True

    module = types.ModuleType("tensorrt_llm")
    module.LLM = LLM
    module.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.KvCacheConfig = lambda **kw: ("KvCacheConfig", kw)
    module.llmapi = llmapi
    monkeypatch.setitem(sys.modules, "tensorrt_llm", module)
    monkeypatch.setitem(sys.modules, "tensorrt_llm.llmapi", llmapi)
    return made


def test_adapter_streams_tokens_stops_and_aborts(fake_trtllm):
    engine = TrtLlmEngine("/m", max_seq_len=128, kv_cache_dtype="fp8", tensor_parallel_size=2)
    assert isinstance(engine, Engine)
    assert fake_trtllm["tensor_parallel_size"] == 2
    assert fake_trtllm["kv_cache_config"] == ("KvCacheConfig", engine.args["kv_cache_config"])
    engine.warmup()
    engine.add_request(EngineRequest("a", [1, 2, 3], 5, stop_token_ids=()))
    engine.add_request(EngineRequest("s", [1, 2], 10, stop_token_ids=(6,)))  # 3, 4, 5, 6=stop
    engine.add_request(EngineRequest("x", [1], 50, stop_token_ids=()))
    with pytest.raises(ValueError, match="already in flight"):
        engine.add_request(EngineRequest("a", [1], 1))
    tokens, final = {}, {}
    engine.abort("x")
    for _ in range(2000):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                final[out.request_id] = out
        if not engine.has_unfinished():
            break
    assert tokens["a"] == [4, 5, 6, 7, 8] and final["a"].finish_reason == "length"
    assert tokens["s"] == [3, 4, 5] and final["s"].finish_reason == "stop"
    assert final["x"].finish_reason == "abort"
    assert engine.stats()["requests_aborted"] == 1
    engine.shutdown()
    assert fake_trtllm["shutdown"]
