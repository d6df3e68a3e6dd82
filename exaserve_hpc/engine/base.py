"""The Engine protocol and the plain data it exchanges.

Call protocol (one thread drives an engine; it is not thread-safe):

1. ``warmup()`` once after construction: runs a real short inference and
   raises ``EngineError`` if the output is not valid, so a broken replica
   never registers with the router.
2. ``add_request(req)`` any time; raises ValueError for a request the
   engine can never serve (prompt + max_tokens over its max_seq_len, ids
   outside the vocabulary, a request_id already in flight).
3. ``step()`` in a loop while ``has_unfinished()``. Each call is one
   scheduling iteration: admit waiting requests (up to the batch limits),
   prefill them, run one decode step for the others, and return one
   ``StepOutput`` per request that produced a token or finished. Every
   request ends with exactly one output with ``finished=True``.
4. ``abort(request_id)``: the request ends with reason "abort" in the next
   ``step()``; unknown or already finished ids are ignored.
5. ``stats()`` for telemetry; ``shutdown()`` at the end (idempotent).

This step protocol is what every backend implements (engine/registry.py
lists them); the replica process drives it directly from its ZeroMQ loop
(agent/replica_main.py), which is also where draining lives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from exaserve_hpc.engine.sampling import validate_sampling
from exaserve_hpc.engine.tokenizer import EOS

DEFAULT_EOS_IDS = (EOS,)  # the EOS of models without a generation config (exaserve-llama-v1)

FINISH_REASONS = ("stop", "length", "abort")


class EngineError(RuntimeError):
    """The engine cannot serve: failed warm-up, broken model, shut down."""


@dataclass(frozen=True)
class EngineRequest:
    """One generation request, already tokenized. Validated on construction."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 0.0        # 0 = greedy
    top_p: float = 1.0              # nucleus mass kept, (0, 1]
    seed: int | None = None         # per-request RNG seed; None = nondeterministic
    # Generating one of these finishes with "stop"; None: the model's own EOS ids (its generation
    # config's eos_token_id, an id or a list; the byte tokenizer's EOS for exaserve-llama-v1 models).
    stop_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        if len(self.prompt_token_ids) == 0:
            raise ValueError(
                f"request {self.request_id}: prompt_token_ids is empty; encode the prompt "
                "with add_bos=True so it has at least the BOS token"
            )
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_tokens must be >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"request {self.request_id}: seed must be a non-negative int, got {self.seed!r}")
        try:
            validate_sampling(self.temperature, self.top_p)
        except ValueError as e:
            raise ValueError(f"request {self.request_id}: {e}") from e


@dataclass
class StepOutput:
    """What one request did in one ``step()``."""

    request_id: str
    new_token_ids: list[int]        # tokens generated this step; a stop token is not included
    finished: bool                  # True exactly once per request, on its last output
    finish_reason: str | None       # "stop" | "length" | "abort" when finished, else None
    prompt_tokens: int              # len(prompt_token_ids)
    completion_tokens: int          # tokens generated so far, a final stop token included


@runtime_checkable
class Engine(Protocol):
    """A model replica's inference engine; see the module docstring for the protocol."""

    def add_request(self, req: EngineRequest) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def step(self) -> list[StepOutput]: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> dict:
        """queue_depth (waiting), running, tokens_generated (total),
        requests_finished, prefill_tokens (total), kv_used (fraction of the
        KV pool in use), plus engine extras. The paged engines
        (``continuous.py``) add kv_blocks_used / kv_blocks_total /
        kv_blocks_cached, prefix_hit_tokens, preemptions, batch_size_hist,
        ttft_ms and tpot_ms (mean / p50 / p99)."""
        ...

    def warmup(self) -> None: ...

    def shutdown(self) -> None: ...
