"""TensorRT-LLM backend behind the step protocol (GPU replicas), for TensorRT-LLM 1.2.x's LLM API.

Written against the public source of TensorRT-LLM (NVIDIA/TensorRT-LLM, the 1.2 line; PyTorch backend);
the file behind each call relied on is named where it is made. Not run on a GPU yet: without one, a
stand-in ``tensorrt_llm`` (tests/engine/trtllm_standin) that refuses what the real library refuses drives
it in the tests, in process and in a replica process behind the router.

Settings (ours -> tensorrt_llm, LLM(**kwargs) -> TorchLlmArgs, llmapi/llm_args.py; all pydantic with
unknown names refused):

    ours                              tensorrt_llm
    (always)                          LLM(skip_tokenizer_init=True): prompts arrive as token ids and
                                      every request names its end_id, so TRT-LLM's tokenizer is not needed
    tensor_parallel_size              LLM(tensor_parallel_size=): TP over the replica's own devices,
                                      through TensorRT-LLM's own MPI workers (see "Environment" below)
    pipeline_parallel_size            LLM(pipeline_parallel_size=): in-process PP on this node's devices
                                      (an engine option; exaserve's cross-node pipeline_parallel runs the
                                      reference engine only, and `config check` refuses it for trtllm)
    max_batch_size, max_seq_len       LLM(max_batch_size=, max_seq_len=)
    chunked_prefill                   LLM(enable_chunked_prefill=)
    prefill_chunk_tokens              LLM(max_num_tokens= chunk + max_batch_size): one chunk plus a
                                      decode token per sequence per iteration
    enable_prefix_caching             KvCacheConfig(enable_block_reuse=)
    kv_cache_dtype fp16 | fp8         KvCacheConfig(dtype="auto" | "fp8")
    block_size                        KvCacheConfig(tokens_per_block=) (a power of two; in precise prefix
                                      mode the router's block_size, so KV events name the router's blocks)
    gpu_memory_utilization            KvCacheConfig(free_gpu_memory_fraction=) when no reservation is known
    the replica's reservation         KvCacheConfig(max_tokens=), see "Memory"
    KV events (precise routing)       KvCacheConfig(event_buffer_max_size=KV_EVENT_BUFFER)
    max_wait_ms, prefill_batch_size,  not applied: TensorRT-LLM's in-flight batching has no prefill
    decode_batch_size                 batch or batching window of ours (its batch_wait_timeout_ms waits
                                      for a *full max_batch_size*, which would add that wait to every
                                      request at low load); `config check` warns when a site sets them
    checkpoint torch_dtype float32    LLM(dtype="float16"): TensorRT-LLM's attention kernels take fp16/bf16

Sampling (SamplingParams, tensorrt_llm/sampling_params.py; a kw_only slots dataclass, so only its own
field names are accepted):

    max_tokens                        max_tokens
    temperature 0 (greedy)            top_k=1 (greedy in every version), temperature and top_p unset
    temperature > 0, top_p            temperature=, top_p=
    seed                              seed= (the LLM API's name; random_seed is the C++ config's)
    stop ids (request's, or the       stop_token_ids=[all of them] and end_id=the first: end_id is ONE id
    model's EOS ids from its          (llm.py only fills it from a tokenizer when None, and we load none),
    generation_config.json)           stop_token_ids are one-token stop words that TensorRT-LLM cuts from the
                                      output (include_stop_str_in_output False, executor/result.py); an
                                      END_ID token may stay in the output (the PyTorch sampler appends it
                                      before checking, _torch/pyexecutor/sampler.py): a final stop id is
                                      dropped here either way, so no stop token reaches StepOutput
    no stop ids at all (explicit ())  ignore_eos=True (request end_id -1, executor/base_worker.py)
    (always)                          detokenize=False: we never read the text

Streaming (the reason this module has an event-loop thread): a ``GenerationResult`` makes its asyncio
queue only if an event loop runs *in the thread that creates it*; otherwise ``async for`` fails in
``_aresult_step`` with "The asyncio event loop was not present during initialization, so async operations
are not available" (tensorrt_llm/executor/result.py, ``has_event_loop`` in executor/utils.py). So
``add_request`` only validates and hands the request to the loop thread, where a coroutine calls
``LLM.generate_async(..., streaming=True)`` (the result is made there) and iterates it with ``async for``,
turning the cumulative ``outputs[0].token_ids`` into deltas on a queue; ``step()`` drains that queue
(waiting up to ``poll_s`` when empty). ``abort`` runs ``GenerationResult.abort()`` on the same thread
(it calls the executor's ``abort_request``; the stream then ends "cancelled"), so every submission and
cancellation reaches TensorRT-LLM's request queue from one thread.

Memory: placement reserves ``StartReplica.memory_bytes`` per device for a replica (controller/catalogue.py:
gpu_memory_utilization x the GPU's memory); the agent reserves that (rounded up to its pool's blocks) and
says so in $EXASERVE_RESERVED_BYTES_PER_DEVICE (registry.reserved_bytes_per_device). Without a controller
figure (memory_bytes 0: tools, tests) there is no reservation to size by and gpu_memory_utilization stays
free_gpu_memory_fraction. TensorRT-LLM sizes its
KV pool as ``free_gpu_memory_fraction`` of the memory free when it profiles, which for replicas sharing a
GPU is whatever earlier ones left. With a reservation known the pool is bounded by tokens instead:

    kv_bytes_per_token = 2 (K, V) x ceil(num_key_value_heads / tp) x head_dim x ceil(layers / pp) x dtype bytes
    kv budget          = reservation - checkpoint bytes / (tp x pp) - max(ACTIVATION_RESERVE_MIN,
                                                                       ACTIVATION_RESERVE x reservation)
    max_tokens         = budget // kv_bytes_per_token, rounded down to whole blocks

and ``free_gpu_memory_fraction`` becomes BOUNDED_FRACTION: TensorRT-LLM takes the smaller of the two
(KvCacheCreator.configure_kv_cache_capacity min's the fraction's bytes with max_tokens x the per-token
size, tensorrt_llm/_torch/pyexecutor/_util.py). A reservation too small for one max_seq_len sequence is an
EngineError naming the numbers. (KvCacheConfig.max_gpu_total_bytes exists in 1.2 too, but the same
creator overwrites it with its own estimate, so max_tokens is the bound that holds.)

KV events (precise prefix routing): with prefix caching on and a KV-event endpoint, KvCacheConfig gets an
event buffer and a thread polls ``LLM.get_kv_cache_events(timeout)`` (llmapi/llm.py; dicts in the format of
KVCacheEventSerializer, tensorrt_llm/_utils.py) and publishes them as ours (kv_events.py). TensorRT-LLM's
block hashes are its own, but its "stored" blocks carry their token ids, so each stored block is re-hashed
with ours (block_manager.hash_block_tokens chained from ROOT_HASH, what the router computes):

    TRT "stored" {parent_hash, blocks[{block_hash, tokens[{token_id}]}]}
        -> BlockStored(our chained hashes, our parent hash (None at the root), token ids, block_size);
           the map TRT hash -> our hash is kept; a block with token_extra_id != 0 (multimodal) or not
           exactly block_size tokens ends the run; a stored run whose TRT parent is unknown (events
           lost) is skipped
    TRT "removed" {block_hashes}  -> BlockRemoved(our hashes of those we knew); forgotten
    TRT "created" (a new pool)    -> AllBlocksCleared, map cleared
    TRT "updated" (cache level or priority of a block) -> nothing: the block stays reusable

TensorRT-LLM hands out events only after a submission since its last empty read (its IterationResult is
"done" until the next request marks it undone, executor/executor.py), so blocks stored as a request ends
reach the router when the next request arrives. The same map gives ``stats()``'s prefix_hit_tokens /
prefix_query_tokens: each request's leading prompt tokens in blocks TensorRT-LLM has reported stored (what
its block reuse can serve), over its prompt tokens.

Environment: TensorRT-LLM starts its own MPI workers for TP > 1 (MpiPoolSession, llmapi/llm.py). A replica
inherits the srun task's PMIx/MPI variables, which would make those workers try to join the Slurm step;
the agent starts trtllm replicas without them (agent/replica_process.py, EngineSpec.isolate_mpi) and with
CUDA_VISIBLE_DEVICES = exactly the reserved devices (gpu_binding.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import queue
import threading
from pathlib import Path
from typing import Any, Iterable

from exaserve_hpc.cache.hf_format import generation_eos_ids, is_hf_config
from exaserve_hpc.engine.base import DEFAULT_EOS_IDS, EngineError, EngineRequest, StepOutput
from exaserve_hpc.engine.block_manager import ROOT_HASH, hash_block_tokens, prompt_block_hashes
from exaserve_hpc.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from exaserve_hpc.engine.kv_publisher import KVEventPublisher
from exaserve_hpc.engine.registry import TRTLLM_INSTALL as INSTALL_HINT

log = logging.getLogger("exaserve.trtllm")

KV_EVENT_BUFFER = 16384          # KvCacheConfig.event_buffer_max_size when KV events are on
KV_EVENT_POLL_S = 0.05           # get_kv_cache_events' timeout, and the pause after an empty read
ACTIVATION_RESERVE = 0.10        # of the reservation, kept out of the KV budget (activations, CUDA graphs)
ACTIVATION_RESERVE_MIN = 1 << 30
BOUNDED_FRACTION = 0.95          # free_gpu_memory_fraction when max_tokens bounds the pool
_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "fp8": 1, "float8_e4m3fn": 1}


# ---------------------------------------------------------------- settings


def llm_args(model_dir: str | os.PathLike, *, tensor_parallel_size: int = 1,
             pipeline_parallel_size: int = 1, max_batch_size: int = 32, max_seq_len: int = 2048,
             enable_prefix_caching: bool = True, kv_cache_dtype: str = "fp16",
             gpu_memory_utilization: float = 0.9, chunked_prefill: bool = True,
             prefill_chunk_tokens: int = 512, block_size: int = 32, kv_max_tokens: int | None = None,
             kv_events: bool = False, dtype: str | None = None) -> dict[str, Any]:
    """Keyword arguments for ``tensorrt_llm.LLM`` (``kv_cache_config`` as a plain dict for
    ``KvCacheConfig(**...)``). Pure: no import of tensorrt_llm."""
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
    kv_cache: dict[str, Any] = {
        "enable_block_reuse": enable_prefix_caching,
        "dtype": "fp8" if kv_cache_dtype == "fp8" else "auto",
        "free_gpu_memory_fraction": gpu_memory_utilization,
        "tokens_per_block": block_size,
    }
    if kv_max_tokens is not None:
        kv_cache["max_tokens"] = kv_max_tokens
        kv_cache["free_gpu_memory_fraction"] = BOUNDED_FRACTION
    if kv_events and enable_prefix_caching:  # events describe reusable blocks: none without reuse
        kv_cache["event_buffer_max_size"] = KV_EVENT_BUFFER
    args: dict[str, Any] = {
        "model": str(model_dir),
        "skip_tokenizer_init": True,
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "max_batch_size": max_batch_size,
        "max_seq_len": max_seq_len,
        "enable_chunked_prefill": chunked_prefill,
        "kv_cache_config": kv_cache,
    }
    if dtype is not None:
        args["dtype"] = dtype
    if chunked_prefill:
        args["max_num_tokens"] = step_token_budget(prefill_chunk_tokens, max_batch_size)
    return args


def step_token_budget(prefill_chunk_tokens: int, max_batch_size: int) -> int:
    """Tokens one TensorRT-LLM iteration computes at most (its max_num_tokens) as this backend sets it: one
    prefill chunk plus a decode token for every sequence. The simulator's replicas take the same budget."""
    return prefill_chunk_tokens + max_batch_size


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


