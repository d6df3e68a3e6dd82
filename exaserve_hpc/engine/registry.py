"""Every engine a replica can run, in one table.

The site config's allowed ``models[].engine`` values, the replica's factory
(``agent/replica_main.make_engine``), the node agent's memory sizing and
weight staging, and checkpoint preparation under ``exaserve serve`` all read
``ENGINES``. Adding an engine is one module (the engine) plus one entry here
with its build function.

Importing this module imports no engine: each build function imports its
engine when a replica runs it, so ``config/schema.py`` and the agent stay light and
an engine whose package is missing fails only where it is asked for.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from exaserve_hpc.cache.l3_store import manifest_bytes
from exaserve_hpc.engine.base import EngineError
from exaserve_hpc.protocol import EngineSettings

if TYPE_CHECKING:
    from exaserve_hpc.engine.base import Engine
    from exaserve_hpc.protocol import StartReplica

RUNTIME_OVERHEAD = 0.25  # a checkpoint's bytes x 1.25 when the controller gives no figure (KV cache, activations)

# What a build function gets besides the StartReplica: the arrays the replica loaded into its own
# memory ((config, weights), engines with loads_in_process) or the checkpoint directory (the others).
Weights = Any


@dataclass(frozen=True)
class EngineSpec:
    name: str
    build: Callable[["StartReplica", Weights], "Engine"]  # in the replica process, after loading
    needs_weights: bool      # reads a checkpoint: the agent stages it (L3 -> L2) and sizes from it
    loads_in_process: bool   # the replica copies the weights into its memory (L2 -> L1) before build;
    #                          False: build gets the checkpoint directory and the engine reads it itself
    reads_tiny: bool         # reads the checkpoints `exaserve model create-tiny` writes (a `tiny:` section)
    kv_events: bool          # publishes KV-cache events (precise prefix routing)
    kv_snapshots: bool       # its prefix cache can be written and loaded (engine/kv_snapshot.py) on a move
    # Why models with pipeline_parallel > 1 cannot run this engine ("" = `config check` lets them through);
    # exaserve's pipeline stages are processes on different nodes (agent/stage_process.py)
    pipeline_refusal: str = ""
    # The replica process starts without the Slurm step's PMIx/MPI wiring (agent/replica_process.py): engines
    # that start MPI workers of their own (TensorRT-LLM for TP) must not join the srun step's MPI job
    isolate_mpi: bool = False
    # batching knobs (config.BatchingConfig fields) the engine does not apply; `config check` names them
    ignored_batching: tuple[str, ...] = ()
    package: str = ""        # the third-party module it imports; "" = only exaserve's own dependencies
    # computes on the node's CPU cores (each replica keeps a core busy): replicas per node are bounded by
    # the node's cores (controller/cpu_bound.py)
    cpu_compute: bool = False
    install: str = ""        # how to get that package
    summary: str = ""
    # EngineSettings.options a site gives this engine (see `engine_settings`): (site, model) -> options
    site_options: Callable[[Any, Any], dict[str, float]] = lambda site, model: {}

    def available(self) -> bool:
        """Whether this machine can import the engine's package (without importing it)."""
        return not self.package or importlib.util.find_spec(self.package) is not None

    def missing_package_message(self) -> str:
        return (f"engine {self.name!r} needs the Python package {self.package!r}, which is not importable "
                f"here; install it with: {self.install}")

    def memory_bytes(self, replica: "StartReplica") -> int:
        """Bytes per device to reserve when the controller did not say: the checkpoint plus overhead."""
        if not self.needs_weights:
            return 0
        return int(manifest_bytes(replica.model_dir) * (1 + RUNTIME_OVERHEAD) / max(1, replica.devices))


class UnknownEngine(ValueError):
    pass


# ---------------------------------------------------------------- build functions

# What a replica may use per device: its engine's memory bound, set by the agent (agent/replica_process.py)
RESERVED_ENV = "EXASERVE_RESERVED_BYTES_PER_DEVICE"


def _engine_class(module: str, name: str) -> type:
    """An engine class by module and name, imported when a replica first builds it: listing the engines
    (the site schema, the agent's sizing) loads none of them, and a missing optional package fails only
    the replica that asks for its engine."""
    return getattr(importlib.import_module(module), name)


