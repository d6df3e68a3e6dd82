"""CPU reference engine: the numpy Llama model behind continuous batching
over a paged KV cache.

Scheduling, prefix caching, chunked prefill, preemption, KV events and
stats are ``ContinuousBatchingEngine``'s (read ``continuous.py`` and
``scheduler.py``); this module runs the model on each step's batch: one
ragged forward pass for the prefill chunks, then the decodes in forward
passes of ``decode_batch_size`` sequences. K/V live in a ``PagedKVCache``
(``kv_cache_dtype`` fp16, fp8 or fp32), read and written through each
sequence's block table.

A request's tokens do not depend on what else is in the batch (per-request
RNG, attention per sequence), so greedy output is the same with prefix
caching on or off, chunked prefill on or off, and across preemption (a
preempted sequence is recomputed from prompt + output so far; with an fp32
cache the recomputed K/V are bit-identical up to float summation order).
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from exaserve_hpc.cache.checkpoint import Progress, load_checkpoint
from exaserve_hpc.engine.base import DEFAULT_EOS_IDS, EngineError
from exaserve_hpc.engine.continuous import ContinuousBatchingEngine
from exaserve_hpc.engine.kv_cache import DecodeBatchKV, PagedKVCache, kv_dtype
from exaserve_hpc.engine.model import LlamaModel
from exaserve_hpc.engine.sampling import sample
from exaserve_hpc.engine.batching import ScheduledBatch, Sequence
from exaserve_hpc.engine.tokenizer import ByteTokenizer

WARMUP_PROMPT = "exaserve warm-up"
WARMUP_TOKENS = 4


def warmup_prompt(vocab_size: int) -> list[int]:
    """Ids of a fixed warm-up prompt valid in any vocabulary (what the ids mean does not matter: the
    warm-up checks shapes and finite logits)."""
    return [t % vocab_size for t in ByteTokenizer().encode(WARMUP_PROMPT)]


class ReferenceEngine(ContinuousBatchingEngine):
    """Continuous-batching engine over ``LlamaModel``; see the module docstring.

    Keyword arguments are ``ContinuousBatchingEngine._setup``'s (batching,
    chunked prefill, prefix caching, blocks, KV events, clock) plus
    ``kv_cache_dtype``.
    """

    def __init__(self, model_dir: str | os.PathLike, *, verify: bool = True,
                 progress: Progress | None = None, kv_cache_dtype: str = "fp16",
                 **kwargs) -> None:
        config, weights = load_checkpoint(model_dir, verify=verify, progress=progress)
        self._setup_model(LlamaModel(config, weights), kv_cache_dtype, kwargs)

    @classmethod
    def from_weights(cls, config: dict, weights: dict[str, np.ndarray], *,
                     kv_cache_dtype: str = "fp16", **kwargs) -> ReferenceEngine:
        """An engine over in-memory weights (tests, converted models)."""
        engine = cls.__new__(cls)
        engine._setup_model(LlamaModel(config, weights), kv_cache_dtype, kwargs)
        return engine

    def _setup_model(self, model: LlamaModel, kv_cache_dtype: str, kwargs: dict) -> None:
        kv_dtype(kv_cache_dtype)  # fail before allocating anything
        max_seq_len = kwargs.get("max_seq_len", 2048)
        if isinstance(max_seq_len, int) and max_seq_len > model.max_position:
            raise ValueError(
                f"max_seq_len={max_seq_len} exceeds the model's max_position="
                f"{model.max_position}; lower max_seq_len to at most {model.max_position}"
            )
        kwargs.setdefault("eos_token_ids", tuple(model.config.get("eos_token_ids", DEFAULT_EOS_IDS)))
        self._setup(vocab_size=model.vocab_size, **kwargs)
        self.model = model
        self.kv = PagedKVCache(model.num_layers, model.kv_heads, model.head_dim,
                               self.blocks.num_blocks, self.blocks.block_size, kv_cache_dtype)
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_bytes_per_token = self.kv.bytes_per_token

    def model_identity(self) -> str:
        """What KV blocks depend on besides tokens: a digest of the config and
        every weight as the model runs it (computed once, on first use, so
        engines that never snapshot pay nothing)."""
        if getattr(self, "_model_identity", None) is None:
            m = self.model
            h = hashlib.blake2b(digest_size=16)
            h.update(json.dumps(m.config, sort_keys=True, default=str).encode())
            arrays = [m.embed, m.norm, m.lm_head]
            if m.lm_head_bias is not None:
                arrays.append(m.lm_head_bias)
            for layer in m.layers:
                arrays += [layer.attn_norm, layer.wqkv, layer.wo, layer.mlp_norm,
                           layer.w_gate_up, layer.w_down]
                arrays += [b for b in (layer.bqkv, layer.bo) if b is not None]
            for a in arrays:
                h.update(repr((a.dtype.str, a.shape)).encode())
                h.update(np.ascontiguousarray(a).data)
            self._model_identity = (f"llama L{m.num_layers} H{m.heads}/{m.kv_heads}x{m.head_dim} "
                                    f"V{m.vocab_size} blake2b:{h.hexdigest()}")
        return self._model_identity

    def _execute(self, batch: ScheduledBatch) -> dict[Sequence, int]:
        """Run the batch through the model; sample where a sequence's pending
        tokens are all computed."""
        tokens: dict[Sequence, int] = {}
        if batch.prefills:
            chunks = [(s.token_ids[s.num_computed_tokens:s.num_computed_tokens + n],
                       self.kv.view(s.block_table, s.num_computed_tokens))
                      for s, n in batch.prefills]
            logits = self.model.prefill_batch(chunks)
            for (seq, n), row in zip(batch.prefills, logits):
                if n == seq.num_pending:
                    tokens[seq] = self._sample(seq, row)
        for lo in range(0, len(batch.decodes), self.decode_batch_size):
            group = batch.decodes[lo:lo + self.decode_batch_size]
            views = DecodeBatchKV([self.kv.view(s.block_table, s.num_computed_tokens)
                                   for s in group])
            logits = self.model.decode_tokens([s.token_ids[-1] for s in group], views)
            for seq, row in zip(group, logits):
                tokens[seq] = self._sample(seq, row)
        return tokens

    @staticmethod
    def _sample(seq: Sequence, logits: np.ndarray) -> int:
        return sample(logits, seq.req.temperature, seq.req.top_p, seq.rng)

    # ------------------------------------------------------------ lifecycle

    def warmup(self) -> None:
        """Greedy-generate a few tokens from a fixed prompt through the model
        (prefill and decode paths); EngineError if anything is off."""
        self._check_open()
        n = min(WARMUP_TOKENS, self.max_seq_len - 1)
        prompt = warmup_prompt(self.vocab_size)[: self.max_seq_len - n]
        try:
            # A private pool of the engine's dtype: exercises the paged write/gather path.
            pool = PagedKVCache(self.model.num_layers, self.model.kv_heads, self.model.head_dim,
                                num_blocks=-(-(len(prompt) + n) // self.blocks.block_size),
                                block_size=self.blocks.block_size, dtype=self.kv_cache_dtype)
            cache = pool.view(range(pool.num_blocks), 0)
            logits = self.model.prefill(prompt, cache)
            tokens = []
            for i in range(n):
                if logits.shape != (self.vocab_size,) or not np.all(np.isfinite(logits)):
                    raise EngineError(
                        f"warm-up step {i}: logits have shape {logits.shape} (expected "
                        f"({self.vocab_size},)) or non-finite values; the weights are broken"
                    )
                tokens.append(int(np.argmax(logits)))
                if i < n - 1:
                    logits = self.model.decode([(tokens[-1], cache)])[0]
        except EngineError:
            raise
        except Exception as e:  # any model failure means this replica must not serve
            raise EngineError(f"warm-up inference failed: {e!r}; check the checkpoint") from e
        if len(tokens) != n or not all(0 <= t < self.vocab_size for t in tokens):
            raise EngineError(f"warm-up produced {tokens}, expected {n} ids in 0..{self.vocab_size - 1}")
        if cache.num_tokens != len(prompt) + n - 1:
            raise EngineError(f"warm-up KV cache holds {cache.num_tokens} tokens, "
                              f"expected {len(prompt) + n - 1}")
