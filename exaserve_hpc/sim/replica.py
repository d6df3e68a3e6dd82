"""A replica for the simulator: the timing engine's cost model, stepped in segments instead of batches.

`engine/timing.py`'s TimingEngine runs the reference scheduler and block manager for every step: right
for 16 replicas, too slow for 3,072 (a busy replica takes ~100 steps a simulated second). This model
keeps what the fleet-level results depend on and charges every step with the same `GpuTimings.seconds`
formula (step overhead, prefill tokens and attention pairs, decoding sequences, K/V read):
- continuous batching: at most `max_batch` sequences; a step prefills chunks of the admitted prompts
  (`chunk_tokens` a prompt, `step_tokens` a step, like vLLM's chunked prefill) beside one token for
  every decoding sequence;
- a per-step token budget (`step_tokens`) that the decoding sequences take first, one token each, and the
  prompts in prefill share first come first served, at most `chunk_tokens` each: vLLM's
  max_num_batched_tokens (vllm/core/scheduler.py, decodes scheduled before prefill chunks) and TensorRT-LLM's
  max_num_tokens with chunked context (engine/trtllm_backend.py maps the site's chunk to chunk + max batch);
- KV capacity in tokens: a request is admitted when its prompt + max_tokens fit beside the admitted ones
  (reserved up front, as TensorRT-LLM's default GUARANTEED_NO_EVICT capacity scheduler does: no
  preemption), else it waits;
- a prefix cache of workload blocks: a prompt's blocks enter it when its prefill ends (as vLLM and
  TensorRT-LLM register a block once its K/V is computed, not when the request ends), held there while any
  running sequence uses them and evicted least recently used from the KV space no admitted request
  holds; an admitted prompt computes only the blocks after its longest cached prefix;
- GPUs shared by several replicas (gpu_memory_utilization < 1): a step takes as many times longer as
  there are busy replicas on its GPU when it starts (`SharedGpus`);
- `slow`: a multiplier on every step (a slow node);
- with precise prefix routing, the blocks its cache stores and evicts (`kv_log`), which the simulation
  publishes to every router as an engine's KV events.
Steps with only decodes are taken in one segment up to the next sequence that finishes (closed form),
at most `progress_every` seconds long; a request arriving meanwhile cuts the segment at the next step
boundary. Events: a first token (end of the prompt's last prefill step), a finish, each stamped with its
step's end, and every `progress_every` seconds the tokens each decoding sequence made since it last
reported: a real replica streams a chunk every few tens of milliseconds, and the router takes a stream
silent for `router.stall_timeout` (60 s) as a stalled replica and moves the request, so a long decode
that reported only its first and last token would look stalled.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from exaserve_hpc.engine.timing import GpuTimings, StepSample


@dataclass(eq=False)
class SimSeq:
    request_id: str
    prompt: int  # tokens
    max_tokens: int
    blocks: tuple  # workload block ids of the prompt (prefix identity)
    todo: int = 0  # prompt tokens still to compute
    done: int = 0  # prompt tokens computed or cached
    finish_at: int = 0  # decode step count at which it ends
    reserved: int = 0  # KV tokens held
    aborted: bool = False
    sent: int = 0  # output tokens reported so far (the first token, then progress)
    progress: int = 0  # tokens in the latest progress report
    pins: int = 0  # leading blocks of `blocks` it holds pinned in the cache


@dataclass
class SharedGpus:
    """Busy replicas per GPU (node, index) and the work done, for contention and utilisation."""
    busy: dict = field(default_factory=dict)
    work_s: float = 0.0  # GPU-seconds of uncontended step work (a step's seconds x its GPUs)
    # the same weighted by how full each step's batch was (sequences / max_batch): busy time counts a step
    # of one sequence as fully as one of a full batch; this does not
    slot_s: float = 0.0

    def factor(self, gpus: tuple) -> int:
        if len(gpus) == 1:  # most replicas: no generator
            return self.busy.get(gpus[0], 0) or 1
        return max((self.busy.get(g, 0) for g in gpus), default=1) or 1

    def mark(self, gpus: tuple, delta: int) -> None:
        for g in gpus:
            self.busy[g] = self.busy.get(g, 0) + delta


class SimReplica:
    def __init__(self, replica_id: str, model: str, timings: GpuTimings, *, max_batch: int, kv_tokens: int,
                 block_tokens: int, chunk_tokens: int, step_tokens: int, gpus: tuple, shared: SharedGpus,
                 slow: float = 1.0, progress_every: float = 10.0):
        self.replica_id, self.model, self.t = replica_id, model, timings
        self.max_batch, self.kv_tokens, self.block = max_batch, max(1, kv_tokens), block_tokens
        self.chunk, self.step_tokens = chunk_tokens, step_tokens
        self.gpus, self.shared, self.slow = gpus, shared, slow
        self.progress_every = progress_every
        self.last_progress = 0.0
        # what a real replica reports (agent/replica_main.py): an EWMA of its step time, which the router's
        # cost weighs (a slow node's replicas cost more); here per segment, weighted by its steps
        self.latency_ewma_ms = 0.0
        self.waiting: deque[SimSeq] = deque()
        self.prefilling: list[SimSeq] = []
        self.decoding: list[tuple[int, int, SimSeq]] = []  # heap (finish_at, n, seq)
        self.n_decoding = 0
        self.ctx = 0  # K/V tokens the decoding sequences attend to
        self.steps = 0  # decode steps taken
        self.used = 0  # KV tokens reserved
        self.cache: OrderedDict = OrderedDict()  # block id -> None, LRU first
        self.pinned: dict = {}  # cached block id -> running sequences using it (not evictable while > 0)
        self.by_id: dict[str, SimSeq] = {}
        self.busy_until = 0.0
        self.busy = False
        self._seg: tuple = ()  # the segment in flight: (start, end, kind, steps)
        self.version = 0  # bumps when the wake time changes (stale heap entries are skipped)
        self.hit_tokens = self.query_tokens = 0
        self.finished = 0
        self.alive = True
        self.draining_until = None  # set when its agent is asked to stop it
        # precise prefix routing: what the cache stored and evicted since the routers last heard, as an engine
        # publishes its KV events (("stored" | "removed", block ids)); None when no router follows them
        self.kv_log: list | None = None
        self._n = 0

    # ---------------------------------------------------------------- requests

    def add(self, seq: SimSeq, now: float) -> bool:
        """Queue a request; True when the caller must (re)schedule this replica's wake at `self.busy_until`."""
        self.by_id[seq.request_id] = seq
        self.waiting.append(seq)
        if not self.busy:
            return self._start(now)
        seg_start, seg_end, kind, steps, base, full = self._seg
        if kind == "decode" and steps > 1 and self._admissible():
            # cut the decode segment at the next step boundary so the prompt starts there
            per = (seg_end - seg_start) / steps
            done = min(steps, max(1, int((now - seg_start) / per) + 1))
            if done < steps:
                cut = base * (1 - done / steps) * len(self.gpus)  # charged again when re-planned
                self.shared.work_s -= cut
                self.shared.slot_s -= cut * full
                self._seg = (seg_start, seg_start + done * per, kind, done, base * done / steps, full)
                self.busy_until = seg_start + done * per
                self.version += 1
                return True
        return False

    def abort(self, request_id: str) -> None:
        seq = self.by_id.pop(request_id, None)
        if seq is None or seq.aborted:
            return
        seq.aborted = True
        if seq in self.waiting:
            self.waiting.remove(seq)
            return
        self.used -= seq.reserved
        self._unpin(seq)
        if seq in self.prefilling:
            self.prefilling.remove(seq)
        else:
            self.n_decoding -= 1
            self.ctx -= seq.prompt + (seq.max_tokens - (seq.finish_at - self.steps))

    def load(self) -> int:
        return len(self.waiting) + len(self.prefilling) + self.n_decoding

    # ---------------------------------------------------------------- stepping

    def _admissible(self) -> bool:
        if not self.waiting:
            return False
        head = self.waiting[0]
        running = len(self.prefilling) + self.n_decoding
        need = head.prompt + head.max_tokens
        return running < self.max_batch and (self.used + need <= self.kv_tokens or running == 0)

    def _admit(self) -> None:
        while self._admissible():
            seq = self.waiting.popleft()
            seq.reserved = seq.prompt + seq.max_tokens
            self.used += seq.reserved
            hit, pinned = 0, self.pinned
            for b in seq.blocks:
                if b not in self.cache:
                    break
                self.cache.move_to_end(b)
                pinned[b] = pinned.get(b, 0) + 1
                hit += 1
            seq.pins = hit
            cached = min(hit * self.block, seq.prompt - 1)
            self.hit_tokens += max(0, cached)
            self.query_tokens += seq.prompt
            seq.done, seq.todo = max(0, cached), seq.prompt - max(0, cached)
            self.prefilling.append(seq)

    def _start(self, now: float) -> bool:
        """Plan the next segment from `now`; False when there is nothing to do (idle)."""
        self._admit()
        if self.prefilling:
            budget, tokens, pairs = self._prefill_budget(), 0, 0
            for seq in self.prefilling:
                n = min(seq.todo, self.chunk, budget)
                if n <= 0:
                    break
                tokens += n
                pairs += n * seq.done + n * (n + 1) // 2
                budget -= n
            base = self.t.seconds(StepSample(tokens, pairs, self.n_decoding, self.ctx + self.n_decoding))
            kind, steps = "prefill", 1
        elif self.n_decoding:
            while self.decoding and self.decoding[0][2].aborted:
                heapq.heappop(self.decoding)
            k = max(1, self.decoding[0][0] - self.steps)
            n, t = self.n_decoding, self.t
            step = (t.step_overhead_s + t.decode_per_seq_s * n + t.kv_read_per_token_s * (self.ctx + n)) \
                * self.shared.factor(self.gpus) * self.slow
            if k * step > self.progress_every:  # a segment no longer than a progress period
                k = max(1, int(self.progress_every / step))
            base = (k * (t.step_overhead_s + t.decode_per_seq_s * n + t.kv_read_per_token_s * (self.ctx + n))
                    + t.kv_read_per_token_s * n * k * (k - 1) / 2)
            kind, steps = "decode", k
        else:
            if self.busy:
                self.busy = False
                self.shared.mark(self.gpus, -1)
            self._seg = ()
            return False
        if not self.busy:
            self.busy = True
            self.shared.mark(self.gpus, 1)
        full = min(1.0, (len(self.prefilling) + self.n_decoding) / self.max_batch)
        self.shared.work_s += base * len(self.gpus)
        self.shared.slot_s += base * len(self.gpus) * full
        seconds = base * self.shared.factor(self.gpus) * self.slow
        self._seg = (now, now + seconds, kind, steps, base, full)
        keep = 0.9 ** steps if self.latency_ewma_ms else 0.0
        self.latency_ewma_ms = keep * self.latency_ewma_ms + (1 - keep) * 1000 * seconds / steps
        self.busy_until = now + seconds
        self.version += 1
        return True

    def wake(self, now: float) -> list[tuple[str, SimSeq]]:
        """The segment in flight ended at `now` (== busy_until): its effects, then the next segment planned.
        Returns [("first" | "done", seq)]; the caller reschedules at busy_until while `busy`."""
        if not self._seg:
            return []
        kind, steps = self._seg[2], self._seg[3]
        decoding_before = self.n_decoding  # the budget this segment was planned with
        out: list[tuple[str, SimSeq]] = []
        # every sequence decoding before this segment gained `steps` tokens
        self.steps += steps
        self.ctx += self.n_decoding * steps
        while self.decoding and self.decoding[0][0] <= self.steps:
            _, _, seq = heapq.heappop(self.decoding)
            if seq.aborted:
                continue
            self.n_decoding -= 1
            self.ctx -= seq.prompt + seq.max_tokens
            self._finish(seq, out)
        if kind == "prefill":
            budget = self._prefill_budget(decoding_before)
            still = []
            for seq in self.prefilling:
                n = max(0, min(seq.todo, self.chunk, budget))
                budget -= n
                seq.todo -= n
                seq.done += n
                if seq.todo > 0:
                    still.append(seq)
                    continue
                out.append(("first", seq))
                seq.sent = 1
                self._store(seq)  # its K/V is computed: later prompts reuse it from now on
                if seq.max_tokens <= 1:
                    self._finish(seq, out)
                else:  # its first token came from the prefill; max_tokens - 1 decode steps to go
                    seq.finish_at = self.steps + seq.max_tokens - 1
                    self._n += 1
                    heapq.heappush(self.decoding, (seq.finish_at, self._n, seq))
                    self.n_decoding += 1
                    self.ctx += seq.prompt + 1
            self.prefilling = still
        if self.n_decoding and now - self.last_progress >= self.progress_every:
            self.last_progress = now
            for finish_at, _, seq in self.decoding:
                made = seq.max_tokens - (finish_at - self.steps)  # the first token, then one a decode step
                if not seq.aborted and made > seq.sent:
                    seq.progress, seq.sent = made - seq.sent, made
                    out.append(("progress", seq))
        self._start(now)
        return out

    def _prefill_budget(self, decoding: int | None = None) -> int:
        """Prompt tokens a step may compute: the step's budget less one token per decoding sequence (at least 1)."""
        left = self.step_tokens - (self.n_decoding if decoding is None else decoding)
        return left if left > 1 else 1

    def _store(self, seq: SimSeq) -> None:
        """The prompt's blocks enter the cache, pinned while the sequence runs; the LRU makes room."""
        cache, pinned, stored = self.cache, self.pinned, []
        for b in seq.blocks[seq.pins:]:
            if b in cache:
                cache.move_to_end(b)
            else:
                cache[b] = None
                stored.append(b)
            pinned[b] = pinned.get(b, 0) + 1
        seq.pins = len(seq.blocks)
        if stored and self.kv_log is not None:
            self.kv_log.append(("stored", stored))
        self._evict()

    def _unpin(self, seq: SimSeq) -> None:
        pinned = self.pinned
        for b in seq.blocks[:seq.pins]:
            n = pinned.get(b, 0) - 1
            if n > 0:
                pinned[b] = n
            else:
                pinned.pop(b, None)
        seq.pins = 0

    def _evict(self) -> None:
        """Least recently used unpinned blocks leave until the cache fits the KV space no admitted request
        holds (plus the blocks running sequences use, which are theirs)."""
        cache, pinned = self.cache, self.pinned
        room = max(0, (self.kv_tokens - self.used) // self.block) + len(pinned)
        removed, skipped = [], []
        while len(cache) > room:
            b = cache.popitem(last=False)[0]
            if b in pinned:
                skipped.append(b)
                if len(skipped) > len(pinned):
                    break
                continue
            removed.append(b)
        for b in reversed(skipped):  # back at the old end, in their order
            cache[b] = None
            cache.move_to_end(b, last=False)
        if removed and self.kv_log is not None:
            self.kv_log.append(("removed", removed))

    def _finish(self, seq: SimSeq, out: list) -> None:
        self.used -= seq.reserved
        self.by_id.pop(seq.request_id, None)
        self.finished += 1
        out.append(("done", seq))
        self._unpin(seq)
        self._evict()

    def drop_all(self) -> list[str]:
        """The node died: everything it held is gone (the router finds out by itself)."""
        ids = list(self.by_id)
        self.by_id.clear()
        self.waiting.clear()
        self.prefilling.clear()
        self.decoding.clear()
        self.n_decoding = self.ctx = self.used = 0
        self.pinned.clear()
        if self.busy:
            self.shared.mark(self.gpus, -1)
        self.busy, self.alive, self._seg = False, False, ()
        self.version += 1
        return ids
