"""The typed configuration tree: one pydantic model per concern, loaded from a site YAML.

Every setting the system has lives here with its default. `load_site()` reads
a file, validates it, and on failure raises ConfigError listing *every*
problem as (YAML path, what was found, what is allowed); the CLI prints them
and exits with status 2.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from exaserve_hpc.engine.gpu_specs import ARCHITECTURES
from exaserve_hpc.engine.registry import ENGINE_NAMES, engine_publishes_kv_events, engine_spec, unavailable_engines
from exaserve_hpc.router.policies import POLICY_NAMES
from exaserve_hpc.config.bounds import ConfigFileError, load_yaml, oversized_numbers, read_config_text
from exaserve_hpc.config.hostlist import expand_hostlist
from exaserve_hpc.config.lease_bounds import lease_problems
from exaserve_hpc.resources import data_path
from exaserve_hpc.units import DURATION_FORMS, SIZE_FORMS, parse_duration, parse_size

Duration = Annotated[float, BeforeValidator(parse_duration), Field(description=DURATION_FORMS)]
# an interval or timeout where zero makes no sense (a busy loop, or nothing ever waited for)
PositiveDuration = Annotated[float, BeforeValidator(parse_duration),
                             Field(gt=0, description=DURATION_FORMS + ", more than 0")]
Size = Annotated[int, BeforeValidator(parse_size), Field(description=SIZE_FORMS)]
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
NAME_FORMS = "1-64 characters: letters, digits, '.', '_' or '-', starting with a letter or digit"


class _Section(BaseModel):
    # strict: a YAML true is not 1 and a 1 is not true (ints stay ints, booleans booleans);
    # no NaN or infinity in any number
    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True, allow_inf_nan=False)


class SchedulerConfig(_Section):
    max_replicas_per_node: int = Field(16, ge=1)
    min_replicas_per_model: int = Field(4, ge=0)
    rebalance_interval: PositiveDuration = 30.0
    scale_up_threshold: float = Field(0.75, gt=0, le=1)
    scale_down_threshold: float = Field(0.25, ge=0, lt=1)
    cooldown_period: Duration = 120.0
    tick_interval: PositiveDuration = 1.0
    max_moves_per_round: int = Field(4, ge=0)

    @model_validator(mode="after")
    def _thresholds_ordered(self) -> "SchedulerConfig":
        if self.scale_down_threshold >= self.scale_up_threshold:
            raise ValueError(
                f"scale_down_threshold ({self.scale_down_threshold}) must be below "
                f"scale_up_threshold ({self.scale_up_threshold})"
            )
        return self


class HeartbeatConfig(_Section):
    interval: PositiveDuration = 5.0
    misses: int = Field(3, ge=1)
    # an agent that hears nothing from the controller this long stops its replicas and exits (0: never)
    controller_timeout: Duration = 60.0
    # after misses x interval of silence a node is only suspected: a heartbeat within this grace cancels
    # the loss before anything is torn down (overload delays heartbeats). None: one interval
    grace: Optional[Duration] = None

    @model_validator(mode="after")
    def _timeout_outlasts_heartbeats(self) -> "HeartbeatConfig":
        if self.controller_timeout and self.controller_timeout <= 2 * self.interval:
            raise ValueError(f"controller_timeout ({self.controller_timeout:g}s) must be 0 (never) or more than "
                             f"twice interval ({self.interval:g}s), or agents leave while their controller is fine")
        return self

    @property
    def expiry(self) -> float:
        """Seconds of silence after which a peer is suspected (and, `loss_grace` later, declared lost)."""
        return self.interval * self.misses

    @property
    def loss_grace(self) -> float:
        return self.interval if self.grace is None else self.grace


class BatchingConfig(_Section):
    max_batch_size: int = Field(32, ge=1)
    max_wait_ms: float = Field(50.0, ge=0)
    prefill_batch_size: int = Field(8, ge=1)
    decode_batch_size: int = Field(64, ge=1)
    chunked_prefill: bool = True
    prefill_chunk_tokens: int = Field(512, ge=16)


class TinyModelConfig(_Section):
    """Architecture of a model the reference engine creates itself (no download)."""

    layers: int = Field(2, ge=1)
    hidden: int = Field(64, ge=8)
    heads: int = Field(4, ge=1)
    kv_heads: int = Field(2, ge=1)
    intermediate: int = Field(172, ge=8)
    max_position: int = Field(2048, ge=64)
    seed: int = 0
    shards: int = Field(2, ge=1)

    @model_validator(mode="after")
    def _shapes_divide(self) -> "TinyModelConfig":
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        return self


class ModelConfig(_Section):
    model_name: Name
    model_path: Optional[str] = None  # checkpoint directory; None: <l3_path>/<model_name>
    engine: Literal[ENGINE_NAMES] = "reference"  # engine/registry.py; echo and timing: benchmarks, simulator
    tiny: Optional[TinyModelConfig] = None  # create the checkpoint on first use
    replicas: Optional[int] = Field(None, ge=0)  # initial count; None: scheduler minimum
    min_replicas: Optional[int] = Field(None, ge=0)  # None: scheduler.min_replicas_per_model
    tensor_parallel: int = Field(1, ge=1)
    pipeline_parallel: int = Field(1, ge=1)
    max_batch_size: Optional[int] = Field(None, ge=1)  # None: batching.max_batch_size
    max_seq_len: int = Field(2048, ge=16)
    gpu_memory_utilization: float = Field(0.90, gt=0, le=1)
    enable_prefix_caching: bool = True
    kv_cache_dtype: Literal["fp16", "fp8"] = "fp16"
    priority: int = Field(0, ge=0, le=100)  # configured importance; higher is kept longer
    weight_bytes: Optional[Size] = None  # for placement of models without a local checkpoint
    # The model's shape (engine/gpu_specs.py ARCHITECTURES): the simulator and the timing model cost its
    # steps from it (attention FLOPs, all-reduces, HBM reads); None: scaled from an 8B model by weight size
    architecture: Optional[Literal[tuple(ARCHITECTURES)]] = None
    kv_bytes_per_token: Optional[Size] = None
    demand_weight: float = Field(1.0, gt=0)
    # None: every caller sees the model; else only these quota groups (404 and absent from /v1/models for others)
    visible_to: Optional[list[Name]] = None

    @model_validator(mode="after")
    def _tiny_fits(self) -> "ModelConfig":
        if self.tiny is not None and self.max_seq_len > self.tiny.max_position:
            raise ValueError(
                f"max_seq_len ({self.max_seq_len}) exceeds tiny.max_position ({self.tiny.max_position})"
            )
        return self

    @model_validator(mode="after")
    def _engine_runs_this_shape(self) -> "ModelConfig":
        why = engine_spec(self.engine).pipeline_refusal
        if self.pipeline_parallel > 1 and why:
            raise ValueError(f"pipeline_parallel {self.pipeline_parallel} with engine {self.engine}: {why}")
        return self


class WeightCacheConfig(_Section):
    l2_capacity: Size = parse_size("8GiB")
    # where each node keeps L2 (a tmpfs; one with huge pages makes L3 -> L2 copies about twice as fast)
    l2_path: str = "/dev/shm"
    l3_path: str = "~/.cache/exaserve/models"

    @property
    def l3_dir(self) -> Path:
        return Path(os.path.expandvars(self.l3_path)).expanduser()


def _mem_request(value: Any) -> Any:
    """cluster.mem: "all" (Slurm's --mem=0), null, or a size of at least 1 MiB."""
    if value is None or value == "all":
        return value
    try:
        size = parse_size(value)
    except ValueError as exc:
        raise ValueError(f'"all" (the whole node) or {SIZE_FORMS}') from exc
    if size < 2**20:
        raise ValueError(f'at least 1MiB, "all" (the whole node) or null (the partition default); found {value!r}')
    return size


MemRequest = Annotated[Any, BeforeValidator(_mem_request),
                       Field(description='"all" (the whole node), a size (' + SIZE_FORMS + '), or null')]


class ClusterConfig(_Section):
    name: Name = "local"
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    nodes: int = Field(1, ge=1, le=4096)
    nodelist: Optional[str] = None  # Slurm hostlist, e.g. "n[1-4]"; its size must equal nodes
    gpus_per_node: int = Field(0, ge=0, le=64)  # 0: CPU nodes (reference engine on host memory)
    gpu_kind: Optional[str] = None
    gpu_memory: Size = 0  # per GPU
    host_memory: Optional[Size] = None  # per node; None: read from the machine
    nvlink_domain_size: Optional[int] = Field(None, ge=1)  # GPUs per NVLink domain; None: whole node
    fault_groups: Optional[dict[Name, str]] = None  # group name -> hostlist
    fault_group_size: Optional[int] = Field(None, ge=1)  # or: consecutive nodes per group
    time_limit: Optional[PositiveDuration] = None
    modules: list[str] = Field(default_factory=list)  # environment modules to load first
    # What the batch job asks Slurm for on each node (`exaserve submit`, exaserve_hpc/batch/slurm/sbatch.py).
    # The defaults suit GPU nodes: the fleet plans with every GPU, CPU and byte of host memory (L2 in
    # /dev/shm counts against the job's memory), so it takes whole nodes.
    exclusive: bool = True  # --exclusive: no other job shares the node
    mem: Optional[MemRequest] = "all"  # per node: "all" (--mem=0, the whole node), a size, or null (partition default)
    cpus_per_task: Optional[int] = Field(None, ge=1, le=4096)  # the node's one task; None: every CPU the job holds there
    mpi: Literal["pmix", "pmi2", "none"] = "pmix"  # srun --mpi; none: ranks meet through the job directory

    @field_validator("nodelist")
    @classmethod
    def _hostlist_bounded(cls, value: Optional[str]) -> Optional[str]:
        if value is not None:
            expand_hostlist(value)  # bounded before expanding (config/hostlist.py); the error names this key
        return value

    @field_validator("fault_groups")
    @classmethod
    def _groups_bounded(cls, value: Optional[dict[str, str]]) -> Optional[dict[str, str]]:
        for group, expr in (value or {}).items():
            try:
                expand_hostlist(expr)
            except ValueError as exc:
                raise ValueError(f"fault group {group[:60]!r}: {exc}") from exc
        return value

    @model_validator(mode="after")
    def _nodes_consistent(self) -> "ClusterConfig":
        hosts = self.hostnames()
        if len(hosts) != self.nodes:
            raise ValueError(f"nodelist {self.nodelist!r} names {len(hosts)} nodes but nodes is {self.nodes}")
        if isinstance(self.mem, int) and self.host_memory and self.mem > self.host_memory:
            raise ValueError(f"mem ({self.mem} bytes) is more than host_memory ({self.host_memory} bytes) per node")
        if self.gpus_per_node and not self.gpu_memory:
            raise ValueError(f"gpus_per_node is {self.gpus_per_node} but gpu_memory is not set")
        if self.nvlink_domain_size and self.gpus_per_node and self.gpus_per_node % self.nvlink_domain_size:
            raise ValueError(
                f"nvlink_domain_size ({self.nvlink_domain_size}) must divide gpus_per_node ({self.gpus_per_node})"
            )
        if self.fault_groups:
            seen: dict[str, str] = {}
            for group, expr in self.fault_groups.items():
                for host in expand_hostlist(expr):
                    if host not in hosts:
                        raise ValueError(f"fault group {group!r} names {host!r}, which is not in the nodelist")
                    if host in seen:
                        raise ValueError(f"node {host!r} is in fault groups {seen[host]!r} and {group!r}")
                    seen[host] = group
        return self

    def hostnames(self) -> list[str]:
        """Node names: the nodelist expanded, or node0..node{N-1} when none is given."""
        if self.nodelist:
            return expand_hostlist(self.nodelist)
        return [f"node{i}" for i in range(self.nodes)]

    def fault_group_of(self) -> dict[str, str]:
        """hostname -> fault group; one group per node when none are configured."""
        hosts = self.hostnames()
        if self.fault_groups:
            mapping = {h: g for g, expr in self.fault_groups.items() for h in expand_hostlist(expr)}
            return {h: mapping.get(h, f"ungrouped-{h}") for h in hosts}
        size = self.fault_group_size or 1
        return {h: f"fg{i // size}" for i, h in enumerate(hosts)}


class RouterConfig(_Section):
    # where the router and the controller listen; None: loopback under `exaserve serve` (one machine),
    # every interface, published under the node's name, under `exaserve launch` (a job across nodes)
    host: Optional[str] = None
    # an interface name (ib0) or a local address to listen on and publish, chosen on rank 0's node;
    # overrides host. None: host, or under `exaserve launch` the address the node's name resolves to
    interface: Optional[str] = None
    frontend_port: int = Field(0, ge=0, le=65535)  # 0: any free port
    backend_port: int = Field(0, ge=0, le=65535)
    # router/policies.py; prefix_affinity: the lowest mean TTFT measured (docs/benchmarks.md, bench_router_trace)
    policy: Literal[POLICY_NAMES] = "prefix_affinity"
    block_size: int = Field(16, ge=1)  # tokens per prefix block; in precise mode the engine's block size
    prefix_mode: Literal["approximate", "precise"] = "approximate"  # precise: fed by the replicas' KV events
    index_blocks: int = Field(1_000_000, ge=1024)  # block hashes the prefix index keeps (memory bound)
    # prefix_affinity's bounded loads (router/affinity.py): no replica takes a request that would put its
    # requests before their first token above max(1, this x the mean of its model's replicas); 0: no cap
    max_load_factor: float = 0.0
    max_attempts: int = Field(3, ge=1)
    request_timeout: PositiveDuration = 300.0
    first_token_timeout: PositiveDuration = 60.0
    # a stream silent this long moves elsewhere; None: first_token_timeout
    stall_timeout: Optional[PositiveDuration] = None
    coalesce_ms: float = Field(20.0, ge=0)
    coalesce_tokens: int = Field(16, ge=1)
    breaker_failures: int = Field(3, ge=1)
    breaker_cooloff: Duration = 10.0
    replica_heartbeat: PositiveDuration = 1.0
    replica_misses: int = Field(3, ge=1)
    admin_key: Optional[str] = None  # when set, the rollout admin API needs `Authorization: Bearer <admin_key>`
    # Routers sharing the fleet (router/router_group.py), each with its own gateway: under `exaserve launch`
    # router k on rank k (count <= the job's nodes); under `exaserve serve` all of them in one process
    count: int = Field(1, ge=1, le=64)

    @field_validator("max_load_factor")
    @classmethod
    def _no_cap_or_at_least_one(cls, value: float) -> float:
        if value != 0 and value < 1:  # below 1 some replica is always over it: not a cap but a refusal
            raise ValueError("0 (no cap) or a factor of at least 1")
        return value

    def bind_host(self, across_nodes: bool) -> str:
        if self.host:
            return self.host
        return "0.0.0.0" if across_nodes else "127.0.0.1"


class GatewayConfig(_Section):
    # None: loopback under `exaserve serve`; under `exaserve launch` the node's own address (what its
    # name resolves to), so a login node reaches it. A wildcard listens everywhere, published as that address
    host: Optional[str] = None
    interface: Optional[str] = None  # an interface name (ib0, eth0) or a local address; overrides host
    port: int = Field(8000, ge=0, le=65535)  # 0: any free port, published in the job directory
    max_queued_requests: int = Field(1024, ge=1)  # beyond this: 429 with Retry-After
    require_api_key: bool = False
    default_max_tokens: int = Field(128, ge=1)
    # The largest request body taken (413 beyond it, refused before the body is read), 1 KiB .. 1 GiB
    max_body_bytes: Size = Field(parse_size("4MiB"), ge=1024, le=2**30)
    # The share of max_queued_requests one quota group may hold when it sets no max_concurrent_requests
    group_share: float = Field(0.5, gt=0, le=1)
    # A bearer key for /metrics only (Prometheus' authorization), when require_api_key; the admin key works too
    metrics_key: Optional[str] = Field(None, min_length=16)
    # Half-life of the usage quota groups' fair share decays by (quota/shares.py), as Slurm's PriorityDecayHalfLife
    fair_share_half_life: PositiveDuration = 3600.0
    # Connections one gateway process holds open (gateway/http_limits.py); beyond it the oldest idle one is
    # closed, and when none is idle the new one is answered 503. Also bounded by the process's RLIMIT_NOFILE.
    max_connections: int = Field(4096, ge=16, le=1_000_000)
    max_connections_per_client: int = Field(1024, ge=1)  # per peer address (loopback users share 127.0.0.1)
    header_timeout: PositiveDuration = 10.0  # a request's headers must arrive within this, else it is closed
    keep_alive_timeout: PositiveDuration = 5.0  # an idle connection (no byte of a next request) is closed after
    # On a stop (SIGTERM, SIGUSR1, Ctrl-C, a requeue): streams open then have this long to finish; the rest
    # end with an SSE error event (code server_stopping) and `data: [DONE]` before the gateway stops
    stop_grace: Duration = Field(10.0, ge=0, le=3600)


class RequeueConfig(_Section):
    """When rank 0 gives the allocation back and comes again (`exaserve launch` flags override these)."""
    capacity_floor: float = Field(0.5, ge=0, le=1)  # requeue below this share of the planned nodes; 0: never
    time_margin: Duration = 0.0  # requeue this long before the job's end time; 0: the stop signal covers it
    replace_lost_nodes: bool = False  # ask the batch system for a node per lost node instead
    enabled: bool = True  # false: never requeue from the controller
    checkpoint_interval: Duration = 300.0  # the controller's state is also written this often; 0: only on stop


ETCD_BINARY = "etcd"  # the etcd server on PATH on the first ranks (Debian: etcd-server); ha/etcd_member.py runs it


class EtcdConfig(_Section):
    """The etcd the controller candidates elect a leader through (ha/): members `exaserve launch` starts on
    ranks 0..members-1 (data in the job directory), or a centre's own cluster named by its client URLs."""
    members: int = Field(0, ge=0)  # 1, 3 or 5 (an even count tolerates no more failures than one fewer)
    endpoints: list[Annotated[str, Field(pattern=r"^https?://[^/\s]+:[0-9]{1,5}$")]] = Field(default_factory=list)
    client_port: int = Field(2379, ge=1, le=65535)  # members' ports on their node's address
    peer_port: int = Field(2380, ge=1, le=65535)
    interface: Optional[str] = None  # where members listen (an interface name or address); None: router.interface
    data_dir: Optional[str] = None  # members' data, node-local (not a shared filesystem); None: $TMPDIR or /tmp
    # members: https with client certificates from a CA made per job run (ha/etcd_tls.py); false: plain http,
    # which lets any user who reaches the port write the election key
    tls: bool = True
    # endpoints: the centre's CA and this service's client certificate and key (https), all three or none
    ca_file: Optional[str] = None
    cert_file: Optional[str] = None
    key_file: Optional[str] = None

    @model_validator(mode="after")
    def _one_source(self) -> "EtcdConfig":
        if bool(self.members) == bool(self.endpoints):
            raise ValueError("set exactly one of members (1, 3 or 5: etcd members started on the job's first ranks) "
                             "and endpoints (a centre's etcd: http://host:port ...)")
        if self.members and self.members not in (1, 3, 5):
            raise ValueError(f"members is {self.members}; allowed: 1, 3 or 5")
        files = {"ca_file": self.ca_file, "cert_file": self.cert_file, "key_file": self.key_file}
        if any(files.values()) and not all(files.values()):
            raise ValueError(f"set all of ca_file, cert_file and key_file, or none (missing: "
                             f"{', '.join(k for k, v in files.items() if not v)})")
        if self.members and any(files.values()):
            raise ValueError("ca_file, cert_file and key_file name a centre's etcd (endpoints); members started "
                             "by exaserve launch get certificates made for the job (tls: true)")
        return self


class HaConfig(_Section):
    """Controller high availability (issue 18). Without `etcd`: one controller on rank 0, requeue on its loss."""
    etcd: Optional[EtcdConfig] = None
    candidates: int = Field(3, ge=1, le=5)  # controller candidates on ranks 0..candidates-1
    # The leader's lease: a leader that has not renewed it for lease_ttl minus a safety margin stops acting,
    # before etcd lets a standby win (config/lease_bounds.py checks the bounds)
    lease_ttl: Duration = 10.0
    renew_interval: Optional[Duration] = None  # None: lease_ttl / 5
    state_interval: PositiveDuration = 2.0  # the leader writes the fleet state to etcd when it changed, checked this often

    @model_validator(mode="after")
    def _lease_bounds(self) -> "HaConfig":
        problems = lease_problems(self.lease_ttl, self.renew_interval)
        if problems:
            raise ValueError("; ".join(problems))
        return self


class QuotaGroup(_Section):
    name: Name
    account: Optional[str] = None  # Slurm account of the research group
    # Keys are stored hashed (quota/keys.py): sha256:<hex> here and/or one a line in key_file (mode 0600);
    # `exaserve keys add GROUP` makes one. Plaintext api_keys still work, with a warning.
    api_key_hashes: list[Annotated[str, Field(pattern=r"^sha256:[0-9a-f]{64}$")]] = Field(default_factory=list)
    key_file: Optional[str] = None
    api_keys: list[str] = Field(default_factory=list)
    max_concurrent_requests: Optional[int] = Field(None, ge=1)
    tokens_per_minute: Optional[int] = Field(None, ge=1)  # prompt + completion tokens per rolling 60 s
    # Shares of each model's request slots (quota/shares.py): always admitted below guaranteed_share,
    # borrowing idle slots up to burst_share; None: no guarantee (borrowing only)
    guaranteed_share: Optional[float] = Field(None, ge=0, le=1)
    burst_share: float = Field(1.0, gt=0, le=1)

    @model_validator(mode="after")
    def _burst_above_guarantee(self) -> "QuotaGroup":
        if self.guaranteed_share is not None and self.burst_share < self.guaranteed_share:
            raise ValueError(f"burst_share ({self.burst_share}) is below guaranteed_share ({self.guaranteed_share})")
        return self


class SiteConfig(_Section):
    site: Name
    description: str = ""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    heartbeat: HeartbeatConfig = Field(default_factory=HeartbeatConfig)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    weight_cache: WeightCacheConfig = Field(default_factory=WeightCacheConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    requeue: RequeueConfig = Field(default_factory=RequeueConfig)
    ha: HaConfig = Field(default_factory=HaConfig)
    models: list[ModelConfig] = Field(min_length=1)
    quota_groups: list[QuotaGroup] = Field(default_factory=list)
    run_dir: str = "~/.cache/exaserve/run"
    # The usage ledger (quota/ledger.py); None: <run directory>/usage. Set it where a requeued job finds it again.
    usage_dir: Optional[str] = None

    @model_validator(mode="after")
    def _trtllm_fits_one_node(self) -> "SiteConfig":
        gpus = self.cluster.gpus_per_node
        for i, m in enumerate(self.models):
            if m.engine == "trtllm" and gpus and m.tensor_parallel > gpus:
                raise ValueError(f"models[{i}] ({m.model_name}): tensor_parallel {m.tensor_parallel} with engine trtllm "
                                 f"needs {m.tensor_parallel} GPUs on one node, but cluster.gpus_per_node is {gpus}: a "
                                 "TensorRT-LLM replica does not span nodes")
        return self

    @model_validator(mode="after")
    def _trtllm_blocks_are_a_power_of_two(self) -> "SiteConfig":
        # in precise mode the engine's KV block is the router's (engine/registry.py); TensorRT-LLM's
        # tokens_per_block must be a power of two
        size = self.router.block_size
        if self.router.prefix_mode == "precise" and size & (size - 1):
            trt = [m.model_name for m in self.models if m.engine == "trtllm"]
            if trt:
                raise ValueError(f"router.block_size {size} is not a power of two, which TensorRT-LLM's KV blocks "
                                 f"(tokens_per_block) must be in precise prefix mode (models {', '.join(trt)}); "
                                 "use 16, 32 or 64")
        return self

    @model_validator(mode="after")
    def _unique_names(self) -> "SiteConfig":
        _require_unique("models", [m.model_name for m in self.models])
        _require_unique("quota_groups", [g.name for g in self.quota_groups])
        _require_unique("api key in quota_groups", [k for g in self.quota_groups for k in g.api_keys])
        _require_unique("api key hash in quota_groups", [h for g in self.quota_groups for h in g.api_key_hashes])
        groups = {g.name for g in self.quota_groups}
        guaranteed = sum(g.guaranteed_share or 0 for g in self.quota_groups)
        if guaranteed > 1 + 1e-9:
            raise ValueError(f"quota_groups' guaranteed_share add up to {guaranteed:g}; at most 1 (each model's "
                             "slots cannot be promised twice)")
        for model in self.models:
            unknown = [g for g in model.visible_to or () if g not in groups]
            if unknown:
                raise ValueError(f"model {model.model_name!r}: visible_to names {', '.join(map(repr, unknown))}, "
                                 f"not among quota_groups ({', '.join(sorted(groups)) or 'none defined'})")
        return self

    def model(self, name: str) -> ModelConfig:
        for model in self.models:
            if model.model_name == name:
                return model
        raise KeyError(name)

    def min_replicas(self, model: ModelConfig) -> int:
        return self.scheduler.min_replicas_per_model if model.min_replicas is None else model.min_replicas

    def initial_replicas(self, model: ModelConfig) -> int:
        return self.min_replicas(model) if model.replicas is None else model.replicas

    def model_dir(self, model: ModelConfig) -> Path:
        if model.model_path:
            return Path(os.path.expandvars(model.model_path)).expanduser()
        return self.weight_cache.l3_dir / model.model_name

    def max_batch_size(self, model: ModelConfig) -> int:
        return model.max_batch_size or self.batching.max_batch_size

    def engine_warnings(self) -> list[str]:
        """Warnings, not errors: models whose engine's package does not import on this machine (the compute
        nodes may well have what a login node lacks), and, in precise prefix mode, engines without KV events."""
        missing = unavailable_engines([m.engine for m in self.models])
        warnings = [f"models[{i}].engine: {missing[m.engine]} (model {m.model_name})"
                    for i, m in enumerate(self.models) if m.engine in missing]
        if self.router.policy == "prefix_affinity" and self.router.prefix_mode == "precise":
            warnings += [f"models[{i}].engine: {m.engine} publishes no KV events, so router.prefix_mode precise "
                         f"routes model {m.model_name} by load only" for i, m in enumerate(self.models)
                         if not engine_publishes_kv_events(m.engine)]
        if (problem := self.mpi_problem()) is not None:
            warnings.append(problem)
        if self.ha.etcd is not None and self.ha.etcd.members:
            if shutil.which(ETCD_BINARY) is None:
                warnings.append(f"ha.etcd.members: {self.ha.etcd.members} etcd members start on the job's first ranks, "
                                f"which need the `{ETCD_BINARY}` binary on PATH there; not found here (Debian: "
                                f"apt-get install etcd-server; or the centre's etcd module in cluster.modules)")
        for engine in dict.fromkeys(m.engine for m in self.models):  # knobs the site sets that an engine lacks
            ignored = [k for k in engine_spec(engine).ignored_batching if k in self.batching.model_fields_set]
            if ignored:
                models = ", ".join(m.model_name for m in self.models if m.engine == engine)
                warnings.append(f"batching.{', batching.'.join(ignored)}: not applied to {engine} replicas (models "
                                f"{models}): the engine batches by its own scheduler; max_batch_size, chunked_prefill "
                                f"and prefill_chunk_tokens are mapped")
        return warnings

    def mpi_problem(self) -> Optional[str]:
        """Why this install cannot launch the site's Slurm job, or None: `cluster.mpi` pmix or pmi2 (the ranks
        meet through MPI) needs mpi4py, which only the [mpi] extra installs. Sites without a partition are not
        Slurm sites (`exaserve serve` uses no MPI)."""
        if self.cluster.partition is None or self.cluster.mpi == "none":
            return None
        if importlib.util.find_spec("mpi4py") is not None:
            return None
        return (f"cluster.mpi: {self.cluster.mpi} needs mpi4py, which this install lacks, so every rank of the job "
                "would exit at start; install it with: pip install 'exaserve-hpc[mpi]' (with the site's MPI "
                "module loaded, so mpi4py builds against that MPI), or set cluster.mpi: none (ranks meet through "
                "the job directory)")

    @property
    def run_path(self) -> Path:
        return Path(os.path.expandvars(self.run_dir)).expanduser()


def _require_unique(what: str, names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"duplicate {what}: {name!r}; each must be unique")
        seen.add(name)


# ---------------------------------------------------------------- loading


MAX_PROBLEMS = 50  # problems listed at most (a file of a thousand bad keys needs no thousand lines)


class ConfigProblem(BaseModel):
    path: str
    found: str
    allowed: str


class ConfigError(Exception):
    """A site config that cannot be used; carries every problem found."""

    def __init__(self, source: str, problems: list[ConfigProblem]):
        self.source = source
        self.problems = problems
        lines = [f"{source}: {len(problems)} problem(s)"]
        for p in problems:
            lines.append(f"  {p.path}: found {p.found}; allowed: {p.allowed}")
        super().__init__("\n".join(lines))


def _yaml_path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _model_at(loc: tuple) -> Optional[type[BaseModel]]:
    """The pydantic model class that holds the field at loc[-1] (for listing valid keys)."""
    current: Any = SiteConfig
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        field = current.model_fields.get(str(part))
        if field is None:
            return None
        current = _inner_model(field.annotation)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _inner_model(annotation: Any) -> Any:
    for arg in getattr(annotation, "__args__", ()) or ():
        inner = _inner_model(arg)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return inner
    return annotation


def _allowed_for(error: dict) -> str:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    if kind == "extra_forbidden":
        owner = _model_at(error["loc"])
        keys = sorted(owner.model_fields) if owner else []
        return "one of the keys " + ", ".join(keys) if keys else "no extra keys"
    if kind == "literal_error":
        return str(ctx.get("expected", error["msg"]))
    if kind == "missing":
        return "this key is required"
    if kind == "string_pattern_mismatch":
        return NAME_FORMS
    if kind in {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}:
        return error["msg"].replace("Input should be ", "a number ")
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    return error["msg"].replace("Input should be ", "")


def _brief(value: Any, depth: int = 0) -> str:
    """A bounded repr: a few items of a container, the start of a string, the size of a huge integer. It
    never walks a whole value, so an alias bomb's million-fold expansion is not rendered into a message."""
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 64 else f"an integer of {value.bit_length()} bits"
    if isinstance(value, str):
        return repr(value) if len(value) <= 60 else repr(value[:57]) + "..."
    if isinstance(value, (list, tuple, dict)):
        if depth >= 2:
            return "[...]" if not isinstance(value, dict) else "{...}"
        more = ", ..." if len(value) > 3 else ""
        if isinstance(value, dict):
            items = [f"{_brief(k, 2)}: {_brief(v, depth + 1)}" for k, v in list(value.items())[:3]]
            return "{" + ", ".join(items) + more + "}"
        return "[" + ", ".join(_brief(v, depth + 1) for v in value[:3]) + more + "]"
    return type(value).__name__


def _found(error: dict) -> str:
    if error["type"] == "missing":
        return "nothing"
    text = _brief(error.get("input"))
    return text if len(text) <= 80 else text[:77] + "..."


def problems_from(exc: ValidationError) -> list[ConfigProblem]:
    problems = []
    for error in exc.errors(include_input=True, include_url=False)[:MAX_PROBLEMS]:
        loc = error["loc"]
        allowed = _allowed_for(error)
        problems.append(ConfigProblem(path=_yaml_path(loc)[:200], found=_found(error),
                                      allowed=allowed if len(allowed) <= 300 else allowed[:297] + "..."))
    return problems


def parse_site(data: Any, source: str = "<config>") -> SiteConfig:
    """Validate an already-parsed YAML document."""
    if not isinstance(data, dict):
        raise ConfigError(source, [ConfigProblem(path="(top level)", found=repr(type(data).__name__),
                                                 allowed="a mapping with keys such as site, cluster, models")])
    try:
        return SiteConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, problems_from(exc)) from exc


def load_site(path: str | os.PathLike) -> SiteConfig:
    """Read and validate a site config file; ConfigError lists every problem. Bounded whatever the file
    holds (config/bounds.py): its size, nesting, alias expansion and integers are checked as it is read."""
    path = Path(path)
    try:
        text = read_config_text(path)
        data = load_yaml(text)
    except ConfigFileError as exc:
        raise ConfigError(str(path), [ConfigProblem(path=exc.where, found=exc.found, allowed=exc.allowed)]) from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(file)"
        found = str(getattr(exc, "problem", None) or exc)
        raise ConfigError(str(path), [ConfigProblem(path=where, found=found[:200], allowed="valid YAML")]) from exc
    problems = oversized_numbers(data)
    if problems:
        raise ConfigError(str(path), [ConfigProblem(path=_yaml_path(loc), found=found, allowed=allowed)
                                      for loc, found, allowed in problems])
    return parse_site(data, str(path))


def site_search_path() -> list[Path]:
    """Where `--site NAME` looks for NAME.yaml, first match wins."""
    dirs = []
    if os.environ.get("EXASERVE_SITE_DIR"):
        dirs.append(Path(os.environ["EXASERVE_SITE_DIR"]))
    dirs.append(data_path("site-configs"))  # the source checkout's, or the installed package's copy
    dirs.append(Path(sys.prefix) / "share" / "exaserve" / "site-configs")  # installed data files
    return dirs


def resolve_site(site: str | None) -> Path:
    """A path, or a site name looked up on site_search_path(); default $EXASERVE_SITE or "local"."""
    site = site or os.environ.get("EXASERVE_SITE") or "local"
    candidate = Path(site).expanduser()
    if candidate.suffix in {".yaml", ".yml"} or candidate.exists():
        return candidate
    for directory in site_search_path():
        for suffix in (".yaml", ".yml"):
            path = directory / f"{site}{suffix}"
            if path.exists():
                return path
    known = sorted({p.stem for d in site_search_path() if d.is_dir() for p in d.glob("*.y*ml")})
    raise ConfigError(site, [ConfigProblem(path="--site", found=repr(site),
                                           allowed="a YAML file path or one of: " + ", ".join(known))])
