"""Wire messages between gateway, router, controller, node agents and replicas.

Every message is a msgspec Struct with a short tag and travels as MessagePack
(compact, typed, never a pickle: a peer that sends garbage gets a
DecodeError, not code execution). One ZeroMQ frame carries one message; the
ROUTER sockets add the peer identity frame in front.

Who sends what:
  gateway  -> router     GenerateRequest, Abort
  router   -> gateway    TokenChunk, TokenChunks (to a gateway that asked for them), RequestError
  router   -> replica    GenerateRequest, Abort, Drain, SayHello, Routers
  replica  -> router     ReplicaHello, ReplicaStats (also its heartbeat), TokenChunk, TokenChunks,
                         RequestError, ReplicaBye
  agent    -> controller AgentHello, AgentHeartbeat, ReplicaEvent, LoadFailed
  controller -> agent    StartReplica, StopReplica, Shutdown, Prefetch
  pipeline stage -> controller  StageHello (rendezvous: where its link listens)
  controller -> pipeline stage  StageTable (every stage's link endpoint, once all said hello)
"""

from __future__ import annotations

import sys
from array import array
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
    session_id: str = ""  # conversation id, if the client gave one: keeps a conversation on one canary version
    # The prompt's chained block hashes, computed by the gateway with the router's hasher
    # (router/prefix_index.py), so the router's thread does not hash; used only if prefix_scheme
    # names the router's own hasher and the count fits the prompt, else the router hashes itself.
    prefix_hashes: list[int] = []
    prefix_scheme: str = ""
    # On the wire from a gateway (`pack_request`): the prompt as little-endian uint32 token ids and
    # its block hashes as 64-bit integers, each one MessagePack bin, with the two lists above empty.
    # A bin is skipped or read in one step where an array of 1,000 ints is parsed int by int: that
    # parsing was 8 us of the router thread's ~60 us a request (it only forwards the prompt), and
    # the replica's decode is cheaper too. `decode` unpacks them, so receivers see plain lists.
    prompt_packed: bytes = b""
    hashes_packed: bytes = b""
    # The sender reads TokenChunks: the router may send it this request's chunks batched with others'.
    batch_replies: bool = False
    # Generating one of these ends the request ("stop"; not sent, counted): the model's EOS ids as the
    # gateway's tokenizer read them from the checkpoint (generation_config.json). Empty: the engine's own.
    stop_token_ids: list[int] = []


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


class TokenChunks(_Msg, tag="chunks"):
    """Several requests' chunks in one frame, each meaning what it would alone, in order: a replica's
    from one pass of its loop to one router, a router's to one gateway (one that set batch_replies).
    A frame, its receive and its send cost a router about as much as routing the chunk inside it, and a
    replica's engine step yields a chunk for every running request at once (docs/benchmarks.md: router CPU)."""
    chunks: list[TokenChunk]


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
    version: str = ""  # model version (canary rollout); "" = the model's only/stable version
    kv_events_endpoint: str = ""  # ZeroMQ PUB endpoint of the engine's KV events (precise prefix routing)
    routers: list[str] = []  # the router backends this replica is linked to (several routers; set by its links)
    # Z85 CURVE public key of that KV-event PUB ("" = plain): it admits only the run's client key (the router's)
    kv_events_key: str = ""


class ReplicaStats(_Msg, tag="stats"):
    replica_id: str
    queue_depth: int = 0
    running: int = 0
    kv_used: float = 0.0  # fraction of the KV cache in use
    latency_ewma_ms: float = 0.0
    tokens_generated: int = 0
    requests_finished: int = 0
    prefix_hit_tokens: int = 0    # prompt tokens served from the prefix cache, total
    prefix_query_tokens: int = 0  # prompt tokens looked up in it, total
    kv_blocks_cached: int = 0     # free KV blocks holding a reusable prefix
    # Over the engine's most recent requests (engine/latency_stats.py), milliseconds; 0: none measured yet.
    ttft_ms_p50: float = 0.0
    ttft_ms_p99: float = 0.0
    tpot_ms_p50: float = 0.0
    tpot_ms_p99: float = 0.0


class ReplicaBye(_Msg, tag="bye"):
    replica_id: str
    reason: str = "drain"


class Drain(_Msg, tag="drain"):
    timeout: float = 30.0


class SayHello(_Msg, tag="say_hello"):
    """Router -> replica: this router does not know you (it expired you, or your hello never came):
    send it your hello again. The replica's links answer it themselves (agent/router_links.py)."""


