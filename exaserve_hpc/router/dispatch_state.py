"""What the dispatcher keeps per replica and per request, its settings, and what it asks to send.

Plain records, no behaviour: `dispatch.py` owns the rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..protocol import GenerateRequest, Message
from .balancing import ReplicaLoad, RoutingKey
from .breaker import BreakerSettings, CircuitBreaker

GATEWAY, REPLICA = "gateway", "replica"


@dataclass
class Outgoing:
    side: str  # GATEWAY or REPLICA
    peer: bytes  # ZeroMQ identity of the receiver
    message: Message


@dataclass
class ReplicaEntry:
    load: ReplicaLoad
    last_seen: float
    node: str = ""
    pid: int = 0
    draining: bool = False
    version: str = ""
    breaker: Optional[CircuitBreaker] = None
    # As the replica's engine last reported them (totals since it started): how much of the prompts
    # it was sent it found in its prefix cache, and how many free KV blocks still hold a prefix.
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    kv_blocks_cached: int = 0
    running: int = 0  # sequences in its running batch, and its totals since it started (for /metrics)
    requests_finished: int = 0
    tokens_generated: int = 0
    latency_ms: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # TTFT p50, p99, TPOT p50, p99


@dataclass
class Inflight:
    request: GenerateRequest  # as the gateway sent it
    gateway: bytes
    accepted_at: float
    deadline: float
    replica_id: Optional[str] = None
    dispatched_at: float = 0.0
    sent_tokens: list[int] = field(default_factory=list)
    attempts: int = 0
    tried: set[str] = field(default_factory=set)
    last_failure: str = ""
    key: Optional[RoutingKey] = None  # prompt block hashes, computed once (prefix-aware policies)
    version: Optional[str] = None  # canary version chosen for this request, kept across retries; None: any
    version_chosen: bool = False
    prefill_estimate: int = 0  # uncached prompt tokens charged to the replica until its first token
    decode_estimate: int = 0  # tokens still to generate, charged to the replica until the request ends
    first_token_at: float = 0.0  # of the current attempt; 0: none yet
    last_token_at: float = 0.0


@dataclass
class DispatchSettings:
    max_attempts: int = 3
    request_timeout: float = 300.0
    first_token_timeout: float = 60.0
    replica_expiry: float = 3.0
    stall_timeout: float = 0.0  # a stream silent this long moves elsewhere; 0: first_token_timeout
    breaker: BreakerSettings = field(default_factory=BreakerSettings)

    @property
    def stall_limit(self) -> float:
        return self.stall_timeout or self.first_token_timeout


class _Excluded:
    """tried | unavailable without building a set per request."""

    __slots__ = ("a", "b")

    def __init__(self, a, b):
        self.a, self.b = a, b

    def __contains__(self, replica_id: object) -> bool:
        return replica_id in self.a or replica_id in self.b
