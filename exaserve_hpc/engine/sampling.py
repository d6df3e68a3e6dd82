"""Token sampling: greedy, temperature and nucleus (top-p).

Call protocol: ``validate_sampling(temperature, top_p)`` when a request
arrives (clear ValueError for bad values); then per generated token
``sample(logits, temperature, top_p, rng)`` with one ``numpy.random.Generator``
per request, made by ``request_rng(seed)``, so a seeded request draws the same
tokens whatever else shares its batch.
"""

from __future__ import annotations

import math

import numpy as np

MAX_TEMPERATURE = 100.0


def validate_sampling(temperature: float, top_p: float) -> None:
    """Raise ValueError naming the bad parameter, its value and the valid range."""
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise ValueError(
            f"temperature must be between 0 and {MAX_TEMPERATURE:g} (0 = greedy), got {temperature!r}"
        )
    if not isinstance(top_p, (int, float)) or not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = no nucleus cut), got {top_p!r}")


def request_rng(seed: int | None) -> np.random.Generator:
    """The per-request generator: reproducible when seeded, fresh entropy otherwise."""
    return np.random.default_rng(seed)


def sample(logits: np.ndarray, temperature: float, top_p: float,
           rng: np.random.Generator) -> int:
    """Pick one token id from 1-D ``logits``.

    temperature 0 -> argmax (rng untouched). Otherwise softmax(logits / T),
    keep the smallest set of most likely tokens whose mass reaches ``top_p``
    (always at least one), and draw from it with one ``rng.random()``.
    """
    validate_sampling(temperature, top_p)
    logits = np.asarray(logits)
    if logits.ndim != 1 or logits.size == 0:
        raise ValueError(f"sample() takes 1-D logits, got shape {logits.shape}")
    if not np.all(np.isfinite(logits)):
        raise ValueError("logits contain NaN or inf; the model or its weights are broken")
    if temperature == 0.0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    ids = None
    if top_p < 1.0:
        ids = np.argsort(-probs, kind="stable")  # stable: ties break the same way everywhere
        probs = probs[ids]
        cum = np.cumsum(probs)
        keep = int(np.searchsorted(cum, top_p * cum[-1])) + 1
        probs = probs[:keep]
        ids = ids[:keep]
    cum = np.cumsum(probs)
    pick = min(int(np.searchsorted(cum, rng.random() * cum[-1], side="right")), cum.size - 1)
    return int(ids[pick]) if ids is not None else pick