class Routers(_Msg, tag="routers"):
    """Router -> replica: every router's backend as the fleet knows them now (router.count > 1). A router
    that registered after this replica started is among them: the replica's links connect to each one
    they lack and say hello to it (agent/router_links.py); the ones they have are left as they are."""
    backends: list[str]


# ------------------------------------------------------------ agent <-> controller


class GpuInfo(msgspec.Struct, omit_defaults=True):
    index: int
    name: str
    memory_total: int
    memory_used: int = 0
    utilization: float = 0.0
    temperature: float = 0.0
    power_watts: float = 0.0
    nvlink_domain: int = -1  # NVML's NVLink grouping (GPUs sharing one domain); -1: unknown, the site config says


class ReplicaStatus(msgspec.Struct, omit_defaults=True):
    replica_id: str
    model: str
    state: str  # exaserve_hpc.agent.lifecycle.ReplicaState value
    pid: int = 0
    started_at: float = 0.0
    exit_code: Optional[int] = None
    detail: str = ""
    load_progress: float = 0.0  # 0..1 while loading weights (L3 -> L2, then L2 -> L1); 1 once loaded
    load_bytes_done: int = 0
    load_bytes_total: int = 0
    load_source: str = ""  # "l2" (host cache hit), "l3" (read from the shared store), "" (no weights)
    devices: list[str] = []  # what the replica's CUDA_VISIBLE_DEVICES holds (indices or UUIDs); [] = none


class MemoryPoolStatus(msgspec.Struct, omit_defaults=True):
    """The node's memory pool (exaserve_hpc.agent.memory_pool): bytes per device."""
    block_size: int
    total: list[int] = []
    free: list[int] = []
    reservations: dict[str, int] = {}  # replica id -> bytes reserved (all its devices)
    devices: dict[str, list[int]] = {}  # replica id -> the devices its reservation is on
    device_ids: list[str] = []  # device i's CUDA_VISIBLE_DEVICES entry (UUID or granted id); [] = host only


class L2EntryStatus(msgspec.Struct, omit_defaults=True):
    model: str
    nbytes: int
    state: str  # "filling" | "ready"
    pins: int = 0  # replicas using it now; a pinned entry is never evicted
    idle_s: float = 0.0  # seconds since last pinned or filled (LRU age)
    progress: float = 0.0  # 0..1 while filling


class L2Status(msgspec.Struct, omit_defaults=True):
    """The node's host-memory weight cache (exaserve_hpc.cache.l2_shm)."""
    capacity: int
    used: int = 0
    entries: list[L2EntryStatus] = []
    l3_bytes_read: int = 0  # bytes this node read from the shared store (L3) into L2, since the agent started
    fills: int = 0  # L3 -> L2 copies completed
    hits: int = 0  # replica starts served from an entry already in L2
    evictions: int = 0


class AgentHello(_Msg, tag="agent_hello"):
    agent_id: str
    hostname: str
    pid: int
    node_index: int = 0
    gpus: list[GpuInfo] = []
    host_memory_total: int = 0
    memory: Optional[MemoryPoolStatus] = None
    l2: Optional[L2Status] = None
    cpus: int = 0  # CPU cores the agent may use (its affinity); 0: not reported (an older agent)
    replica_threads: int = 0  # compute threads each replica runs (its BLAS threads); 0: not reported


class AgentHeartbeat(_Msg, tag="agent_hb"):
    agent_id: str
    seq: int
    replicas: list[ReplicaStatus] = []
    gpus: list[GpuInfo] = []
    host_memory_used: int = 0
    memory: Optional[MemoryPoolStatus] = None
    l2: Optional[L2Status] = None


class HeartbeatAck(_Msg, tag="agent_ack"):
    """The controller heard an agent's heartbeat. An agent that hears nothing from its controller for
    heartbeat.controller_timeout stops its replicas and exits, so a dead controller leaves no orphans."""
    seq: int


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
    chunked_prefill: bool = True
    prefill_chunk_tokens: int = 512
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "fp16"
    options: dict[str, float] = {}  # engine-specific knobs, passed as keyword arguments


class PipelineStage(msgspec.Struct, omit_defaults=True):
    """One stage process of a pipeline-parallel replica (controller/stage_rendezvous.py, engine/stage_link.py).

    Stage 0 is the replica's leader: it registers with the router and drives generation; stages
    1.. run their layers on activations from the stage before and pass them on (the last returns
    logits to stage 0). All stages of one start attempt share `key`; they find each other by
    saying StageHello to `rendezvous`.
    """
    rank: int
    size: int
    key: str  # this start attempt: stages of different attempts never link up
    rendezvous: str  # ZeroMQ endpoint (the controller's) where stages publish their link endpoints
    nodes: list[str] = []  # each stage's node (agent id), for errors that name it
    timeout: float = 15.0  # seconds of silence on a link after which the peer stage counts as lost
    rendezvous_timeout: float = 300.0  # seconds to wait for every stage to appear (weights may load first)


