"""The paged KV pool: K and V of every sequence, in fixed-size blocks.

One array per K and V, laid out [layers, kv_heads, num_blocks, block_size,
head_dim], so gathering a sequence's blocks of one layer gives
[kv_heads, blocks, block_size, head_dim] which reshapes (no transpose) into
the [kv_heads, tokens, head_dim] the attention matmul wants.

Storage dtype: ``fp16`` (default), ``fp8`` (float8 e4m3fn through ml-dtypes:
half the bytes; values are clipped to +-448, the format's range, since e4m3fn
has no infinity), or ``fp32`` (exact; reference tests only). Attention always
runs in float32 on the gathered values.

Call protocol: ``pool = PagedKVCache(...)``; per sequence and forward pass,
``pool.view(block_table, num_computed_tokens)`` gives an object with the
model's cache seam (``num_tokens``, ``append(layer, k, v)``). Block ids come
from ``BlockManager``; the view only writes positions its table covers.
"""

from __future__ import annotations

from collections.abc import Sequence

import ml_dtypes
import numpy as np

KV_DTYPES = {"fp32": np.dtype(np.float32), "fp16": np.dtype(np.float16),
             "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}
FP8_MAX = 448.0


def kv_dtype(name: str) -> np.dtype:
    try:
        return KV_DTYPES[name]
    except KeyError:
        raise ValueError(f"kv_cache_dtype {name!r} is not supported; choose one of "
                         f"{', '.join(KV_DTYPES)}") from None


class PagedKVCache:
    """Preallocated K/V blocks for every layer; see the module docstring."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: str = "fp16") -> None:
        self.dtype_name = dtype
        self.dtype = kv_dtype(dtype)
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (layers, kv_heads, num_blocks, block_size, head_dim)
        # np.zeros: pages are only touched (resident) when a block is first written.
        self.k = np.zeros(shape, self.dtype)
        self.v = np.zeros(shape, self.dtype)

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        layers, kv_heads, _, _, head_dim = self.k.shape
        return 2 * layers * kv_heads * head_dim * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def encode(self, x: np.ndarray) -> np.ndarray:
        if self.dtype_name == "fp8":
            x = np.clip(x, -FP8_MAX, FP8_MAX)
        return x.astype(self.dtype, copy=False)

    def view(self, block_table: Sequence[int], num_tokens: int) -> SequenceKV:
        return SequenceKV(self, block_table, num_tokens)

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """One block's K (or V) over all layers: [layers, kv_heads, block_size, head_dim]."""
        layers, kv_heads, _, block_size, head_dim = self.k.shape
        return layers, kv_heads, block_size, head_dim

    def read_blocks(self, block_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Copies of K and V of these blocks, [n, *block_shape], storage dtype."""
        ids = np.asarray(block_ids, dtype=np.intp)
        return (np.ascontiguousarray(self.k[:, :, ids].transpose(2, 0, 1, 3, 4)),
                np.ascontiguousarray(self.v[:, :, ids].transpose(2, 0, 1, 3, 4)))

    def write_blocks(self, block_ids: Sequence[int], k: np.ndarray, v: np.ndarray) -> None:
        """Overwrite these blocks with K and V as ``read_blocks`` returns them."""
        ids = np.asarray(block_ids, dtype=np.intp)
        want = (len(ids), *self.block_shape)
        if k.shape != want or v.shape != want or k.dtype != self.dtype or v.dtype != self.dtype:
            raise ValueError(f"KV blocks of shape {k.shape}/{v.shape} and dtype {k.dtype}/{v.dtype} "
                             f"do not fit this pool: expected {want} {self.dtype}")
        self.k[:, :, ids] = k.transpose(1, 2, 0, 3, 4)
        self.v[:, :, ids] = v.transpose(1, 2, 0, 3, 4)


class SequenceKV:
    """One sequence's window on the pool, for one forward pass: the model's
    cache seam (``num_tokens`` and ``append``), as ``model.KVCache`` offers."""

    def __init__(self, pool: PagedKVCache, block_table: Sequence[int], num_tokens: int) -> None:
        self._pool = pool
        self._table = np.asarray(block_table, dtype=np.intp)
        self._len = [num_tokens] * pool.k.shape[0]

    @property
    def num_tokens(self) -> int:
        return self._len[-1]

    @property
    def max_tokens(self) -> int:
        return len(self._table) * self._pool.block_size

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write k, v [T, kv_heads, head_dim] after the tokens held; return all
        keys and values of ``layer`` as float32 [kv_heads, tokens, head_dim]."""
        start, end = self._len[layer], self._len[layer] + k.shape[0]
        if end > self.max_tokens:
            raise ValueError(
                f"paged KV cache: {start} tokens held + {k.shape[0]} new > {self.max_tokens} "
                f"covered by {len(self._table)} blocks; the block manager must allocate first"
            )
        bs = self._pool.block_size
        positions = np.arange(start, end)
        blocks, offsets = self._table[positions // bs], positions % bs
        pk, pv = self._pool.k[layer], self._pool.v[layer]
        pk[:, blocks, offsets] = self._pool.encode(k.transpose(1, 0, 2))
        pv[:, blocks, offsets] = self._pool.encode(v.transpose(1, 0, 2))
        self._len[layer] = end
        used = self._table[:-(-end // bs)]
        shape = (pk.shape[0], len(used) * bs, pk.shape[-1])
        keys = pk[:, used].reshape(shape)[:, :end].astype(np.float32)
        values = pv[:, used].reshape(shape)[:, :end].astype(np.float32)
        return keys, values


class DecodeBatchKV(list):
    """The views of a decode batch (one new token per sequence), with a batched
    path: ``append_decode`` writes every sequence's token and gathers all
    their K/V padded to the longest, so attention is one matmul for the batch
    instead of one per sequence. Used by the model only when ``padded()``
    (the padding costs at most as much as the useful tokens)."""

    def __init__(self, views: list[SequenceKV]) -> None:
        super().__init__(views)
        pool = views[0]._pool
        assert all(v._pool is pool for v in views)
        self._pool = pool
        bs = pool.block_size
        starts = np.array([v.num_tokens for v in views])
        self.lengths = starts + 1
        nblocks = -(-self.lengths // bs)
        self._tables = np.zeros((len(views), int(nblocks.max())), np.intp)
        for row, (v, n) in enumerate(zip(views, nblocks)):
            if len(v._table) < n:
                raise ValueError(f"paged KV cache: sequence {row} holds {starts[row]} tokens and "
                                 f"its {len(v._table)} blocks have no room for one more")
            self._tables[row, :n] = v._table[:n]
        self._blocks = self._tables[np.arange(len(views)), starts // bs]
        self._offsets = starts % bs

    def padded(self) -> bool:
        return self._tables.size * self._pool.block_size <= 2 * int(self.lengths.sum())

    def append_decode(self, layer: int, k: np.ndarray, v: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
        """Write k, v [B, kv_heads, head_dim]; return keys, values
        [B, kv_heads, L, head_dim] float32 (L = longest, padded; positions
        >= ``self.lengths[b]`` are padding)."""
        pk, pv = self._pool.k[layer], self._pool.v[layer]
        pk[:, self._blocks, self._offsets] = self._pool.encode(k.transpose(1, 0, 2))
        pv[:, self._blocks, self._offsets] = self._pool.encode(v.transpose(1, 0, 2))
        for view in self:
            view._len[layer] += 1
        kv_heads, _, bs, hd = pk.shape
        b, nb = self._tables.shape
        keys = pk[:, self._tables].transpose(1, 0, 2, 3, 4).reshape(b, kv_heads, nb * bs, hd)
        values = pv[:, self._tables].transpose(1, 0, 2, 3, 4).reshape(b, kv_heads, nb * bs, hd)
        return keys.astype(np.float32), values.astype(np.float32)
