"""What the dispatcher keeps per replica and per request, its settings, and what it asks to send.

Plain records, no behaviour: `dispatch.py` owns the rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence, Union

import msgspec

from exaserve_hpc.protocol import GenerateRequest, Message, unpack_ints
from exaserve_hpc.router.balancing import ReplicaLoad, ReplicaPool, RoutingKey
from exaserve_hpc.router.breaker import BreakerSettings, CircuitBreaker

GATEWAY, REPLICA = "gateway", "replica"


@dataclass(slots=True)
class Outgoing:
    side: str  # GATEWAY or REPLICA
    peer: bytes  # ZeroMQ identity of the receiver
    message: Union[Message, memoryview, bytes]  # bytes: a message already encoded (a request forwarded as it came)


class PromptTokens:
    """A prompt's token ids left as the gateway encoded them, decoded on demand: packed
    (`protocol.pack_request`, what gateways send: 4 bytes a token) or a MessagePack array.

    The router's thread needs only the prompt's length on its hot path (the gateway sends the
    block hashes); decoding 1,000 token ids into Python ints and encoding them again for the
    replica was about half of its time per request (bench_router_decision.py, breakdown).
    Slicing, iterating or adding decodes (hashing in the router, canary stickiness, a retry).
    """

    __slots__ = ("raw", "packed", "count", "_ids")

    def __init__(self, raw: msgspec.Raw, packed: bytes = b""):
        self.raw, self.packed = raw, packed
        if packed:
            if len(packed) & 3:
                raise msgspec.ValidationError(f"prompt_packed has {len(packed)} bytes, not 4 a token id")
            self.count = len(packed) >> 2
        else:
            self.count = array_length(raw)
        self._ids: Optional[list[int]] = None

    def ids(self) -> list[int]:
        if self._ids is None:
            self._ids = unpack_ints(self.packed, "I") if self.packed else _token_ids.decode(self.raw)
        return self._ids

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index):
        return self.ids()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids())

    def __add__(self, other) -> list[int]:
        return self.ids() + list(other)

    def __eq__(self, other) -> bool:
        return self.ids() == (other.ids() if isinstance(other, PromptTokens) else other)


_token_ids = msgspec.msgpack.Decoder(list[int])


def array_length(raw) -> int:
    """Elements of a MessagePack array from its header; ValidationError if it is not an array."""
    view = memoryview(raw)
    size = view.nbytes
    if size:  # byte arithmetic, not int.from_bytes over slices: once per request on the router's thread
        head = view[0]
        if 0x90 <= head <= 0x9F:
            return head & 0x0F
        if head == 0xDC and size >= 3:
            return view[1] << 8 | view[2]
        if head == 0xDD and size >= 5:
            return view[1] << 24 | view[2] << 16 | view[3] << 8 | view[4]
    raise msgspec.ValidationError("prompt_token_ids must be an array of token ids")


class RoutedRequest(msgspec.Struct, tag_field="t", tag="gen", omit_defaults=True, gc=False):
    """A GenerateRequest as the router's thread decodes it: every field but the prompt's token ids,
    which stay encoded (`PromptTokens`) and reach the replica in the gateway's own bytes.

    Field for field the same as protocol.GenerateRequest (a test holds them equal). Not tracked by the
    garbage collector (gc=False: its fields are strings, numbers and a list of ints, so it is in no
    cycle): one fewer object for every collection to walk, per request in flight.
    """

    request_id: str
    model: str
    prompt: msgspec.Raw = msgspec.field(name="prompt_token_ids")
    max_tokens: int = msgspec.field()
    temperature: float = 0.0
    top_p: float = 1.0
    seed: Optional[int] = None
    timeout: float = 0.0
    quota_group: Optional[str] = None
    resumed_tokens: int = 0
    session_id: str = ""
    prefix_hashes: list[int] = []
    prefix_scheme: str = ""
    prompt_packed: bytes = b""
    hashes_packed: bytes = b""
    batch_replies: bool = False
    stop_token_ids: list[int] = []

    @property
    def prompt_token_ids(self) -> PromptTokens:
        return PromptTokens(self.prompt, self.prompt_packed)


@dataclass
class ReplicaEntry:
    load: ReplicaLoad
    last_seen: float
    node: str = ""
    pid: int = 0
    draining: bool = False
    version: str = ""
    breaker: Optional[CircuitBreaker] = None
    pools: list[ReplicaPool] = field(default_factory=list)  # the pools its load is in (its model's, its version's)
    # As the replica's engine last reported them (totals since it started): how much of the prompts
    # it was sent it found in its prefix cache, and how many free KV blocks still hold a prefix.
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0
    kv_blocks_cached: int = 0
    running: int = 0  # sequences in its running batch, and its totals since it started (for /metrics)
    requests_finished: int = 0
    tokens_generated: int = 0
    latency_ms: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # TTFT p50, p99, TPOT p50, p99


@dataclass(slots=True)
class Inflight:
    request: Union[GenerateRequest, RoutedRequest]  # as the gateway sent it
    gateway: bytes
    accepted_at: float
    deadline: float
    prompt: Sequence[int] = ()  # request.prompt_token_ids (a RoutedRequest's PromptTokens, decoded on demand)
    prompt_len: int = 0  # tokens in it
    raw: Optional[memoryview] = None  # the request as the gateway encoded it: sent on as it is the first time
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
    # the id the current attempt carries on the replica side: "" for the first (the request's own id), then
    # `attempt_id(request_id, n)`, so a resend never collides with an earlier attempt still running there
    wire_id: str = ""


def attempt_id(request_id: str, attempt: int) -> str:
    """The replica-side id of a request's `attempt`-th dispatch (the first keeps the request's own id)."""
    return request_id if attempt <= 1 else f"{request_id}~a{attempt}"


def request_id_of(wire_id: str) -> str:
    """The request's own id of a replica-side id (the inverse of `attempt_id`)."""
    base, mark, attempt = wire_id.rpartition("~a")
    return base if mark and attempt.isdigit() else wire_id


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
