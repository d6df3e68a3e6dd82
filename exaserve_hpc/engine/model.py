"""A small Llama-style decoder in numpy (the CPU reference model).

RMSNorm, RoPE (half-split "rotate_half" convention, as Hugging Face Llama;
Llama 3's and linear rope scaling), grouped-query attention, q/k/v and o
projection biases (Qwen2, Llama's attention_bias), SwiGLU MLP, tied or
separate lm_head, optional output bias. It runs the Llama, Mistral and Qwen2
checkpoints of Hugging Face (``cache/hf_format.py`` maps their configs and
names) and the exaserve-llama-v1 tiny ones. All arithmetic is float32
whatever the stored dtype (float32, float16 or bfloat16).

Call protocol:
- ``model = LlamaModel(config, weights)`` with a config/weights pair from
  ``exaserve_hpc.cache.checkpoint.load_checkpoint``.
- Per sequence: ``cache = model.new_cache()``; ``model.prefill(ids, cache)``
  -> logits [vocab] of the last prompt token; then repeatedly
  ``model.decode([(token, cache), ...])`` -> logits [B, vocab], one row per
  sequence. Each call appends the new tokens' keys/values to the caches.
- ``prefill_batch([(ids, cache), ...])`` prefills several sequences in one
  ragged pass (their tokens are concatenated; projections and MLP run as one
  matmul, attention per sequence).

Seams: all KV access goes through ``cache.append`` (``KVCache`` here, the
paged ``kv_cache.SequenceKV`` in the engine). ``_forward`` is
``prepare`` -> ``run_layers`` -> ``logits``, so a pipeline stage runs only
its layers; tensor parallelism (``parallel.py``) splits
``LayerWeights.wqkv``/``w_gate_up`` by columns and ``wo``/``w_down`` by rows
(whole heads per shard) and sets ``reduce`` to an all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from exaserve_hpc.cache.checkpoint import check_weights, head_dim_of, validate_config
from exaserve_hpc.cache.hf_format import rope_inv_freq


class KVCache:
    """Keys and values of one sequence, one growing contiguous array per layer.

    Layout per layer is [kv_heads, capacity, head_dim], so each kv head's
    keys are contiguous for the attention matmul. Capacity doubles as
    needed (amortised O(1) append) up to ``max_tokens``.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, max_tokens: int,
                 initial_capacity: int = 64) -> None:
        self.max_tokens = max_tokens
        cap = min(initial_capacity, max_tokens)
        self._k = [np.empty((kv_heads, cap, head_dim), np.float32) for _ in range(layers)]
        self._v = [np.empty((kv_heads, cap, head_dim), np.float32) for _ in range(layers)]
        self._len = [0] * layers

    @property
    def num_tokens(self) -> int:
        """Tokens held; equal across layers between forward passes."""
        return self._len[-1]

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Append k, v [T, kv_heads, head_dim] to ``layer``; return all keys and
        values of that layer so far as views [kv_heads, tokens, head_dim]."""
        start, n = self._len[layer], k.shape[0]
        end = start + n
        if end > self.max_tokens:
            raise ValueError(
                f"KV cache full: {start} tokens held + {n} new > max {self.max_tokens}; "
                "the engine must finish the sequence at max_seq_len"
            )
        if end > self._k[layer].shape[1]:
            cap = min(max(end, 2 * self._k[layer].shape[1]), self.max_tokens)
            for store in (self._k, self._v):
                grown = np.empty(store[layer].shape[:1] + (cap,) + store[layer].shape[2:], np.float32)
                grown[:, :start] = store[layer][:, :start]
                store[layer] = grown
        self._k[layer][:, start:end] = k.transpose(1, 0, 2)
        self._v[layer][:, start:end] = v.transpose(1, 0, 2)
        self._len[layer] = end
        return self._k[layer][:, :end], self._v[layer][:, :end]


@dataclass(frozen=True)
class RaggedBatch:
    """Token layout of one forward pass over several sequences."""

    flat: np.ndarray       # [tokens] ids, chunk after chunk
    offsets: np.ndarray    # [B + 1] chunk b is flat[offsets[b]:offsets[b + 1]]
    starts: list[int]      # K/V tokens each sequence held before this pass
    cos: np.ndarray        # [tokens, head_dim // 2] RoPE tables at each token's position
    sin: np.ndarray


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer, transposed to [in, out] and fused for fewer matmuls."""

    attn_norm: np.ndarray  # [hidden]
    wqkv: np.ndarray       # [hidden, (heads + 2 * kv_heads) * head_dim]
    wo: np.ndarray         # [heads * head_dim, hidden]
    mlp_norm: np.ndarray   # [hidden]
    w_gate_up: np.ndarray  # [hidden, 2 * intermediate]: gate (w1) then up (w3)
    w_down: np.ndarray     # [intermediate, hidden]
    bqkv: np.ndarray | None = None  # [(heads + 2 * kv_heads) * head_dim]: q, k, v biases (Qwen2)
    bo: np.ndarray | None = None    # [hidden]: o projection bias (Llama's attention_bias)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / rms(x) * weight over the last axis."""
    scale = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * scale * weight