def _options(replica: "StartReplica", integers: tuple[str, ...] = (), floats: tuple[str, ...] = ()) -> dict[str, Any]:
    """The engine-specific knobs (EngineSettings.options) this engine takes, typed; others are refused."""
    options = replica.settings.options
    unknown = sorted(set(options) - set(integers) - set(floats))
    if unknown:
        raise ValueError(f"engine {replica.settings.engine!r} takes no option {', '.join(unknown)}; "
                         f"its options: {', '.join(integers + floats) or 'none'}")
    return {k: int(v) if k in integers else float(v) for k, v in options.items()}


KV_OPTIONS = ("block_size", "num_kv_blocks")  # the paged engines' KV pool, when a site sets it


def _batching(replica: "StartReplica", **extra) -> dict[str, Any]:
    """ContinuousBatchingEngine's keywords from the replica's settings."""
    s = replica.settings
    return dict(max_batch_size=s.max_batch_size, max_seq_len=s.max_seq_len, max_wait_ms=s.max_wait_ms,
                prefill_batch_size=s.prefill_batch_size, decode_batch_size=s.decode_batch_size,
                chunked_prefill=s.chunked_prefill, prefill_chunk_tokens=s.prefill_chunk_tokens,
                enable_prefix_caching=s.enable_prefix_caching, kv_cache_dtype=s.kv_cache_dtype,
                replica_id=replica.replica_id, **extra)


def _build_echo(replica: "StartReplica", weights: Weights, **extra) -> "Engine":
    s = replica.settings
    echo = _engine_class("exaserve_hpc.engine.echo", "EchoEngine")
    return echo(max_batch_size=s.max_batch_size, max_seq_len=s.max_seq_len,
                **_options(replica, integers=("tokens_per_step",), floats=("step_delay",)))


def _build_reference(replica: "StartReplica", weights: Weights, **extra) -> "Engine":
    ReferenceEngine = _engine_class("exaserve_hpc.engine.reference", "ReferenceEngine")
    kwargs = _batching(replica, **_options(replica, integers=KV_OPTIONS), **extra)
    if isinstance(weights, tuple):
        return ReferenceEngine.from_weights(*weights, **kwargs)
    return ReferenceEngine(weights or replica.model_dir, **kwargs)


def _build_timing(replica: "StartReplica", weights: Weights, **extra) -> "Engine":
    timing = _engine_class("exaserve_hpc.engine.timing", "TimingEngine")
    return timing(**_batching(replica, **_options(replica, integers=KV_OPTIONS), **extra))


def reserved_bytes_per_device(replica: "StartReplica") -> int:
    """Bytes per device placement reserved for this replica: 0 when the controller gave no figure (then the
    agent's reservation is only its estimate from the checkpoint, no bound to size a KV pool by); else what
    the agent reserved for it (the figure rounded up to the pool's blocks, in the replica's environment,
    agent/replica_process.py), or the figure itself."""
    if not replica.memory_bytes:
        return 0
    try:
        return max(int(os.environ.get(RESERVED_ENV, "0")), replica.memory_bytes)
    except ValueError:
        return replica.memory_bytes


def _build_trtllm(replica: "StartReplica", weights: Weights, **extra) -> "Engine":
    TrtLlmEngine = _engine_class("exaserve_hpc.engine.trtllm_backend", "TrtLlmEngine")
    s = replica.settings
    options = _options(replica, integers=("block_size", "pipeline_parallel_size"), floats=("gpu_memory_utilization",))
    devices, pp = max(1, replica.devices), options.get("pipeline_parallel_size", 1)
    if devices % pp:
        raise ValueError(f"pipeline_parallel_size {pp} does not divide the replica's {devices} device(s)")
    return TrtLlmEngine(
        weights or replica.model_dir, tensor_parallel_size=devices // pp,
        max_batch_size=s.max_batch_size, max_seq_len=s.max_seq_len,
        enable_prefix_caching=s.enable_prefix_caching, kv_cache_dtype=s.kv_cache_dtype,
        chunked_prefill=s.chunked_prefill, prefill_chunk_tokens=s.prefill_chunk_tokens,
        reserved_bytes=reserved_bytes_per_device(replica) or None, replica_id=replica.replica_id,
        **options, **extra)


