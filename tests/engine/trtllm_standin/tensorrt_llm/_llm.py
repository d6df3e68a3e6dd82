"""The stand-in's LLM: what tensorrt_llm/llmapi/llm.py and the executor do with a request, minus the GPU.

Rules enforced, with the real file behind each:

- Construction (llmapi/llm.py ``LLM.__init__`` -> ``TorchLlmArgs.from_kwargs``): named parameters model,
  tokenizer, tokenizer_mode, skip_tokenizer_init, trust_remote_code, tensor_parallel_size, dtype, revision,
  tokenizer_revision; every other keyword goes to the pydantic args model, which refuses unknown names.
  ``kv_cache_config`` must be a KvCacheConfig (or its fields as a dict: pydantic validates it into one).
  A multi-GPU world (tp x pp > 1) needs that many visible devices: "Only N GPUs are available, but M are
  required" (RuntimeError, same file); the stand-in counts $CUDA_VISIBLE_DEVICES entries (8 when unset).
  A model path that is not a directory is refused (the real one would try the Hugging Face hub).
- ``generate_async`` (llmapi/llm.py): RuntimeError "LLM is shutting down" after shutdown(); TypeError for
  sampling_params that are not SamplingParams; with ``end_id`` None and no tokenizer (skip_tokenizer_init)
  ValueError "tokenizer is required to reset end_id if it is None, or you can explicitly specify the end_id
  for sampling_params"; inputs must be a str or a list of int. The GenerationResult is made in the calling
  thread (executor/base_worker.py ``submit``), which is what decides its asyncio queue (executor/result.py).
  Each submission marks the KV-event IterationResult "undone" (executor/executor.py
  ``_maybe_initialize_iteration_results``), creating it on the first.
- ``get_kv_cache_events(timeout)`` (executor/executor.py ``get_kv_events`` -> IterationResult.get_results,
  executor/result.py): AssertionError "KV Event IterationResult is not properly instantiated." before any
  submission; otherwise it reads events until none came for ``timeout`` seconds, then is *done* and returns
  [] at once until the next submission. Events exist only with ``event_buffer_max_size`` > 0 and
  ``enable_block_reuse`` (LLM.get_kv_cache_events' docstring); the buffer keeps the newest that many.
  Each event is a dict as KVCacheEventSerializer writes it (tensorrt_llm/_utils.py): {"event_id", "data",
  "window_size"}, data {"type": "created", "num_blocks_per_cache_level"} | {"type": "stored",
  "parent_hash", "blocks": [{"type": "stored_block", "block_hash", "tokens": [{"type": "unique_token",
  "token_id", "token_extra_id"}], "cache_level", "priority"}]} | {"type": "removed", "block_hashes"}.
  Block hashes are TensorRT-LLM's own (not exaserve's): here a 64-bit hash of (parent, tokens).
- Stop criteria, in the order of the PyTorch sampler's ``_handle_stop_criteria``
  (tensorrt_llm/_torch/pyexecutor/sampler.py): ``new_token == end_id`` -> END_ID; max_tokens reached ->
  LENGTH; the token is a stop word -> STOP_WORDS. ``ignore_eos`` sends end_id -1 and, in 1.2, no stop words
  (executor/base_worker.py ``_enqueue_request``).
- ``abort_request`` cancels at the next iteration (final response CANCELLED); ``shutdown()`` is idempotent;
  requests still running then never finish (the real executor stops delivering responses).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Optional

from ._llm_args import KvCacheConfig, TorchLlmArgs
from .executor.result import GenerationResult
from .sampling_params import SamplingParams, check_binding_types

STEP_S = 0.001  # one executor iteration


def _record(call: str, **fields) -> None:
    path = os.environ.get("TRTLLM_STANDIN_RECORD")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"call": call, **fields}, default=lambda o: o.model_dump()
                               if hasattr(o, "model_dump") else repr(o)) + "\n")


def _device_count() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return 8
    return len([d for d in visible.split(",") if d.strip()])


def _trt_hash(parent: Optional[int], tokens: tuple) -> int:
    data = json.dumps([parent, list(tokens)]).encode()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little") >> 1  # a non-negative int64


class _Request:
    def __init__(self, rid: int, prompt: list[int], params: SamplingParams, streaming: bool,
                 result: GenerationResult) -> None:
        self.rid, self.prompt, self.params, self.streaming, self.result = rid, prompt, params, streaming, result
        self.generated: list[int] = []
        self.pending: list[int] = []  # not yet delivered (non-streaming: everything until the end)


class _KvEvents:
    """The block pool's reuse tree, reduced to what the events say."""

    def __init__(self, config: KvCacheConfig, window: int) -> None:
        self.enabled = config.enable_block_reuse and config.event_buffer_max_size > 0
        self.block = config.tokens_per_block
        self.capacity = max(1, (config.max_tokens or 64 * self.block) // self.block)
        self.window = window
        self.cached: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU order
        self.buffer: collections.deque = collections.deque(maxlen=max(1, config.event_buffer_max_size))
        self.next_id = 0
        self._emit({"type": "created", "num_blocks_per_cache_level": [self.capacity, 0]})

    def _emit(self, data: dict) -> None:
        if self.enabled:
            self.buffer.append({"event_id": self.next_id, "data": data, "window_size": self.window})
            self.next_id += 1

    def store(self, tokens: list[int]) -> None:
        parent, first_parent, blocks = None, None, []
        for lo in range(0, len(tokens) - self.block + 1, self.block):
            chunk = tuple(tokens[lo:lo + self.block])
            h = _trt_hash(parent, chunk)
            if h in self.cached:
                self.cached.move_to_end(h)
            else:
                if not blocks:
                    first_parent = parent
                self.cached[h] = None
                blocks.append({"type": "stored_block", "block_hash": h, "cache_level": 0, "priority": 35,
                               "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                                          for t in chunk]})
            parent = h
        if blocks:
            self._emit({"type": "stored", "parent_hash": first_parent, "blocks": blocks})
        evicted = []
        while len(self.cached) > self.capacity:
            evicted.append(self.cached.popitem(last=False)[0])
        if evicted:
            self._emit({"type": "removed", "block_hashes": evicted})


class _Executor:
    """TensorRT-LLM's executor loop, in a thread: one token per running request per iteration."""

    def __init__(self, args: TorchLlmArgs) -> None:
        self.args = args
        self.lock = threading.Lock()
        self.running: dict[int, _Request] = {}
        self.cancelled: set[int] = set()
        self.shut = False
        self.next_id = 1
        self.kv = _KvEvents(args.kv_cache_config, args.max_seq_len or 2048)
        self.kv_result_made = False
        self.kv_done = False
        self.thread = threading.Thread(target=self._run, name="standin-executor", daemon=True)
        self.thread.start()

    def submit(self, prompt: list[int], params: SamplingParams, streaming: bool) -> GenerationResult:
        with self.lock:
            rid = self.next_id
            self.next_id += 1
            self.kv_result_made, self.kv_done = True, False
        result = GenerationResult(rid, params, self, streaming)  # in the caller's thread, as the real one
        with self.lock:
            self.running[rid] = _Request(rid, prompt, params, streaming, result)
        return result

    def abort_request(self, rid: int) -> None:
        with self.lock:
            if rid in self.running:
                self.cancelled.add(rid)

    def shutdown(self) -> None:
        with self.lock:
            self.shut = True
        self.thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self.lock:
                if self.shut:
                    return
                work = list(self.running.values())
            for req in work:
                self._advance(req)
            time.sleep(STEP_S)

    def _advance(self, req: _Request) -> None:
        with self.lock:
            cancelled = req.rid in self.cancelled
        if cancelled:
            self._finish(req, "CANCELLED")
            return
        p = req.params
        if not req.generated:
            with self.lock:
                self.kv.store(req.prompt)  # context blocks are stored after prefill
        n = len(req.generated)
        token = (req.prompt[n] + 1) % 256 if n < len(req.prompt) else 32
        req.generated.append(token)
        req.pending.append(token)
        end_id = -1 if p.ignore_eos else p.end_id
        stops = [] if p.ignore_eos else (p.stop_token_ids or [])
        limit = min(p.max_tokens, (self.args.max_seq_len or 1 << 30) - len(req.prompt))
        reason = ("END_ID" if token == end_id else "LENGTH" if len(req.generated) >= limit
                  else "STOP_WORDS" if token in stops else None)
        if reason is not None:
            self._finish(req, reason)
        elif req.streaming:
            req.result._deliver((req.pending, False, None))
            req.pending = []

    def _finish(self, req: _Request, reason: str) -> None:
        with self.lock:
            self.running.pop(req.rid, None)
            self.cancelled.discard(req.rid)
        req.result._deliver((req.pending, True, reason))
        req.pending = []

    def kv_events(self, timeout: float) -> list[dict]:
        with self.lock:
            if not self.kv_result_made:
                raise AssertionError("KV Event IterationResult is not properly instantiated.")
            if self.kv_done:
                return []
        out: list[dict] = []
        while True:
            with self.lock:
                got = list(self.kv.buffer)
                self.kv.buffer.clear()
            out += got
            if not got:
                time.sleep(timeout)
                with self.lock:
                    got = list(self.kv.buffer)
                    self.kv.buffer.clear()
                    if not got:
                        self.kv_done = True
                out += got
                if not got:
                    return json.loads(json.dumps(out))  # plain dicts, as json.loads gives them


class LLM:
    def __init__(self, model, tokenizer=None, tokenizer_mode="auto", skip_tokenizer_init: bool = False,
                 trust_remote_code: bool = False, tensor_parallel_size: int = 1, dtype: str = "auto",
                 revision=None, tokenizer_revision=None, **kwargs: Any) -> None:
        self._executor: Optional[_Executor] = None
        self.args = TorchLlmArgs(model=model, tokenizer=tokenizer, tokenizer_mode=tokenizer_mode,
                                 skip_tokenizer_init=skip_tokenizer_init, trust_remote_code=trust_remote_code,
                                 tensor_parallel_size=tensor_parallel_size, dtype=dtype, revision=revision,
                                 tokenizer_revision=tokenizer_revision, **kwargs)
        world = self.args.tensor_parallel_size * self.args.pipeline_parallel_size
        if world > 1 and _device_count() < world:
            raise RuntimeError(f"Only {_device_count()} GPUs are available, but {world} are required.")
        if not Path(self.args.model).is_dir():
            raise ValueError(f"stand-in: {self.args.model} is not a local checkpoint directory")
        _record("LLM", **self.args.model_dump(exclude_defaults=True, mode="json"))
        self.tokenizer = None if skip_tokenizer_init else object()
        self._executor = _Executor(self.args)

    def _prepare_sampling_params(self, sampling_params) -> SamplingParams:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"The sampling_params must be type SamplingParams or None, but got "
                            f"{type(sampling_params)}")
        if sampling_params.end_id is None:
            if self.tokenizer is None:
                raise ValueError("tokenizer is required to reset end_id if it is None, or you can explicitly "
                                 "specify the end_id for sampling_params")
            sampling_params.end_id = 2  # the stand-in tokenizer's eos_token_id
            sampling_params.pad_id = sampling_params.pad_id if sampling_params.pad_id is not None else 2
        return sampling_params

    def generate_async(self, inputs, sampling_params: Optional[SamplingParams] = None, lora_request=None,
                       prompt_adapter_request=None, streaming: bool = False, kv_cache_retention_config=None,
                       disaggregated_params=None, _postproc_params=None, scheduling_params=None,
                       cache_salt=None) -> GenerationResult:
        if self._executor is None or self._executor.shut:
            raise RuntimeError("LLM is shutting down")
        params = self._prepare_sampling_params(sampling_params)
        if not (isinstance(inputs, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in inputs)):
            raise TypeError(f"The inputs must be type str or list of int, but got {type(inputs)}")
        check_binding_types(params)
        if self.args.max_seq_len and len(inputs) > self.args.max_seq_len:
            raise ValueError(f"`prompt_token_ids` length ({len(inputs)}) is greater than `max_seq_len` "
                             f"({self.args.max_seq_len})")
        _record("generate_async", inputs=inputs, streaming=streaming)
        _record("SamplingParams", **{name: getattr(params, name) for name in (
            "end_id", "max_tokens", "stop_token_ids", "temperature", "top_k", "top_p", "seed", "ignore_eos",
            "detokenize") if getattr(params, name) is not None})
        return self._executor.submit(list(inputs), params, streaming)

    def generate(self, inputs, sampling_params: Optional[SamplingParams] = None, use_tqdm: bool = True, **kw):
        unbatched = not isinstance(inputs, list) or (inputs and isinstance(inputs[0], int))
        batch = [inputs] if unbatched else inputs
        _record("generate", prompts=batch)
        futures = [self.generate_async(i, sampling_params=sampling_params, streaming=False, **kw) for i in batch]
        for f in futures:
            f.result()
        return futures[0] if unbatched else futures

    def get_kv_cache_events(self, timeout: Optional[float] = 2) -> list[dict]:
        if self._executor is None:
            return []
        return self._executor.kv_events(timeout or 0.0)

    def shutdown(self) -> None:
        if self._executor is not None:
            _record("shutdown")
            self._executor.shutdown()
            self._executor = None