def read_config(model_dir: Path) -> dict:
    try:
        return json.loads((model_dir / "config.json").read_bytes())
    except (OSError, ValueError) as e:
        raise EngineError(f"{model_dir / 'config.json'} cannot be read ({e}); check the model path") from e


def model_eos_ids(model_dir: Path) -> tuple[int, ...]:
    """The EOS ids of a checkpoint: a Hugging Face one's generation config, the byte tokenizer's EOS for
    an exaserve-llama-v1 one."""
    return tuple(generation_eos_ids(model_dir)) if is_hf_config(read_config(model_dir)) else DEFAULT_EOS_IDS


def kv_bytes_per_token(config: dict, kv_cache_dtype: str, tp: int = 1, pp: int = 1) -> int:
    """KV-cache bytes one token takes on one device of a tp x pp replica (a Hugging Face config.json)."""
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    if kv_cache_dtype == "fp8":
        width = 1
    else:
        width = min(2, _DTYPE_BYTES.get(str(config.get("torch_dtype", "bfloat16")), 2))  # fp32 runs as fp16
    return 2 * math.ceil(kv_heads / tp) * head_dim * math.ceil(layers / pp) * width


def checkpoint_bytes(model_dir: Path) -> int:
    """Bytes of the checkpoint's weight files (what the devices hold, before KV cache)."""
    return sum(p.stat().st_size for p in model_dir.iterdir()
               if p.is_file() and p.suffix in (".safetensors", ".bin", ".pt"))


