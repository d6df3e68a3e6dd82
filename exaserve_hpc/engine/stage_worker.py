"""The reference engine split into pipeline stages that talk over a ``StageLink`` (stage_link.py).

Stage s holds a contiguous run of layers (``parallel.stage_layers``). Stage 0 is an ordinary
``ReferenceEngine`` over its own layers (scheduler, block manager, prefix cache, sampling: all of
them only there) whose model is wrapped in ``PipelineHead``: each forward pass runs stage 0's
layers, sends the hidden states with the pass's work (token ids, block tables, K/V already held)
down the ring, and takes the logits the last stage sends back. Stages 1.. run ``StageWorker``: each
keeps a ``PagedKVCache`` of its own layers indexed by stage 0's block ids (sized by the "setup"
message stage 0 sends first), and mirrors exactly the computation of one unsplit pass (a decode
batch uses the same batched attention), so a PP replica's greedy tokens equal PP=1's.

Ring messages (header, array): ("setup", pool sizes) once, ("run", work) per forward pass,
("stop") at shutdown; each stage passes them on and the last returns them to stage 0.

Call protocol::

    config, weights = stage_checkpoint(config, weights, stage_layers(layers, pp, s))
    stage 0:  engine = <reference engine over that checkpoint>
              attach_head(engine, link); engine.warmup(); ...; engine.shutdown(); stop_ring(engine)
    stage s:  StageWorker(LlamaModel(config, weights), s, pp, link).serve()
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import numpy as np

from exaserve_hpc.engine.kv_cache import DecodeBatchKV, PagedKVCache
from exaserve_hpc.engine.model import LlamaModel
from exaserve_hpc.engine.stage_link import LinkError, StageLink

log = logging.getLogger("exaserve.pipeline")


def stage_checkpoint(config: dict, weights: dict[str, np.ndarray], layers: range) -> tuple[dict, dict]:
    """A checkpoint of only ``layers`` (renumbered from 0), with the embedding, final norm and
    head that every stage keeps (stage 0 embeds, the last computes logits)."""
    prefix = "layers."
    kept = {name: array for name, array in weights.items() if not name.startswith(prefix)}
    for new, old in enumerate(layers):
        for name, array in weights.items():
            if name.startswith(f"{prefix}{old}."):
                kept[f"{prefix}{new}.{name[len(f'{prefix}{old}.'):]}"] = array
    return {**config, "layers": len(layers)}, kept


def _view_table(view) -> list[int]:
    # kv_cache.SequenceKV keeps its block table private; the other stages need the same block ids.
    return [int(b) for b in view._table]


class PipelineHead:
    """Stage 0's model as its engine sees it: these layers here, the others over ``link``.

    Everything the engine reads besides the forward passes (config, sizes, weights for the
    model identity) is stage 0's model's, by delegation.
    """

    def __init__(self, model: LlamaModel, link: StageLink, size: int, step_timeout: Optional[float] = None):
        self.model, self.link, self.size, self.step_timeout = model, link, size, step_timeout
        self._trip = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def prefill(self, token_ids, cache) -> np.ndarray:
        return self.prefill_batch([(token_ids, cache)])[0]

    def prefill_batch(self, batch) -> np.ndarray:
        if any(len(ids) == 0 for ids, _ in batch):
            raise ValueError("prefill needs at least one token per sequence")
        return self._forward([list(ids) for ids, _ in batch], [c for _, c in batch])

    def decode(self, batch) -> np.ndarray:
        return self._forward([[tok] for tok, _ in batch], [c for _, c in batch])

    def decode_tokens(self, tokens, caches) -> np.ndarray:
        return self._forward([[t] for t in tokens], caches)

    def _forward(self, chunks: list[list[int]], caches) -> np.ndarray:
        batch = self.model.prepare(chunks, caches)
        x = self.model.run_layers(self.model.embed[batch.flat], batch, caches)
        self._trip += 1
        work = {"op": "run", "trip": self._trip, "decode": hasattr(caches, "append_decode"),
                "chunks": [[ids, _view_table(view), start]
                           for ids, view, start in zip(chunks, caches, batch.starts)]}
        return self._round_trip(work, x, "run")

    def _round_trip(self, header: dict, array: np.ndarray, op: str) -> np.ndarray:
        self.link.send(header, np.ascontiguousarray(array, np.float32))
        back, result = self.link.receive(self.step_timeout)
        if back.get("op") != op or back.get("trip") != header.get("trip"):
            raise LinkError(f"stage 0 expected {op} #{header.get('trip')} back from the pipeline, got {back}")
        return result

    def setup(self, num_blocks: int, block_size: int, kv_cache_dtype: str, timeout: float) -> None:
        """Size every stage's KV pool like stage 0's and check the whole ring answers."""
        saved, self.step_timeout = self.step_timeout, timeout
        try:
            self._round_trip({"op": "setup", "trip": 0, "num_blocks": num_blocks, "block_size": block_size,
                              "kv_cache_dtype": kv_cache_dtype}, np.zeros(0, np.float32), "setup")
        finally:
            self.step_timeout = saved

    def stop(self, timeout: float = 5.0) -> None:
        """Tell every stage to exit, waiting at most ``timeout`` for the ring to confirm."""
        try:
            self.link.closing()
            self.link.send({"op": "stop", "trip": -1}, np.zeros(0, np.float32))
            self.link.receive(timeout)
        except LinkError as exc:  # a stage already gone ends anyway
            log.info("pipeline stop: %s", exc)


def attach_head(engine, link: StageLink, size: int, timeout: float, step_timeout: Optional[float] = None
                ) -> PipelineHead:
    """Make a reference engine over stage 0's checkpoint the replica's stage 0; returns its head."""
    head = PipelineHead(engine.model, link, size, step_timeout)
    head.setup(engine.blocks.num_blocks, engine.blocks.block_size, engine.kv_cache_dtype, timeout)
    engine.model = head
    return head


class StageWorker:
    """Stages 1..: run these layers on what arrives, pass the result on (the last: logits to stage 0)."""

    def __init__(self, model: LlamaModel, rank: int, size: int, link: StageLink):
        self.model, self.rank, self.size, self.link = model, rank, size, link
        self.last = rank == size - 1
        self.kv: Optional[PagedKVCache] = None
        self.passes = 0

    def serve(self, first_timeout: Optional[float] = None,
              on_setup: Callable[[], None] = lambda: None) -> None:
        """Until stage 0 says stop. ``first_timeout``: how long to wait for the setup message."""
        timeout = first_timeout
        while True:
            header, array = self.link.receive(timeout)
            op = header.get("op")
            if op == "setup":
                self.kv = PagedKVCache(self.model.num_layers, self.model.kv_heads, self.model.head_dim,
                                       header["num_blocks"], header["block_size"], header["kv_cache_dtype"])
                self.link.send(header, array)
                timeout = None
                on_setup()
            elif op == "run":
                self.link.send(header, self.run(header, array))
                self.passes += 1
            elif op == "stop":
                self.link.closing()  # stage 0 closes its link once the stop is back: that is the plan
                self.link.send(header, array)
                return
            else:
                raise LinkError(f"stage {self.rank}: unknown ring message {header!r}")

    def run(self, work: dict, x: np.ndarray) -> np.ndarray:
        """This stage's layers over one forward pass; the last stage returns the logits."""
        if self.kv is None:
            raise LinkError(f"stage {self.rank}: work arrived before the setup message")
        views = [self.kv.view(table, start) for _, table, start in work["chunks"]]
        caches = DecodeBatchKV(views) if work["decode"] else views  # as stage 0's pass did
        chunks = [ids for ids, _, _ in work["chunks"]]
        batch = self.model.prepare(chunks, caches)
        x = self.model.run_layers(np.array(x, np.float32), batch, caches)
        if self.last:
            return np.ascontiguousarray(self.model.logits(x, batch), np.float32)
        return np.ascontiguousarray(x, np.float32)
