"""Continuous batching over a paged KV cache: what every step-protocol engine
built on ``Scheduler`` shares (the reference engine, the timing model).

Implements ``exaserve_hpc.engine.base.Engine`` (read its call protocol).
Each ``step()`` is three parts, nano-vllm style: ``Scheduler.schedule`` ->
``_execute`` (the subclass: run the model, or account time) ->
``_complete`` (advance computed tokens, register full blocks in the prefix
cache, emit tokens, finish requests). Aborts are answered first.

A subclass provides ``_execute(batch) -> {sequence: next token}`` for every
sequence whose pending tokens the batch computes completely, plus
``warmup()``; it calls ``_setup`` from its constructor.

Knobs: ``max_batch_size`` (running sequences), ``max_wait_ms`` (an idle
engine's batching window), ``prefill_batch_size`` (admissions per step),
``decode_batch_size`` (sequences per decode forward pass),
``chunked_prefill`` / ``prefill_chunk_tokens``, ``enable_prefix_caching``,
``block_size`` and ``num_kv_blocks`` (default: room for ``max_batch_size``
sequences of ``max_seq_len``), ``kv_events_endpoint`` (ZeroMQ PUB bind
address for KV events; None = off) and ``kv_events_tokens`` (False: stored
blocks are announced by hash only, without their token ids).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from exaserve_hpc.engine.base import DEFAULT_EOS_IDS, EngineError, EngineRequest, StepOutput
from exaserve_hpc.engine.block_manager import BlockManager
from exaserve_hpc.engine.kv_publisher import KVEventPublisher
from exaserve_hpc.engine.latency_stats import LatencyStats
from exaserve_hpc.engine.sampling import request_rng
from exaserve_hpc.engine.batching import ScheduledBatch, Scheduler, StepLimits, Sequence


class ContinuousBatchingEngine:
    """Request bookkeeping and the step loop; see the module docstring."""

    vocab_size: int
    kv_cache_dtype: str = "fp16"
    kv_bytes_per_token: int = 0

    def _setup(self, *, vocab_size: int, max_batch_size: int = 32, max_seq_len: int = 2048,
               max_wait_ms: float = 50, prefill_batch_size: int = 8, decode_batch_size: int = 64,
               chunked_prefill: bool = True, prefill_chunk_tokens: int = 512,
               enable_prefix_caching: bool = True, block_size: int = 16,
               num_kv_blocks: int | None = None, kv_events_endpoint: str | None = None,
               kv_events_tokens: bool = True, replica_id: str = "", eos_token_ids=DEFAULT_EOS_IDS, clock: Callable[[], float] = time.monotonic) -> None:
        for name, value, low in (("max_seq_len", max_seq_len, 2),
                                 ("decode_batch_size", decode_batch_size, 1),
                                 ("block_size", block_size, 1)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.decode_batch_size = decode_batch_size
        config = StepLimits(max_batch_size=max_batch_size, max_wait_ms=max_wait_ms,
                                 prefill_batch_size=prefill_batch_size,
                                 chunked_prefill=chunked_prefill,
                                 prefill_chunk_tokens=prefill_chunk_tokens)
        if num_kv_blocks is None:
            num_kv_blocks = -(-max_batch_size * max_seq_len // block_size)
        self.blocks = BlockManager(num_kv_blocks, block_size, enable_prefix_caching,
                                   record_events=kv_events_endpoint is not None)
        self.scheduler = Scheduler(config, self.blocks)
        self._events = KVEventPublisher(kv_events_endpoint, replica_id=replica_id, with_tokens=kv_events_tokens) \
            if kv_events_endpoint is not None else None
        self._clock = clock
        self._live: dict[str, Sequence] = {}   # waiting or running, by request id
        self._aborts: list[str] = []
        self._closed = False
        self.latency = LatencyStats()
        self._counters = dict(tokens_generated=0, requests_finished=0, requests_aborted=0,
                              prefill_tokens=0)

    @property
    def kv_events_endpoint(self) -> str | None:
        """The bound KV-event endpoint (a wildcard port resolved), or None."""
        return self._events.endpoint if self._events is not None else None

    # ------------------------------------------------------------ requests

    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("engine is shut down; start a new one")

    def add_request(self, req: EngineRequest) -> None:
        """Queue a request; ValueError if it can never be served (see base)."""
        self._check_open()
        if req.request_id in self._live:
            raise ValueError(f"request_id {req.request_id!r} is already in flight; ids must be unique")
        prompt = len(req.prompt_token_ids)
        if prompt + req.max_tokens > self.max_seq_len:
            raise ValueError(
                f"request {req.request_id}: prompt of {prompt} tokens + max_tokens "
                f"{req.max_tokens} = {prompt + req.max_tokens} exceeds max_seq_len "
                f"{self.max_seq_len}; shorten the prompt or lower max_tokens"
            )
        bad = [t for t in req.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"request {req.request_id}: token id {bad[0]} is outside the model's "
                f"vocabulary 0..{self.vocab_size - 1}"
            )
        # The last token is never fed back, so it needs no KV slot.
        need = self.blocks.blocks_needed(prompt + req.max_tokens - 1)
        if need > self.blocks.num_blocks:
            raise ValueError(
                f"request {req.request_id}: {prompt} + {req.max_tokens} tokens need {need} KV "
                f"blocks of {self.blocks.block_size} but the pool has {self.blocks.num_blocks}; "
                "raise num_kv_blocks or shorten the request"
            )
        seq = Sequence(req, arrived=self._clock(), token_ids=list(req.prompt_token_ids),
                       stop_ids=frozenset(self.eos_token_ids if req.stop_token_ids is None else req.stop_token_ids),
                       rng=request_rng(req.seed))
        self.scheduler.add(seq)
        self._live[req.request_id] = seq

    def abort(self, request_id: str) -> None:
        """End a request with reason "abort" at the next step; unknown ids are ignored."""
        if request_id in self._live and request_id not in self._aborts:
            self._aborts.append(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._live)

    # ------------------------------------------------------------ stepping

    def step(self) -> list[StepOutput]:
        """One scheduling iteration: schedule -> execute -> complete."""
        self._check_open()
        outputs = self._take_aborts()
        batch = self.scheduler.schedule(self._clock())
        if batch:
            tokens = self._execute(batch)
            outputs += self._complete(batch, tokens, self._clock())
        self._publish_events()
        return outputs

    def _execute(self, batch: ScheduledBatch) -> dict[Sequence, int]:
        raise NotImplementedError

    def _publish_events(self) -> None:
        if self._events is not None:
            self._events.publish(self.blocks.take_events())

    def _take_aborts(self) -> list[StepOutput]:
        outputs = []
        for request_id in self._aborts:
            seq = self._live.get(request_id)
            if seq is not None:
                self._counters["requests_aborted"] += 1
                outputs.append(self._finish(seq, [], "abort"))
        self._aborts.clear()
        return outputs

    def _complete(self, batch: ScheduledBatch, tokens: dict[Sequence, int],
                  now: float) -> list[StepOutput]:
        """Account the computed tokens, then emit the sampled ones."""
        self.latency.record_step(len(batch.decodes) + len(batch.prefills))
        self._counters["prefill_tokens"] += batch.prefill_tokens
        outputs = []
        for seq, n in batch.chunks():
            if seq.done:
                continue  # aborted while its batch was in flight (timing engine)
            seq.num_computed_tokens += n
            assert seq.num_computed_tokens <= len(seq.token_ids)
            self.blocks.commit(seq)
            if seq.num_pending == 0:
                outputs.append(self._advance(seq, tokens[seq], now))
        return outputs

    def _advance(self, seq: Sequence, token: int, now: float) -> StepOutput:
        """Record the sequence's next token and decide whether it finished."""
        req = seq.req
        seq.generated += 1
        self._counters["tokens_generated"] += 1
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.latency.record_first_token(now - seq.arrived)
        seq.last_token_at = now
        if token in seq.stop_ids:
            return self._finish(seq, [], "stop")
        if seq.generated >= req.max_tokens or \
                len(req.prompt_token_ids) + seq.generated >= self.max_seq_len:
            return self._finish(seq, [token], "length")
        seq.token_ids.append(token)
        return StepOutput(req.request_id, [token], False, None,
                          len(req.prompt_token_ids), seq.generated)

    def _finish(self, seq: Sequence, new: list[int], reason: str) -> StepOutput:
        del self._live[seq.request_id]
        seq.done = True
        self.scheduler.remove(seq)  # frees the KV blocks now
        self._counters["requests_finished"] += 1
        self.latency.record_finished(seq.first_token_at, seq.last_token_at, seq.generated)
        return StepOutput(seq.request_id, new, True, reason,
                          len(seq.req.prompt_token_ids), seq.generated)

    # ------------------------------------------------------------ lifecycle

    def stats(self) -> dict:
        blocks = self.blocks
        hit, query = blocks.prefix_hit_tokens, blocks.prefix_query_tokens
        return {
            "queue_depth": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            **self._counters,
            "kv_tokens": sum(s.num_computed_tokens for s in self.scheduler.running),
            "kv_used": blocks.num_used_blocks / blocks.num_blocks,  # blocks in use / pool
            "kv_blocks_used": blocks.num_used_blocks,
            "kv_blocks_total": blocks.num_blocks,
            "kv_blocks_cached": blocks.num_cached_blocks,  # free but holding a reusable prefix
            "kv_block_size": blocks.block_size,
            "kv_cache_dtype": self.kv_cache_dtype,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "prefix_caching": blocks.enable_prefix_caching,
            "prefix_hit_tokens": hit,
            "prefix_query_tokens": query,
            "prefix_hit_rate": hit / query if query else 0.0,
            "preemptions": self.scheduler.preemptions,
            "max_batch_size": self.max_batch_size,
            "max_seq_len": self.max_seq_len,
            **self.latency.snapshot(),
        }

    def shutdown(self) -> None:
        """Drop all requests and refuse further work; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for seq in list(self._live.values()):
            self.scheduler.remove(seq)
        self._live.clear()
        self._aborts.clear()
        if self._events is not None:
            self._events.close()