class StartReplica(_Msg, tag="start"):
    replica_id: str
    model: str
    model_dir: str
    router_backend: str  # ZeroMQ endpoint the replica connects to
    # Every router's backend when several share the fleet (router.count > 1), router_backend first; the
    # replica connects one DEALER to each (agent/router_links.py). []: router_backend alone.
    router_backends: list[str] = []
    version: str = ""  # model version model_dir holds (canary rollouts), sent in its ReplicaHello; "" = the site's
    settings: EngineSettings = msgspec.field(default_factory=EngineSettings)
    stats_interval: float = 1.0
    drain_timeout: float = 30.0  # on SIGTERM: finish in-flight requests for at most this long
    memory_bytes: int = 0  # per device to reserve from the node's pool; 0: the agent estimates from the manifest
    devices: int = 1  # devices (GPUs) the replica spans on this node (tensor parallel)
    # Node-local device indices the controller planned for it (len == devices); [] = the agent picks.
    gpu_indices: list[int] = []
    load_timeout: float = 0.0  # seconds per L3 -> L2 attempt; 0: the agent derives it from the size
    # KV snapshot migration (HDF5 on shared storage, engine/kv_snapshot.py); "" = off.
    kv_snapshot_in: str = ""   # loaded into the prefix cache after warm-up, before registering
    kv_snapshot_out: str = ""  # hottest prefix blocks written while draining, before ReplicaBye
    kv_snapshot_max_blocks: int = 0  # blocks written at most; 0: every cached block
    coalesce_ms: float = 20.0  # token chunks to the router are flushed after this long ...
    coalesce_tokens: int = 16  # ... or this many tokens (router.coalesce_ms / coalesce_tokens)
    stage: Optional[PipelineStage] = None  # None: not a pipeline stage (the whole model in one process)


class StageHello(_Msg, tag="stage_hello"):
    """A pipeline stage's link endpoint, sent (and repeated) until the StageTable is complete."""
    key: str
    rank: int
    endpoint: str
    node: str = ""


class StageTable(_Msg, tag="stage_table"):
    """Every stage's link endpoint by rank ("" = not yet seen), and why the attempt failed if it did."""
    key: str
    endpoints: list[str]
    failed: str = ""  # e.g. "stage 1 on node b failed: reserve failed: ..."; "" = no failure known


class StopReplica(_Msg, tag="stop"):
    replica_id: str
    drain_timeout: float = 30.0


class Shutdown(_Msg, tag="shutdown"):
    drain_timeout: float = 10.0


class Prefetch(_Msg, tag="prefetch"):
    """Load a model's weights into the node's L2 cache ahead of demand (no replica yet)."""
    model: str
    model_dir: str
    load_timeout: float = 0.0


class LoadFailed(_Msg, tag="load_failed"):
    """Weights could not be loaded on this node; the controller should place the replica elsewhere.

    Sent after the agent gave up (timeouts: after 1 + retries attempts; checksum: at once),
    next to the replica's ReplicaEvent(state="failed"). replica_id is "" for a failed Prefetch.
    """
    agent_id: str
    replica_id: str
    model: str
    reason: str  # "load_timeout" | "checksum" | "checkpoint" (missing/malformed) | "l2_full" | "io"
    attempts: int = 1
    detail: str = ""


Message = Union[
    GenerateRequest, Abort, TokenChunk, TokenChunks, RequestError,
    ReplicaHello, ReplicaStats, ReplicaBye, Drain, SayHello, Routers,
    AgentHello, AgentHeartbeat, ReplicaEvent, StartReplica, StopReplica, Shutdown,
    Prefetch, LoadFailed, HeartbeatAck, StageHello, StageTable,
]

DecodeError = (msgspec.DecodeError, msgspec.ValidationError)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(frame: bytes) -> Message:
    """Decode one frame; raises msgspec.DecodeError / ValidationError on garbage.

    A GenerateRequest sent packed (`pack_request`) comes back with plain lists."""
    message = _decoder.decode(frame)
    if message.__class__ is GenerateRequest and (message.prompt_packed or message.hashes_packed):
        unpack_request(message)
    return message