def rope_tables(max_position: int, head_dim: int, theta: float,
                inv_freq: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin tables [max_position, head_dim // 2] (precomputed once per model); ``inv_freq``: the
    frequencies with a rope scaling applied (default: theta's plain ones)."""
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    angles = np.outer(np.arange(max_position, dtype=np.float64), inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate x [T, heads, head_dim] by per-token cos/sin [T, head_dim // 2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)


def attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int) -> np.ndarray:
    """Causal grouped-query attention for one sequence.

    q [T, heads, hd] are the queries at positions start..start+T-1; keys and
    values [kv_heads, start+T, hd]. Query head h uses kv head h // group
    (group = heads // kv_heads). Returns [T, heads, hd].
    """
    t, heads, hd = q.shape
    kv_heads, s, _ = keys.shape
    group = heads // kv_heads
    # [kv_heads, group*T, hd]: the group's query heads share one K/V matmul.
    qg = q.transpose(1, 0, 2).reshape(kv_heads, group * t, hd)
    scores = qg @ keys.transpose(0, 2, 1)
    scores *= np.float32(1.0 / np.sqrt(hd))
    if t > 1:  # decode (t == 1) sees all keys; prefill masks the future among its own T
        tail = scores.reshape(kv_heads, group, t, s)[..., start:start + t]
        tail += np.triu(np.full((t, t), -np.inf, np.float32), 1)
    # Softmax in place: these arrays are the largest of a long prefill.
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = scores @ values  # [kv_heads, group*T, hd]
    return out.reshape(heads, t, hd).transpose(1, 0, 2)


def decode_attention(q: np.ndarray, keys: np.ndarray, values: np.ndarray,
                     lengths: np.ndarray) -> np.ndarray:
    """Attention of one new token per sequence over padded K/V.

    q [B, heads, hd]; keys, values [B, kv_heads, L, hd] where sequence b's
    first ``lengths[b]`` positions are real (its new token last) and the rest
    padding. Returns [B, heads, hd]; same GQA mapping as ``attention``.
    """
    b, heads, hd = q.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    qg = q.reshape(b, kv_heads, heads // kv_heads, hd)
    scores = qg @ keys.transpose(0, 1, 3, 2)          # [B, kv_heads, group, L]
    scores *= np.float32(1.0 / np.sqrt(hd))
    pad = np.arange(length)[None, :] >= lengths[:, None]
    scores += np.where(pad, np.float32(-np.inf), np.float32(0.0))[:, None, None, :]
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return (scores @ values).reshape(b, heads, hd)


class LlamaModel:
    """Llama-style decoder over numpy weights; see the module docstring."""

    def __init__(self, config: dict, weights: dict[str, np.ndarray]) -> None:
        validate_config(config)
        check_weights(config, weights)
        self.config = config
        self.num_layers = config["layers"]
        self.heads, self.kv_heads = config["heads"], config["kv_heads"]
        self.head_dim = head_dim_of(config)
        self.vocab_size = config["vocab_size"]
        self.max_position = config["max_position"]
        self.eps = float(config["norm_eps"])

        def f32(name: str) -> np.ndarray:
            return np.ascontiguousarray(weights[name], dtype=np.float32)

        self.embed = f32("embed")
        self.layers = []
        for n in range(self.num_layers):
            p = f"layers.{n}."
            self.layers.append(LayerWeights(
                attn_norm=f32(p + "attn_norm"),
                wqkv=np.ascontiguousarray(np.concatenate(
                    [f32(p + "attn.wq"), f32(p + "attn.wk"), f32(p + "attn.wv")]).T),
                wo=np.ascontiguousarray(f32(p + "attn.wo").T),
                mlp_norm=f32(p + "mlp_norm"),
                w_gate_up=np.ascontiguousarray(
                    np.concatenate([f32(p + "mlp.w1"), f32(p + "mlp.w3")]).T),
                w_down=np.ascontiguousarray(f32(p + "mlp.w2").T),
                bqkv=np.concatenate([f32(p + "attn.bq"), f32(p + "attn.bk"), f32(p + "attn.bv")])
                if config.get("qkv_bias") else None,
                bo=f32(p + "attn.bo") if config.get("o_bias") else None,
            ))
        self.norm = f32("norm")
        head = self.embed if config.get("tie_embeddings", False) else f32("lm_head")
        self.lm_head = np.ascontiguousarray(head.T)  # [hidden, vocab]
        self.lm_head_bias = f32("lm_head_bias") if "lm_head_bias" in weights else None
        self.cos, self.sin = rope_tables(self.max_position, self.head_dim, float(config["rope_theta"]),
                                         rope_inv_freq(config))

    def new_cache(self, max_tokens: int | None = None) -> KVCache:
        """An empty per-sequence KV cache holding up to ``max_tokens`` (default
        max_position) tokens."""
        limit = self.max_position if max_tokens is None else min(max_tokens, self.max_position)
        return KVCache(self.num_layers, self.kv_heads, self.head_dim, limit)

    def prefill(self, token_ids: Sequence[int], cache: KVCache) -> np.ndarray:
        """Run the prompt (or a continuation chunk) through; logits [vocab] of its last token."""
        return self.prefill_batch([(token_ids, cache)])[0]

    def prefill_batch(self, batch: Sequence[tuple[Sequence[int], KVCache]]) -> np.ndarray:
        """Prefill several sequences in one ragged pass; logits [B, vocab] of
        each sequence's last token."""
        for ids, _ in batch:
            if len(ids) == 0:
                raise ValueError("prefill needs at least one token per sequence")
        return self._forward([list(ids) for ids, _ in batch], [c for _, c in batch])

    def decode(self, batch: Sequence[tuple[int, KVCache]]) -> np.ndarray:
        """One token per sequence (sequences may have different lengths);
        logits [B, vocab]."""
        return self._forward([[tok] for tok, _ in batch], [c for _, c in batch])

    def decode_tokens(self, tokens: Sequence[int], caches: Sequence) -> np.ndarray:
        """``decode`` with the caches as one sequence; a ``kv_cache.DecodeBatchKV``
        there enables batched attention (one padded matmul for the batch)."""
        return self._forward([[t] for t in tokens], caches)

    def _forward(self, chunks: list[list[int]], caches: list[KVCache]) -> np.ndarray:
        """Tokens of all chunks concatenated, run through every layer; returns
        logits of each chunk's last token."""
        batch = self.prepare(chunks, caches)
        return self.logits(self.run_layers(self.embed[batch.flat], batch, caches), batch)

    def prepare(self, chunks: list[list[int]], caches: list[KVCache]) -> RaggedBatch:
        """Validate a ragged batch and lay out its positions."""
        lengths = [len(c) for c in chunks]
        offsets = np.cumsum([0] + lengths)
        starts = [cache.num_tokens for cache in caches]
        if any(s + n > self.max_position for s, n in zip(starts, lengths)):
            raise ValueError(
                f"sequence would exceed max_position={self.max_position} "
                f"(held {starts}, adding {lengths}); finish it earlier"
            )
        flat = np.fromiter((t for c in chunks for t in c), np.int64, int(offsets[-1]))
        if flat.size and (flat.min() < 0 or flat.max() >= self.vocab_size):
            bad = flat[(flat < 0) | (flat >= self.vocab_size)][0]
            raise ValueError(f"token id {bad} is outside the vocabulary 0..{self.vocab_size - 1}")
        positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
        return RaggedBatch(flat, offsets, starts, self.cos[positions], self.sin[positions])

    def run_layers(self, x: np.ndarray, batch: RaggedBatch, caches: list[KVCache]) -> np.ndarray:
        """Hidden states [tokens, hidden] through this model's layers. ``reduce``
        (tensor parallelism) sums the partial outputs of wo and w_down across
        the shards; cache layer ``i`` belongs to ``self.layers[i]``."""
        q_width = self.heads * self.head_dim
        kv_width = self.kv_heads * self.head_dim
        cos, sin, offsets = batch.cos, batch.sin, batch.offsets
        # A paged decode batch (kv_cache.DecodeBatchKV) may take the batched path.
        batched = hasattr(caches, "append_decode") and len(batch.flat) == len(caches) \
            and caches.padded()
        for index, lw in enumerate(self.layers):
            qkv = rms_norm(x, lw.attn_norm, self.eps) @ lw.wqkv
            if lw.bqkv is not None:
                qkv += lw.bqkv
            q = apply_rope(qkv[:, :q_width].reshape(-1, self.heads, self.head_dim), cos, sin)
            k = apply_rope(qkv[:, q_width:q_width + kv_width].reshape(-1, self.kv_heads, self.head_dim),
                           cos, sin)
            v = qkv[:, q_width + kv_width:].reshape(-1, self.kv_heads, self.head_dim)
            if batched:  # one token per sequence: attention as one padded matmul
                keys, values = caches.append_decode(index, k, v)
                out = decode_attention(q, keys, values, caches.lengths)
            else:
                out = np.empty_like(q)
                for b, cache in enumerate(caches):  # attention is per sequence (ragged)
                    lo, hi = offsets[b], offsets[b + 1]
                    keys, values = cache.append(index, k[lo:hi], v[lo:hi])
                    out[lo:hi] = attention(q[lo:hi], keys, values, batch.starts[b])
            x = x + self.reduce(out.reshape(-1, q_width) @ lw.wo)
            if lw.bo is not None:  # added once, after the shards' partial sums
                x += lw.bo
            gate_up = rms_norm(x, lw.mlp_norm, self.eps) @ lw.w_gate_up
            gate, up = np.split(gate_up, 2, axis=-1)
            x = x + self.reduce((gate / (1.0 + np.exp(-gate)) * up) @ lw.w_down)  # SwiGLU
        return x

    def logits(self, x: np.ndarray, batch: RaggedBatch) -> np.ndarray:
        """Logits [B, vocab] of each chunk's last token."""
        last = rms_norm(x[batch.offsets[1:] - 1], self.norm, self.eps)
        logits = last @ self.lm_head
        if self.lm_head_bias is not None:
            logits += self.lm_head_bias
        return logits

    @staticmethod
    def reduce(partial: np.ndarray) -> np.ndarray:
        """Identity on one shard; ``parallel.py`` replaces it with an all-reduce."""
        return partial
