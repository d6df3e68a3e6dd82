"""Wire messages between gateway, router, controller, node agents and replicas.

Every message is a msgspec Struct with a short tag and travels as MessagePack
(compact, typed, never a pickle: a peer that sends garbage gets a
DecodeError, not code execution). One ZeroMQ frame carries one message; the
ROUTER sockets add the peer identity frame in front.

Who sends what:
  gateway  -> router     GenerateRequest, Abort
  router   -> gateway    TokenChunk, RequestError
  router   -> replica    GenerateRequest, Abort, Drain
  replica  -> router     ReplicaHello, ReplicaStats (also its heartbeat), TokenChunk,
                         RequestError, ReplicaBye
  agent    -> controller AgentHello, AgentHeartbeat, ReplicaEvent
  controller -> agent    StartReplica, StopReplica, Shutdown
"""

from __future__ import annotations

from typing import Optional, Union

import msgspec


class _Msg(msgspec.Struct, tag_field="t", omit_defaults=True):
    pass


# ------------------------------------------------------------ requests


class GenerateRequest(_Msg, tag="gen"):
    request_id: str
    model: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: Optional[int] = None
    timeout: float = 0.0  # seconds from acceptance by the router; 0: its request_timeout applies
    quota_group: Optional[str] = None
    resumed_tokens: int = 0  # tokens of prompt_token_ids already sent to the client (stream migration)


class Abort(_Msg, tag="abort"):
    request_id: str


class TokenChunk(_Msg, tag="chunk"):
    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    replica_id: str = ""


class RequestError(_Msg, tag="err"):
    request_id: str
    status: int  # HTTP status the gateway should answer with
    code: str  # machine-readable: "model_not_found", "no_replica", "overloaded", "replica_failed", ...
    message: str
    retry_after: float = 0.0


# ------------------------------------------------------------ replica <-> router


class ReplicaHello(_Msg, tag="hello"):
    replica_id: str
    model: str
    pid: int
    max_batch_size: int
    max_seq_len: int
    node: str = ""


class ReplicaStats(_Msg, tag="stats"):
    replica_id: str
    queue_depth: int = 0
    running: int = 0
    kv_used: float = 0.0  # fraction of the KV cache in use
    latency_ewma_ms: float = 0.0
    tokens_generated: int = 0
    requests_finished: int = 0


class ReplicaBye(_Msg, tag="bye"):
    replica_id: str
    reason: str = "drain"


class Drain(_Msg, tag="drain"):
    timeout: float = 30.0


# ------------------------------------------------------------ agent <-> controller


class GpuInfo(msgspec.Struct, omit_defaults=True):
    index: int
    name: str
    memory_total: int
    memory_used: int = 0
    utilization: float = 0.0
    temperature: float = 0.0
    power_watts: float = 0.0


class ReplicaStatus(msgspec.Struct, omit_defaults=True):
    replica_id: str
    model: str
    state: str  # exaserve_hpc.agent.lifecycle.ReplicaState value
    pid: int = 0
    started_at: float = 0.0
    exit_code: Optional[int] = None
    detail: str = ""


class AgentHello(_Msg, tag="agent_hello"):
    agent_id: str
    hostname: str
    pid: int
    node_index: int = 0
    gpus: list[GpuInfo] = []
    host_memory_total: int = 0


class AgentHeartbeat(_Msg, tag="agent_hb"):
    agent_id: str
    seq: int
    replicas: list[ReplicaStatus] = []
    gpus: list[GpuInfo] = []
    host_memory_used: int = 0


class ReplicaEvent(_Msg, tag="replica_event"):
    agent_id: str
    replica_id: str
    state: str
    detail: str = ""
    seconds_in_previous_state: float = 0.0


class EngineSettings(msgspec.Struct, omit_defaults=True):
    engine: str = "reference"
    max_batch_size: int = 32
    max_seq_len: int = 2048
    max_wait_ms: float = 50.0
    prefill_batch_size: int = 8
    decode_batch_size: int = 64
    options: dict[str, float] = {}  # engine-specific knobs, passed as keyword arguments


class StartReplica(_Msg, tag="start"):
    replica_id: str
    model: str
    model_dir: str
    router_backend: str  # ZeroMQ endpoint the replica connects to
    settings: EngineSettings = msgspec.field(default_factory=EngineSettings)
    stats_interval: float = 1.0
    drain_timeout: float = 30.0  # on SIGTERM: finish in-flight requests for at most this long


class StopReplica(_Msg, tag="stop"):
    replica_id: str
    drain_timeout: float = 30.0


class Shutdown(_Msg, tag="shutdown"):
    drain_timeout: float = 10.0


Message = Union[
    GenerateRequest, Abort, TokenChunk, RequestError,
    ReplicaHello, ReplicaStats, ReplicaBye, Drain,
    AgentHello, AgentHeartbeat, ReplicaEvent, StartReplica, StopReplica, Shutdown,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(frame: bytes) -> Message:
    """Decode one frame; raises msgspec.DecodeError / ValidationError on garbage."""
    return _decoder.decode(frame)


DecodeError = (msgspec.DecodeError, msgspec.ValidationError)
