"""Tensor and pipeline parallelism for the reference engine, over MPI.

A replica is ``tp * pp`` ranks of one communicator; rank = stage * tp + shard.

- Tensor parallelism: shard r of a stage holds query heads
  [r*H/tp, (r+1)*H/tp), the kv heads they read, and columns
  [r*I/tp, (r+1)*I/tp) of the MLP; the partial outputs of ``wo`` and
  ``w_down`` are summed by an all-reduce in the stage's TP communicator.
- Pipeline parallelism: stage s holds a contiguous run of layers (the first
  stages take one more when they do not divide); stage 0 embeds, the last
  stage computes logits, hidden states travel between the same shard of
  consecutive stages over an ``MpiStageLink`` (``stage_link.py``: the seam
  the ZeroMQ stages of ``stage_worker.py`` use across nodes too).
- Rank 0 (stage 0, shard 0) leads: it runs ``ParallelReferenceEngine``
  (scheduler, block manager, sampling) and each step broadcasts the work
  (token ids, block tables, K/V already held) to the replica; the last
  stage's shard 0 sends the logits back. Every rank keeps a ``PagedKVCache``
  of its own layers and kv heads indexed by the leader's block ids.

Call protocol::

    engine = start_parallel_engine(model_dir, tp=2, pp=2, **engine_kwargs)

on every rank of the communicator (default ``MPI.COMM_WORLD``, size tp*pp).
Rank 0 gets the engine (drive it like any engine; its ``shutdown()``
releases the others); the other ranks serve inside the call until then and
get None. MPI is only used inside one replica: a replica that loses a rank
is lost as a whole, as on any TP/PP deployment.
"""

from __future__ import annotations

import copy
import os

import msgspec
import numpy as np

from exaserve_hpc.cache.checkpoint import load_checkpoint
from exaserve_hpc.engine.base import EngineError, EngineRequest
from exaserve_hpc.engine.kv_cache import PagedKVCache
from exaserve_hpc.engine.latency_stats import LatencyStats
from exaserve_hpc.engine.model import LayerWeights, LlamaModel
from exaserve_hpc.engine.reference import WARMUP_TOKENS, ReferenceEngine, warmup_prompt
from exaserve_hpc.engine.batching import ScheduledBatch, Sequence
from exaserve_hpc.engine.stage_transports import MpiStageLink

MPI_HINT = "pip install 'exaserve-hpc[mpi]' (and an MPI library, e.g. apt-get install openmpi-bin libopenmpi-dev)"


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    """Layers of pipeline stage ``stage``: contiguous, sizes differ by at most one."""
    if not 1 <= pp <= num_layers:
        raise ValueError(f"pipeline_parallel_size {pp} must be between 1 and the model's "
                         f"{num_layers} layers")
    base, extra = divmod(num_layers, pp)
    lo = stage * base + min(stage, extra)
    return range(lo, lo + base + (stage < extra))


def shard_model(model: LlamaModel, tp: int, shard: int, layers: range) -> LlamaModel:
    """A copy of ``model`` holding only ``layers`` and tensor shard ``shard`` of ``tp``."""
    heads, kv_heads, hd = model.heads, model.kv_heads, model.head_dim
    inter = model.layers[0].w_down.shape[0]
    if heads % tp or kv_heads % tp or inter % tp:
        raise ValueError(f"tensor_parallel_size {tp} must divide heads ({heads}), kv_heads "
                         f"({kv_heads}) and intermediate ({inter})")
    hq, hk, hi = heads // tp, kv_heads // tp, inter // tp
    q = np.arange(shard * hq * hd, (shard + 1) * hq * hd)
    k = heads * hd + np.arange(shard * hk * hd, (shard + 1) * hk * hd)
    v = k + kv_heads * hd
    gate = np.arange(shard * hi, (shard + 1) * hi)
    part = copy.copy(model)
    part.layers = [LayerWeights(
        attn_norm=lw.attn_norm,
        wqkv=np.ascontiguousarray(lw.wqkv[:, np.concatenate([q, k, v])]),
        wo=np.ascontiguousarray(lw.wo[q]),
        mlp_norm=lw.mlp_norm,
        w_gate_up=np.ascontiguousarray(lw.w_gate_up[:, np.concatenate([gate, gate + inter])]),
        w_down=np.ascontiguousarray(lw.w_down[gate]),
        bqkv=None if lw.bqkv is None else np.ascontiguousarray(lw.bqkv[np.concatenate([q, k, v])]),
        bo=lw.bo,
    ) for lw in (model.layers[i] for i in layers)]
    part.num_layers = len(part.layers)
    part.heads, part.kv_heads = hq, hk
    return part