def kv_token_budget(model_dir: Path, reserved_bytes: int, *, tp: int, pp: int, kv_cache_dtype: str,
                    block_size: int, max_seq_len: int) -> int:
    """KvCacheConfig.max_tokens for a replica reserving ``reserved_bytes`` per device (module docstring)."""
    config = read_config(model_dir)
    if not is_hf_config(config):
        raise EngineError(f"{model_dir} is not a Hugging Face checkpoint (config.json has no model_type); "
                          "TensorRT-LLM reads Hugging Face checkpoints")
    per_token = kv_bytes_per_token(config, kv_cache_dtype, tp, pp)
    weights = checkpoint_bytes(model_dir) // (tp * pp)
    reserve = max(ACTIVATION_RESERVE_MIN, int(ACTIVATION_RESERVE * reserved_bytes))
    budget = reserved_bytes - weights - reserve
    tokens = max(0, budget) // per_token // block_size * block_size
    if tokens < max_seq_len:
        raise EngineError(
            f"the replica's reservation of {reserved_bytes} bytes per GPU holds {weights} bytes of weights "
            f"and {reserve} kept for activations, leaving KV cache for {tokens} tokens "
            f"({per_token} bytes each), fewer than max_seq_len {max_seq_len}; raise the model's "
            "gpu_memory_utilization or tensor_parallel, or lower max_seq_len")
    return tokens


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


