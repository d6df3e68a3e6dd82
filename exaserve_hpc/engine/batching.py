"""Continuous-batching scheduler: who computes which tokens in the next step.

No tensors and no clock reads (the engine passes ``now``): the reference
engine and the timing-model engine share it, with one ``BlockManager``.

Every running sequence has *pending* tokens, ``token_ids[num_computed:]``:
the prompt (or what remains of it) before its first token, then the one
token sampled last step. A step computes some pending tokens of each
running sequence; one whose pending tokens are all computed samples its next
token. So a decode is a 1-token chunk, and a preempted sequence is
recomputed by prefilling prompt + output so far.

``schedule(now)``, in order:

1. decodes: every running sequence with one pending token, oldest first,
   at most ``max_batch_size``. If the pool has no block for its next token,
   the newest running sequence is preempted (blocks freed, sequence back at
   the head of the queue, recomputed later) until it has one;
2. continuing prefills: running sequences part-way through their prompt
   (chunked prefill) take their next chunk;
3. admission: waiting sequences in arrival order while fewer than
   ``max_batch_size`` run, at most ``prefill_batch_size`` per step, and only
   while the pool can hold all their tokens (``can_allocate``); cached
   prefix blocks are shared and their tokens skipped. An idle engine holds a
   small queue until the oldest has waited ``max_wait_ms`` (batching window).

With ``chunked_prefill`` a sequence computes at most
``prefill_chunk_tokens`` per step, so a long prompt is spread over several
steps and short requests admitted meanwhile get their first token without
waiting for all of it.

``max_num_batched_tokens`` (None: no limit, the reference engine's default)
is vLLM's per-step token budget: decodes take one token each first, then
the continuing prefills in admission order and the admissions take chunks
from what is left (a chunk is cut to the budget; a sequence that finds none
left waits for the next step). So prompts queue behind the prefill work
ahead of them, first come first served, as in vLLM's and TensorRT-LLM's
schedulers.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from exaserve_hpc.engine.base import EngineRequest
from exaserve_hpc.engine.block_manager import BlockManager


@dataclass(eq=False)
class Sequence:
    """A request in flight (the ``BlockSequence`` the block manager works on)."""

    req: EngineRequest
    arrived: float
    token_ids: list[int]                      # prompt, then generated tokens (stop token excluded)
    stop_ids: frozenset[int] = frozenset()
    rng: np.random.Generator | None = None
    generated: int = 0                        # completion tokens so far (stop token included)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_committed_blocks: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    done: bool = False                        # finished or aborted; ignore late results

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens


@dataclass
class ScheduledBatch:
    """One step's work."""

    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens now)
    decodes: list[Sequence] = field(default_factory=list)               # one token each
    preempted: list[Sequence] = field(default_factory=list)             # sent back to the queue
    admitted: list[Sequence] = field(default_factory=list)              # newly running
    prefix_hit_tokens: int = 0                                          # skipped on admission

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefills)

    def chunks(self) -> list[tuple[Sequence, int]]:
        """Every (sequence, tokens) of the step, decodes first."""
        return [(s, 1) for s in self.decodes] + self.prefills


@dataclass
class StepLimits:
    max_batch_size: int = 32
    max_wait_ms: float = 50.0
    prefill_batch_size: int = 8
    chunked_prefill: bool = True
    prefill_chunk_tokens: int = 512
    max_num_batched_tokens: int | None = None  # tokens a step computes at most (see the module docstring)

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "prefill_batch_size", "prefill_chunk_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")
        budget = self.max_num_batched_tokens
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or
                                   budget < self.max_batch_size):
            raise ValueError(f"max_num_batched_tokens must be None or an integer >= max_batch_size "
                             f"({self.max_batch_size}: every running sequence may decode), got {budget!r}")


class Scheduler:
    """Waiting queue, running list and the block manager; see the module docstring."""

    def __init__(self, config: StepLimits, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []     # admission order, oldest first
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
            self.blocks.deallocate(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.blocks.deallocate(seq)
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
        self.preemptions += 1

    def _chunk(self, seq: Sequence, budget: float = float("inf")) -> int:
        if self.config.chunked_prefill:
            return int(min(seq.num_pending, self.config.prefill_chunk_tokens, budget))
        return seq.num_pending  # unchunked: a prompt is computed whole (the budget only stops admissions)

    def schedule(self, now: float) -> ScheduledBatch:
        if self.config.max_num_batched_tokens is not None:
            return self._schedule_budget(now, self.config.max_num_batched_tokens)
        batch = self._decodes_only()                         # 1. decodes
        batch.prefills = [(s, self._chunk(s)) for s in self.running   # 2. continuing prefills
                          if s.num_pending > 1]
        if batch.preempted:
            return batch  # the pool is short: admit nothing new this step
        for seq in self._admit(now):                         # 3. admission
            batch.admitted.append(seq)
            batch.prefix_hit_tokens += seq.num_computed_tokens
            batch.prefills.append((seq, self._chunk(seq)))
        return batch

    def _schedule_budget(self, now: float, budget: int) -> ScheduledBatch:
        """`schedule` under a per-step token budget: decodes, then prefill chunks, first come first served."""
        batch = self._decodes_only()
        left = budget - len(batch.decodes)
        for s in self.running:                               # 2. continuing prefills, oldest first
            if s.num_pending > 1 and left > 0:
                n = self._chunk(s, left)
                if n:
                    batch.prefills.append((s, n))
                    left -= n
        if batch.preempted or left <= 0:
            return batch
        for seq in self._admit(now, left):                   # 3. admission while budget remains
            batch.admitted.append(seq)
            batch.prefix_hit_tokens += seq.num_computed_tokens
            n = self._chunk(seq, left)
            batch.prefills.append((seq, n))
            left -= n
        return batch

    def _decodes_only(self) -> ScheduledBatch:
        """Step 1: every decode, preempting the newest running sequences while the pool is short."""
        batch = ScheduledBatch()
        for seq in list(self.running):
            if seq not in self.running or seq.num_pending != 1:
                continue
            while not self.blocks.can_append(seq):
                self._preempt(self.running[-1], batch)
                if seq not in self.running:
                    break
            else:
                self.blocks.may_append(seq)
                batch.decodes.append(seq)
        batch.decodes = [s for s in batch.decodes if s in self.running]
        return batch

    def _admit(self, now: float, budget: float = float("inf")) -> list[Sequence]:
        cfg = self.config
        room = min(cfg.max_batch_size - len(self.running), cfg.prefill_batch_size)
        if room <= 0 or not self.waiting:
            return []
        if not self.running and len(self.waiting) < cfg.prefill_batch_size and \
                (now - self.waiting[0].arrived) * 1000.0 < cfg.max_wait_ms:
            return []  # idle engine: hold briefly so a burst prefills as one batch
        admitted = []
        while self.waiting and len(admitted) < room and budget > 0 and self.blocks.can_allocate(self.waiting[0]):
            seq = self.waiting.popleft()
            self.blocks.allocate(seq)
            budget -= self._chunk(seq, budget)
            self.running.append(seq)
            admitted.append(seq)
        return admitted