class StageRunner:
    """One rank's part of a forward pass: the step's work arrives by broadcast, hidden states
    and logits by the ring of ``MpiStageLink`` (shard r of stage s -> shard r of s + 1; shard 0
    of the last stage -> rank 0)."""

    def __init__(self, comm, tp_comm, model: LlamaModel, kv: PagedKVCache, tp: int, pp: int):
        from mpi4py import MPI

        self.comm, self.tp, self.pp = comm, tp, pp
        self.stage, self.shard = divmod(comm.rank, tp)
        self.model, self.kv = model, kv
        if tp > 1:
            def allreduce(partial: np.ndarray) -> np.ndarray:
                buf = np.ascontiguousarray(partial)
                tp_comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
                return buf
            model.reduce = allreduce
        last = self.stage == pp - 1
        next_rank = comm.rank + tp if not last else (0 if self.shard == 0 and comm.rank != 0 else None)
        prev_rank = comm.rank - tp if self.stage > 0 else ((pp - 1) * tp if comm.rank == 0 and pp > 1 else None)
        self.link = MpiStageLink(comm, next_rank, prev_rank)

    def broadcast(self, work: list | None) -> list | None:
        """Leader: send the step's work (None = stop); others: receive it."""
        payload = msgspec.msgpack.encode(work) if self.comm.rank == 0 else None
        return msgspec.msgpack.decode(self.comm.bcast(payload, root=0))

    def run(self, work: list) -> np.ndarray | None:
        """This rank's layers over [token ids, block table, start] chunks; the
        leader returns the logits [chunks, vocab], other ranks None."""
        caches = [self.kv.view(table, start) for _, table, start in work]
        batch = self.model.prepare([ids for ids, _, _ in work], caches)
        # The work came by broadcast: the ring's headers carry nothing.
        x = self.model.embed[batch.flat] if self.stage == 0 else self.link.receive()[1]
        x = self.model.run_layers(x, batch, caches)
        if self.stage < self.pp - 1:
            self.link.send(None, np.ascontiguousarray(x, np.float32))
            logits = None
        else:
            logits = np.ascontiguousarray(self.model.logits(x, batch), np.float32)
        if self.comm.rank == 0:
            return logits if logits is not None else self.link.receive()[1]
        if self.link.next_rank == 0:  # shard 0 of the last stage
            self.link.send(None, logits)
        return None

    def serve(self) -> None:
        """Worker ranks: run steps until the leader says stop."""
        while (work := self.broadcast(None)) is not None:
            self.run(work)


class ParallelReferenceEngine(ReferenceEngine):
    """The leader's engine: ``ReferenceEngine`` whose forward passes span the replica."""

    runner: StageRunner

    def _execute(self, batch: ScheduledBatch) -> dict[Sequence, int]:
        chunks = batch.chunks()
        work = [[s.token_ids[s.num_computed_tokens:s.num_computed_tokens + n], s.block_table,
                 s.num_computed_tokens] for s, n in chunks]
        self.runner.broadcast(work)
        logits = self.runner.run(work)
        return {s: self._sample(s, row) for (s, n), row in zip(chunks, logits)
                if n == s.num_pending}

    def warmup(self) -> None:
        """A short greedy request through every rank; counters are reset after."""
        self._check_open()
        prompt = warmup_prompt(self.vocab_size)
        self.add_request(EngineRequest("__warmup__", prompt, WARMUP_TOKENS, stop_token_ids=()))
        tokens = []
        try:
            while self.has_unfinished():
                tokens += [t for out in self.step() for t in out.new_token_ids]
        except Exception as e:
            raise EngineError(f"parallel warm-up failed: {e!r}; check every rank's log") from e
        if len(tokens) != WARMUP_TOKENS or not all(0 <= t < self.vocab_size for t in tokens):
            raise EngineError(f"parallel warm-up produced {tokens}, expected {WARMUP_TOKENS} ids")
        self._counters = dict.fromkeys(self._counters, 0)
        self.latency = LatencyStats()

    def shutdown(self) -> None:
        if not self._closed:
            self.runner.broadcast(None)
        super().shutdown()


def start_parallel_engine(model_dir: str | os.PathLike | None = None, *, tp: int = 1, pp: int = 1,
                          comm=None, loaded: tuple[dict, dict] | None = None,
                          kv_cache_dtype: str = "fp16", **kwargs) -> ParallelReferenceEngine | None:
    """Build a TP x PP replica on every rank; see the module docstring.
    ``loaded`` = (config, weights) instead of ``model_dir`` for tests."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise EngineError(f"tensor/pipeline parallelism needs mpi4py: {MPI_HINT}") from e
    comm = comm if comm is not None else MPI.COMM_WORLD
    if comm.size != tp * pp:
        raise ValueError(f"the communicator has {comm.size} ranks but tp={tp} x pp={pp} = "
                         f"{tp * pp}; start it with mpirun -n {tp * pp}")
    config, weights = loaded if loaded is not None else load_checkpoint(model_dir)
    stage, shard = divmod(comm.rank, tp)
    full = LlamaModel(config, weights)
    model = shard_model(full, tp, shard, stage_layers(full.num_layers, pp, stage))
    tp_comm = comm.Split(color=stage, key=shard)
    block_size = kwargs.setdefault("block_size", 16)
    kwargs.setdefault("num_kv_blocks", -(-kwargs.get("max_batch_size", 32)
                                         * kwargs.get("max_seq_len", 2048) // block_size))
    if comm.rank == 0:
        engine = ParallelReferenceEngine.__new__(ParallelReferenceEngine)
        engine._setup_model(model, kv_cache_dtype, kwargs)
        engine.runner = StageRunner(comm, tp_comm, model, engine.kv, tp, pp)
        return engine
    kv = PagedKVCache(model.num_layers, model.kv_heads, model.head_dim,
                      kwargs["num_kv_blocks"], block_size, kv_cache_dtype)
    StageRunner(comm, tp_comm, model, kv, tp, pp).serve()
    return None