def _paged_site_options(site, model) -> dict[str, float]:
    """In precise prefix mode the router hashes prompts in router.block_size blocks: the engine's must match."""
    return {"block_size": site.router.block_size} if site.router.prefix_mode == "precise" else {}


def _trtllm_site_options(site, model) -> dict[str, float]:
    return {"gpu_memory_utilization": model.gpu_memory_utilization, **_paged_site_options(site, model)}


TRTLLM_INSTALL = "pip install 'exaserve-hpc[trtllm]'"
TRTLLM_NO_PIPELINE = (  # `config check` prints at most 300 characters of it
    "TensorRT-LLM runs a replica as one process on one node, but pipeline stages span nodes (reference "
    "engine only); use pipeline_parallel: 1, tensor_parallel <= cluster.gpus_per_node (a quantized "
    "checkpoint if it does not fit)")

ENGINES: dict[str, EngineSpec] = {spec.name: spec for spec in (
    EngineSpec("reference", _build_reference, needs_weights=True, loads_in_process=True, reads_tiny=True,
               kv_events=True, kv_snapshots=True, site_options=_paged_site_options, cpu_compute=True,
               summary="CPU numpy Llama, paged KV cache, prefix caching (the default)"),
    EngineSpec("echo", _build_echo, needs_weights=False, loads_in_process=False, reads_tiny=False,
               kv_events=False, kv_snapshots=False,
               summary="answers with the prompt: measures the serving path (benchmarks)"),
    EngineSpec("timing", _build_timing, needs_weights=False, loads_in_process=False, reads_tiny=False,
               kv_events=True, kv_snapshots=False, site_options=_paged_site_options,
               summary="the reference scheduler paced by a GPU cost model (benchmarks, simulator)"),
    EngineSpec("trtllm", _build_trtllm, needs_weights=True, loads_in_process=False, reads_tiny=False,
               kv_events=True, kv_snapshots=False, isolate_mpi=True, pipeline_refusal=TRTLLM_NO_PIPELINE,
               ignored_batching=("max_wait_ms", "prefill_batch_size", "decode_batch_size"),
               package="tensorrt_llm", install=TRTLLM_INSTALL,
               site_options=_trtllm_site_options, summary="TensorRT-LLM's LLM API on NVIDIA GPUs"),
)}

ENGINE_NAMES: tuple[str, ...] = tuple(ENGINES)


def engine_spec(name: str) -> EngineSpec:
    try:
        return ENGINES[name]
    except KeyError:
        raise UnknownEngine(f"engine {name!r} is unknown; choose one of {', '.join(ENGINE_NAMES)}") from None


def build_engine(replica: "StartReplica", weights: Weights = None, **extra) -> "Engine":
    """The replica's engine: EngineError naming the install command when its package is missing.

    ``extra``: keywords the replica adds for engines that take them (``kv_events_endpoint``).
    """
    spec = engine_spec(replica.settings.engine)
    if not spec.available():
        raise EngineError(spec.missing_package_message() + "; or choose another engine for this model")
    return spec.build(replica, weights, **extra)


def engine_publishes_kv_events(name: str) -> bool:
    return engine_spec(name).kv_events


def unavailable_engines(engines: list[str]) -> dict[str, str]:
    """Engine name -> why this machine cannot run it, for the named engines that cannot run here."""
    return {name: ENGINES[name].missing_package_message() for name in dict.fromkeys(engines)
            if name in ENGINES and not ENGINES[name].available()}


def engine_settings(site, model):
    """The EngineSettings a replica of ``model`` gets (config.SiteConfig, config.ModelConfig): the site's
    batching, the model's limits, and the options the site gives its engine."""
    b = site.batching
    return EngineSettings(
        engine=model.engine, max_batch_size=site.max_batch_size(model), max_seq_len=model.max_seq_len,
        max_wait_ms=b.max_wait_ms, prefill_batch_size=b.prefill_batch_size, decode_batch_size=b.decode_batch_size,
        chunked_prefill=b.chunked_prefill, prefill_chunk_tokens=b.prefill_chunk_tokens,
        enable_prefix_caching=model.enable_prefix_caching, kv_cache_dtype=model.kv_cache_dtype,
        options=engine_spec(model.engine).site_options(site, model))