# Packed token ids and hashes: fixed-width little-endian integers (array's native order, swapped on a
# big-endian host). Token ids are uint32 (every tokenizer's vocabulary fits); hashes keep their sign:
# "q" for signed ones (Python's tuple hash), "Q" for unsigned ones (the engine's blake2b).
_LITTLE = sys.byteorder == "little"


def pack_ints(values, typecode: str) -> bytes:
    """Integers as one little-endian byte string; OverflowError if one does not fit `typecode`."""
    packed = array(typecode, values)
    if not _LITTLE:  # pragma: no cover - every supported host is little-endian
        packed.byteswap()
    return packed.tobytes()


def unpack_array(data: bytes, typecode: str) -> array:
    """`pack_ints` undone, as an array; ValidationError for a length that is not a whole number of integers."""
    values = array(typecode)
    if len(data) % values.itemsize:
        raise msgspec.ValidationError(f"packed integers of {len(data)} bytes are not a whole number of "
                                      f"{values.itemsize}-byte values")
    values.frombytes(data)
    if not _LITTLE:  # pragma: no cover
        values.byteswap()
    return values


def unpack_ints(data: bytes, typecode: str) -> list[int]:
    return unpack_array(data, typecode).tolist()


def pack_request(request: GenerateRequest) -> GenerateRequest:
    """The request as a gateway sends it: prompt and hashes packed (a copy; the original is unchanged).

    Token ids outside uint32, or hashes outside 64 bits, stay as lists: the receiver then validates
    them as it always did. The hashes' sign travels in the scheme's typecode suffix (":q" or ":Q").
    Hashes without a scheme are dropped (a router uses only hashes of a scheme it knows). A request
    already packed is returned as it is."""
    if request.prompt_packed or request.hashes_packed:
        return request
    changes: dict = {} if request.prefix_scheme or not request.prefix_hashes else {"prefix_hashes": []}
    try:
        changes["prompt_packed"] = pack_ints(request.prompt_token_ids, "I")
        changes["prompt_token_ids"] = []
    except (OverflowError, TypeError):
        pass
    for typecode in ("q", "Q") if request.prefix_hashes and request.prefix_scheme else ():  # signed, else unsigned
        try:
            changes["hashes_packed"] = pack_ints(request.prefix_hashes, typecode)
        except (OverflowError, TypeError):
            continue
        changes["prefix_hashes"] = []
        changes["prefix_scheme"] = f"{request.prefix_scheme}:{typecode}"
        break
    return msgspec.structs.replace(request, **changes) if changes else request


def unpack_request(request: GenerateRequest) -> GenerateRequest:
    """In place: the packed prompt and hashes back into prompt_token_ids and prefix_hashes.

    A prompt that does not unpack raises ValidationError (the request is unreadable). Hashes that
    do not are dropped: only a router reads them, and it hashes the prompt itself without them
    (as it did before forwarding this very request, so a replica must not refuse it for them)."""
    if request.prompt_packed:
        request.prompt_token_ids = unpack_ints(request.prompt_packed, "I")
        request.prompt_packed = b""
    if request.hashes_packed:
        hashes, scheme = unpack_hashes(request.hashes_packed, request.prefix_scheme)
        request.prefix_hashes, request.prefix_scheme = list(hashes), scheme
        request.hashes_packed = b""
    return request


def unpack_hashes(data: bytes, scheme: str) -> tuple["array | list[int]", str]:
    """A packed request's (prefix_hashes, prefix_scheme); ([], "") if malformed: the router then
    hashes the prompt itself rather than fail the request. The hashes stay an array('q') or
    array('Q'): the compiled prefix index reads its buffer, without making 72 Python ints."""
    split = _schemes.get(scheme)  # a router sees one or two schemes: split each once, not per request
    try:
        if split is None:
            split = split_scheme(scheme)
            if len(_schemes) < 64:
                _schemes[scheme] = split
        return unpack_array(data, split[1]), split[0]
    except msgspec.ValidationError:
        return [], ""


_schemes: dict[str, tuple[str, str]] = {}


def split_scheme(scheme: str) -> tuple[str, str]:
    """A packed request's prefix_scheme as (the hasher's scheme, the hashes' typecode)."""
    name, _, typecode = scheme.rpartition(":")
    if typecode not in ("q", "Q") or not name:
        raise msgspec.ValidationError(f"prefix_scheme {scheme!r} of packed hashes must be a hasher's scheme "
                                      "followed by ':q' (signed hashes) or ':Q' (unsigned)")
    return name, typecode