# ---------------------------------------------------------------- KV events


class KvEventTranslator:
    """TensorRT-LLM KV-cache events (dicts) -> exaserve's, re-hashed as the router hashes (module docstring)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.ours: dict[int, int] = {}  # TensorRT-LLM block hash -> our block hash
        self.lock = threading.Lock()    # `ours` is written by the events thread, read by cached_tokens

    def cached_tokens(self, prompt: list[int]) -> int:
        """Leading prompt tokens in blocks TensorRT-LLM has said it stores (and not since removed)."""
        hit = 0
        with self.lock:
            held = set(self.ours.values())
        for h in prompt_block_hashes(prompt, self.block_size):
            if h not in held:
                break
            hit += self.block_size
        return hit

    def translate(self, raw: Iterable) -> list[KVEvent]:
        with self.lock:
            return self._translate(raw)

    def _translate(self, raw: Iterable) -> list[KVEvent]:
        out: list[KVEvent] = []
        for event in _flatten(raw):
            data = event.get("data") or {}
            kind = data.get("type")
            if kind == "stored":
                stored = self._stored(data)
                if stored is not None:
                    out.append(stored)
            elif kind == "removed":
                gone = [self.ours.pop(h) for h in data.get("block_hashes") or () if h in self.ours]
                if gone:
                    out.append(BlockRemoved(gone))
            elif kind == "created":
                self.ours.clear()
                out.append(AllBlocksCleared())
        return out

    def _stored(self, data: dict) -> BlockStored | None:
        trt_parent = data.get("parent_hash")
        parent = ROOT_HASH if trt_parent is None else self.ours.get(trt_parent)
        if parent is None:
            return None  # its prefix was named in events we never saw: nothing we can name
        first_parent, hashes, tokens = parent, [], []
        for block in data.get("blocks") or ():
            entries = block.get("tokens") or ()
            ids = [t.get("token_id") for t in entries]
            if len(ids) != self.block_size or any(t.get("token_extra_id") for t in entries):
                break
            parent = hash_block_tokens(parent, ids)
            self.ours[block["block_hash"]] = parent
            hashes.append(parent)
            tokens += ids
        if not hashes:
            return None
        return BlockStored(hashes, None if first_parent == ROOT_HASH else first_parent, tokens, self.block_size)


def _flatten(raw) -> Iterable[dict]:
    for item in raw or ():
        if isinstance(item, str):
            item = json.loads(item)
        if isinstance(item, list):
            yield from _flatten(item)
        elif isinstance(item, dict):
            yield item


# ---------------------------------------------------------------- the engine


class TrtLlmEngine:
    """``base.Engine`` over ``tensorrt_llm.LLM``; see the module docstring."""

    def __init__(self, model_dir: str | os.PathLike, *, poll_s: float = 0.005, reserved_bytes: int | None = None,
                 kv_events_endpoint: str | None = None, kv_events_tokens: bool = True, replica_id: str = "",
                 **settings) -> None:
        self._model_dir = Path(model_dir)
        block_size = settings.get("block_size", 32)
        if reserved_bytes:
            settings["kv_max_tokens"] = kv_token_budget(
                self._model_dir, reserved_bytes, tp=settings.get("tensor_parallel_size", 1),
                pp=settings.get("pipeline_parallel_size", 1), kv_cache_dtype=settings.get("kv_cache_dtype", "fp16"),
                block_size=block_size, max_seq_len=settings.get("max_seq_len", 2048))
        if self._model_dir.is_dir() and (self._model_dir / "config.json").exists():
            config = read_config(self._model_dir)
            if str(config.get("torch_dtype")) in ("float32", "float"):
                settings.setdefault("dtype", "float16")
        self.args = llm_args(model_dir, kv_events=kv_events_endpoint is not None, **settings)
        trt = import_tensorrt_llm()
        from tensorrt_llm.llmapi import KvCacheConfig  # tensorrt_llm/llmapi/__init__.py exports it

        self._trt = trt
        self._eos_ids: tuple[int, ...] | None = None
        self.max_seq_len = self.args["max_seq_len"]
        self.block_size = block_size
        kwargs = {**self.args, "kv_cache_config": KvCacheConfig(**self.args["kv_cache_config"])}
        self._llm = trt.LLM(**kwargs)  # tensorrt_llm/llmapi/llm.py
        self._poll_s = poll_s
        self._out: queue.Queue = queue.Queue()          # (id, new ids, finished, reason) from the loop thread
        self._live: dict[str, EngineRequest] = {}       # in flight, as the step loop sees them
        self._emitted: dict[str, int] = {}
        self._aborted: set[str] = set()
        self._serial: dict[str, int] = {}               # id -> this submission's number (ids may recur)
        self._next_serial = 0
        # touched on the loop thread only, keyed by submission number:
        self._handles: dict[int, Any] = {}              # -> GenerationResult
        self._abort_pending: set[int] = set()           # aborted before generate_async ran
        self._tasks: set[asyncio.Task] = set()
        self._counters = dict(tokens_generated=0, requests_finished=0, requests_aborted=0,
                              prefill_tokens=0, prefix_hit_tokens=0, prefix_query_tokens=0)
        self._translator: KvEventTranslator | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="trtllm-streams")
        self._thread.start()
        self._closed = False
        self._publisher = None
        self._events_stop = threading.Event()
        self._events_thread: threading.Thread | None = None
        if kv_events_endpoint is not None and self.args["kv_cache_config"].get("event_buffer_max_size"):
            self._publisher = KVEventPublisher(kv_events_endpoint, replica_id=replica_id, with_tokens=kv_events_tokens)
            self._translator = KvEventTranslator(block_size)
            self._events_thread = threading.Thread(target=self._poll_kv_events, daemon=True, name="trtllm-kv-events")
            self._events_thread.start()

    @property
    def kv_events_endpoint(self) -> str | None:
        return self._publisher.endpoint if self._publisher is not None else None

    # ------------------------------------------------ requests

    def add_request(self, req: EngineRequest) -> None:
        if self._closed:
            raise EngineError("engine is shut down; start a new one")
        if req.request_id in self._live:
            raise ValueError(f"request_id {req.request_id!r} is already in flight; ids must be unique")
        prompt = len(req.prompt_token_ids)
        if prompt + req.max_tokens > self.max_seq_len:
            raise ValueError(f"request {req.request_id}: prompt of {prompt} tokens + max_tokens "
                             f"{req.max_tokens} exceeds max_seq_len {self.max_seq_len}")
        params = self.sampling_params(req)
        self._live[req.request_id] = req
        self._emitted[req.request_id] = 0
        self._next_serial += 1
        self._serial[req.request_id] = self._next_serial
        self._counters["prefill_tokens"] += prompt
        if self._translator is not None:  # what TensorRT-LLM can reuse for it, as its KV events told us
            self._counters["prefix_query_tokens"] += prompt
            self._counters["prefix_hit_tokens"] += self._translator.cached_tokens(req.prompt_token_ids)
        # generate_async must run on the loop that reads its result (module docstring, executor/result.py)
        asyncio.run_coroutine_threadsafe(self._start(req, params, self._next_serial), self._loop)

    def sampling_params(self, req: EngineRequest):
        """``tensorrt_llm.SamplingParams`` for a request (mapping in the module docstring)."""
        stops = list(self._stop_ids(req))
        fields: dict[str, Any] = dict(max_tokens=req.max_tokens, detokenize=False)
        if stops:
            fields.update(end_id=stops[0], stop_token_ids=stops)
        else:
            fields.update(end_id=0, ignore_eos=True)  # end_id only so no tokenizer is asked for one
        if req.temperature == 0:
            fields["top_k"] = 1
        else:
            fields.update(temperature=float(req.temperature), top_p=float(req.top_p))
        if req.seed is not None:
            fields["seed"] = int(req.seed)
        return self._trt.SamplingParams(**fields)  # tensorrt_llm/sampling_params.py

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The model's EOS ids, read from its checkpoint on first use."""
        if self._eos_ids is None:
            self._eos_ids = model_eos_ids(self._model_dir)
        return self._eos_ids

    def _stop_ids(self, req: EngineRequest) -> tuple[int, ...]:
        """The request's stop ids, or the model's EOS ids (its generation_config.json)."""
        return self.eos_token_ids if req.stop_token_ids is None else tuple(req.stop_token_ids)

    # ------------------------------------------------ on the loop thread

    async def _start(self, req: EngineRequest, params, serial: int) -> None:
        task = asyncio.current_task()
        self._tasks.add(task)
        rid = req.request_id
        sent = 0
        try:
            if serial in self._abort_pending:  # aborted before it was submitted: never submit it
                self._abort_pending.discard(serial)
                self._out.put((rid, [], True, "cancelled"))
                return
            result = self._llm.generate_async(list(req.prompt_token_ids), sampling_params=params,
                                              streaming=True)
            self._handles[serial] = result
            async for output in result:  # the result was made on this loop: it has its asyncio queue
                completion = output.outputs[0]
                ids = list(completion.token_ids)
                reason = completion.finish_reason if output.finished else None
                self._out.put((rid, ids[sent:], output.finished, reason))
                sent = max(sent, len(ids))
                if output.finished:
                    return
            self._out.put((rid, [], True, "error: the stream ended without a final output"))
        except asyncio.CancelledError:
            self._out.put((rid, [], True, "cancelled"))
            raise
        except Exception as e:  # surfaced to the serving loop as an aborted request
            log.warning("TensorRT-LLM request %s failed: %r", rid, e)
            self._out.put((rid, [], True, f"error: {e!r}"))
        finally:
            self._handles.pop(serial, None)
            self._tasks.discard(task)

    def _abort_on_loop(self, serial: int) -> None:
        handle = self._handles.get(serial)
        if handle is None:
            self._abort_pending.add(serial)  # _start has not run yet (it ran and ended: a stale number)
        elif not handle.finished:
            handle.abort()  # GenerationResult.abort -> executor.abort_request (executor/result.py)

    async def _abort_all(self) -> None:
        for handle in list(self._handles.values()):
            if not handle.finished:
                try:
                    handle.abort()
                except Exception:
                    log.exception("abort at shutdown")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # ------------------------------------------------ the step protocol

    def abort(self, request_id: str) -> None:
        if request_id in self._live and request_id not in self._aborted and not self._closed:
            self._aborted.add(request_id)
            self._loop.call_soon_threadsafe(self._abort_on_loop, self._serial[request_id])

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def step(self) -> list[StepOutput]:
        if self._closed:
            raise EngineError("engine is shut down; start a new one")
        try:
            events = [self._out.get(timeout=self._poll_s)]
        except queue.Empty:
            events = []
        while True:
            try:
                events.append(self._out.get_nowait())
            except queue.Empty:
                break
        outputs = []
        for request_id, new, finished, reason in events:
            req = self._live.get(request_id)
            if req is None:
                continue
            total = self._emitted[request_id] + len(new)
            if finished:
                del self._live[request_id]
                del self._emitted[request_id]
                self._serial.pop(request_id, None)
                self._counters["requests_finished"] += 1
                if request_id in self._aborted or reason not in ("stop", "length"):
                    self._counters["requests_aborted"] += 1
                    reason = "abort"  # cancelled by us, or failed inside TensorRT-LLM
                self._aborted.discard(request_id)
                if reason == "stop":
                    if new and new[-1] in self._stop_ids(req):
                        new = new[:-1]  # an END_ID token TensorRT-LLM left in (module docstring)
                    else:
                        total += 1  # the stop token TensorRT-LLM cut: generated, not returned
            else:
                self._emitted[request_id] = total
            self._counters["tokens_generated"] += len(new)
            outputs.append(StepOutput(request_id, new, finished, reason if finished else None,
                                      len(req.prompt_token_ids), total))
        return outputs

    def stats(self) -> dict:
        return {"queue_depth": 0, "running": len(self._live), **self._counters,
                "kv_used": 0.0, "engine": "trtllm"}

    def warmup(self) -> None:
        """One short greedy generation through the real engine, synchronous, on the replica's main thread (no
        event loop there). Being TensorRT-LLM's first submission it also creates the executor's KV-event
        IterationResult (executor/executor.py ``_maybe_initialize_iteration_results``) here, with a plain
        queue, which the events thread reads synchronously; made on the stream loop it would hold only that
        loop's asyncio queue (executor/result.py IterationResult.__init__)."""
        params = self.sampling_params(EngineRequest("warmup", [1, 2, 3, 4], 4, stop_token_ids=()))
        try:
            out = self._llm.generate([1, 2, 3, 4], sampling_params=params, use_tqdm=False)
        except Exception as e:
            raise EngineError(f"TensorRT-LLM warm-up failed: {e!r}") from e
        if not out or not list(out.outputs[0].token_ids):
            raise EngineError(f"TensorRT-LLM warm-up produced no tokens: {out!r}")

    # ------------------------------------------------ KV events (their own thread)

    def _poll_kv_events(self) -> None:
        complained = False
        while not self._events_stop.is_set():
            try:
                raw = self._llm.get_kv_cache_events(timeout=KV_EVENT_POLL_S)  # tensorrt_llm/llmapi/llm.py
            except Exception as e:  # before the first request its IterationResult does not exist yet
                if not complained:
                    log.debug("KV events not readable yet: %r", e)
                    complained = True
                self._events_stop.wait(KV_EVENT_POLL_S)
                continue
            events = self._translator.translate(raw)
            if events:
                self._publisher.publish(events)
            else:
                self._events_stop.wait(KV_EVENT_POLL_S)  # "done" until the next submission: no busy loop

    # ------------------------------------------------ the end

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._abort_all(), self._loop).result(timeout=10)
        except Exception:
            log.exception("aborting TensorRT-LLM requests at shutdown")
        self._live.clear()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if self._events_thread is not None:
            self._events_stop.set()
            self._events_thread.join(timeout=5)
        if self._publisher is not None:
            self._publisher.close()
        self._llm.shutdown()  # tensorrt_llm/llmapi/llm.py: executor and MPI session
