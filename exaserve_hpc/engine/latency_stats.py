"""Per-engine latency and batching telemetry: TTFT, TPOT, batch-size histogram.

TTFT is arrival -> first token; TPOT is (last token - first token) /
(tokens - 1) of a finished request. Both keep the last ``window`` requests
and are reported in milliseconds as mean / p50 / p99. The batch-size
histogram counts steps by the number of sequences they computed, in
power-of-two buckets keyed by their upper bound ("1", "2", "4", ...).
"""

from __future__ import annotations

from collections import Counter, deque

import numpy as np


def _summary(values: deque[float]) -> dict:
    if not values:
        return {"count": 0, "mean": 0.0, "p50": 0.0, "p99": 0.0}
    ms = np.asarray(values) * 1000.0
    return {"count": len(ms), "mean": float(ms.mean()),
            "p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99))}


def batch_bucket(size: int) -> str:
    """Upper bound of the power-of-two bucket holding ``size`` (>= 1)."""
    return str(1 << max(0, size - 1).bit_length())


class LatencyStats:
    def __init__(self, window: int = 2048) -> None:
        self._ttft: deque[float] = deque(maxlen=window)
        self._tpot: deque[float] = deque(maxlen=window)
        self._batches: Counter[str] = Counter()

    def record_step(self, num_sequences: int) -> None:
        if num_sequences > 0:
            self._batches[batch_bucket(num_sequences)] += 1

    def record_first_token(self, seconds: float) -> None:
        self._ttft.append(seconds)

    def record_finished(self, first_token_at: float | None, last_token_at: float | None,
                        tokens: int) -> None:
        if first_token_at is not None and last_token_at is not None and tokens > 1:
            self._tpot.append((last_token_at - first_token_at) / (tokens - 1))

    def snapshot(self) -> dict:
        return {
            "ttft_ms": _summary(self._ttft),
            "tpot_ms": _summary(self._tpot),
            "batch_size_hist": dict(sorted(self._batches.items(), key=lambda kv: int(kv[0]))),
        }
