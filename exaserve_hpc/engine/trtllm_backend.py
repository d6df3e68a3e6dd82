"""TensorRT-LLM backend behind the step protocol (GPU replicas).

Not run on a GPU yet: the mapping from our settings to TensorRT-LLM's LLM
API arguments (``llm_args``) and the missing-package error are unit-tested,
and a replica process started as the agent starts it serves requests through
the router against a stand-in ``tensorrt_llm`` that records the calls the
real API would receive (tests/engine/test_engine_replicas.py).

Mapping (TensorRT-LLM LLM API, PyTorch backend, 1.x):

    ours                              tensorrt_llm
    tensor_parallel_size              LLM(tensor_parallel_size=)
    pipeline_parallel_size            LLM(pipeline_parallel_size=)
    max_batch_size, max_seq_len       LLM(max_batch_size=, max_seq_len=)
    chunked_prefill                   LLM(enable_chunked_prefill=)
    prefill_chunk_tokens              LLM(max_num_tokens= chunk + max_batch_size): one
                                      chunk plus a decode token per sequence per iteration
    enable_prefix_caching             KvCacheConfig(enable_block_reuse=)
    kv_cache_dtype fp16 | fp8         KvCacheConfig(dtype="auto" | "fp8")
    gpu_memory_utilization            KvCacheConfig(free_gpu_memory_fraction=)
    block_size                        KvCacheConfig(tokens_per_block=)

Call protocol: as ``base.Engine``. ``add_request`` starts a streaming
``LLM.generate_async``; a thread runs the asyncio loop that consumes the
streams and queues per-request token deltas; ``step()`` drains that queue
(waiting up to ``poll_s`` when it is empty) and returns ``StepOutput``s.
``abort`` cancels the TensorRT-LLM request.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import threading
from pathlib import Path
from typing import Any

from exaserve_hpc.cache.hf_format import generation_eos_ids, is_hf_config
from exaserve_hpc.engine.base import DEFAULT_EOS_IDS, EngineError, EngineRequest, StepOutput
from exaserve_hpc.engine.registry import TRTLLM_INSTALL as INSTALL_HINT


def llm_args(model_dir: str | os.PathLike, *, tensor_parallel_size: int = 1,
             pipeline_parallel_size: int = 1, max_batch_size: int = 32, max_seq_len: int = 2048,
             enable_prefix_caching: bool = True, kv_cache_dtype: str = "fp16",
             gpu_memory_utilization: float = 0.9, chunked_prefill: bool = True,
             prefill_chunk_tokens: int = 512, block_size: int = 32) -> dict[str, Any]:
    """Keyword arguments for ``tensorrt_llm.LLM`` (``kv_cache_config`` as a
    plain dict for ``KvCacheConfig(**...)``). Pure: no import of tensorrt_llm."""
    for name, value in (("tensor_parallel_size", tensor_parallel_size),
                        ("pipeline_parallel_size", pipeline_parallel_size),
                        ("max_batch_size", max_batch_size), ("max_seq_len", max_seq_len),
                        ("prefill_chunk_tokens", prefill_chunk_tokens), ("block_size", block_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if kv_cache_dtype not in ("fp16", "fp8"):
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported by the TensorRT-LLM "
                         "backend; choose fp16 or fp8")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} must be a power of two for TensorRT-LLM")
    args: dict[str, Any] = {
        "model": str(model_dir),
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "max_batch_size": max_batch_size,
        "max_seq_len": max_seq_len,
        "enable_chunked_prefill": chunked_prefill,
        "kv_cache_config": {
            "enable_block_reuse": enable_prefix_caching,
            "dtype": "fp8" if kv_cache_dtype == "fp8" else "auto",
            "free_gpu_memory_fraction": gpu_memory_utilization,
            "tokens_per_block": block_size,
        },
    }
    if chunked_prefill:
        args["max_num_tokens"] = prefill_chunk_tokens + max_batch_size
    return args


def llm_args_from_config(model_dir: str | os.PathLike, model, batching) -> dict[str, Any]:
    """``llm_args`` from a ``config.ModelConfig`` and ``config.BatchingConfig``."""
    return llm_args(model_dir, tensor_parallel_size=model.tensor_parallel,
                    pipeline_parallel_size=model.pipeline_parallel,
                    max_batch_size=model.max_batch_size or batching.max_batch_size,
                    max_seq_len=model.max_seq_len,
                    enable_prefix_caching=model.enable_prefix_caching,
                    kv_cache_dtype=model.kv_cache_dtype,
                    gpu_memory_utilization=model.gpu_memory_utilization,
                    chunked_prefill=batching.chunked_prefill,
                    prefill_chunk_tokens=batching.prefill_chunk_tokens)


def model_eos_ids(model_dir: Path) -> tuple[int, ...]:
    """The EOS ids of a checkpoint: a Hugging Face one's generation config, the byte tokenizer's EOS for
    an exaserve-llama-v1 one."""
    try:
        raw = json.loads((model_dir / "config.json").read_bytes())
    except (OSError, ValueError) as e:
        raise EngineError(f"{model_dir / 'config.json'} cannot be read ({e}); check the model path") from e
    return tuple(generation_eos_ids(model_dir)) if is_hf_config(raw) else DEFAULT_EOS_IDS


def import_tensorrt_llm():
    """The ``tensorrt_llm`` module, or EngineError naming the extra to install."""
    try:
        import tensorrt_llm
        from tensorrt_llm.llmapi import KvCacheConfig  # noqa: F401 (checked here, used later)
    except ImportError as e:
        raise EngineError(
            f"the TensorRT-LLM backend needs the tensorrt_llm package, which is not importable "
            f"({e}); install it with: {INSTALL_HINT} (on a machine with NVIDIA GPUs and CUDA), "
            "or use engine: reference"
        ) from e
    return tensorrt_llm


class TrtLlmEngine:
    """``base.Engine`` over ``tensorrt_llm.LLM``; see the module docstring."""

    def __init__(self, model_dir: str | os.PathLike, *, poll_s: float = 0.005,
                 **settings) -> None:
        self.args = llm_args(model_dir, **settings)
        trt = import_tensorrt_llm()
        from tensorrt_llm.llmapi import KvCacheConfig

        self._trt = trt
        self._model_dir = Path(model_dir)
        self._eos_ids: tuple[int, ...] | None = None
        self.max_seq_len = self.args["max_seq_len"]
        kwargs = {**self.args, "kv_cache_config": KvCacheConfig(**self.args["kv_cache_config"])}
        self._llm = trt.LLM(**kwargs)
        self._poll_s = poll_s
        self._events: queue.Queue = queue.Queue()
        self._live: dict[str, tuple[EngineRequest, Any]] = {}   # id -> (request, stream)
        self._aborted: set[str] = set()
        self._counters = dict(tokens_generated=0, requests_finished=0, requests_aborted=0,
                              prefill_tokens=0)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="trtllm-streams")
        self._thread.start()
        self._closed = False

    def add_request(self, req: EngineRequest) -> None:
        if self._closed:
            raise EngineError("engine is shut down; start a new one")
        if req.request_id in self._live:
            raise ValueError(f"request_id {req.request_id!r} is already in flight; ids must be unique")
        prompt = len(req.prompt_token_ids)
        if prompt + req.max_tokens > self.max_seq_len:
            raise ValueError(f"request {req.request_id}: prompt of {prompt} tokens + max_tokens "
                             f"{req.max_tokens} exceeds max_seq_len {self.max_seq_len}")
        params = self._trt.SamplingParams(
            max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
            seed=req.seed, stop_token_ids=list(self._stop_ids(req)))
        stream = self._llm.generate_async(list(req.prompt_token_ids), sampling_params=params,
                                          streaming=True)
        self._live[req.request_id] = (req, stream)
        self._counters["prefill_tokens"] += prompt
        asyncio.run_coroutine_threadsafe(self._consume(req, stream), self._loop)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The model's EOS ids, read from its checkpoint on first use."""
        if self._eos_ids is None:
            self._eos_ids = model_eos_ids(self._model_dir)
        return self._eos_ids

    def _stop_ids(self, req: EngineRequest) -> tuple[int, ...]:
        """The request's stop ids, or the model's EOS ids (its generation_config.json)."""
        return self.eos_token_ids if req.stop_token_ids is None else tuple(req.stop_token_ids)

    async def _consume(self, req: EngineRequest, stream) -> None:
        """Turn cumulative outputs into deltas on the queue (runs on the loop thread)."""
        sent = 0
        try:
            async for output in stream:
                completion = output.outputs[0]
                ids = list(completion.token_ids)
                reason = completion.finish_reason if output.finished else None
                self._events.put((req.request_id, ids[sent:], output.finished, reason, len(ids)))
                sent = len(ids)
        except Exception as e:  # surfaced to the serving loop as an aborted request
            self._events.put((req.request_id, [], True, f"error: {e!r}", sent))

    def abort(self, request_id: str) -> None:
        entry = self._live.get(request_id)
        if entry is not None and request_id not in self._aborted:
            self._aborted.add(request_id)
            entry[1].abort()

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def step(self) -> list[StepOutput]:
        if self._closed:
            raise EngineError("engine is shut down; start a new one")
        outputs = []
        try:
            events = [self._events.get(timeout=self._poll_s)]
        except queue.Empty:
            events = []
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                break
        for request_id, new, finished, reason, total in events:
            entry = self._live.get(request_id)
            if entry is None:
                continue
            req = entry[0]
            self._counters["tokens_generated"] += len(new)
            if finished:
                del self._live[request_id]
                self._counters["requests_finished"] += 1
                if request_id in self._aborted or reason not in ("stop", "length"):
                    self._counters["requests_aborted"] += 1
                    reason = "abort"  # cancelled by us, or failed inside TensorRT-LLM
                self._aborted.discard(request_id)
                if reason == "stop" and new and new[-1] in self._stop_ids(req):
                    new = new[:-1]  # a stop token is not returned (base protocol)
            outputs.append(StepOutput(request_id, new, finished, reason if finished else None,
                                      len(req.prompt_token_ids), total))
        return outputs

    def stats(self) -> dict:
        return {"queue_depth": 0, "running": len(self._live), **self._counters,
                "kv_used": 0.0, "engine": "trtllm"}

    def warmup(self) -> None:
        """One short greedy generation through the real engine."""
        params = self._trt.SamplingParams(max_tokens=4, temperature=0.0)
        try:
            out = self._llm.generate([[1, 2, 3, 4]], sampling_params=params)
        except Exception as e:
            raise EngineError(f"TensorRT-LLM warm-up failed: {e!r}") from e
        if not out or not list(out[0].outputs[0].token_ids):
            raise EngineError(f"TensorRT-LLM warm-up produced no tokens: {out!r}")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _, stream in self._live.values():
            stream.abort()
        self._live.clear()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._llm.shutdown()
