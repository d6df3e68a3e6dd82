"""The stand-in's argument models: tensorrt_llm/llmapi/llm_args.py's KvCacheConfig and TorchLlmArgs.

Both real classes derive from ``StrictBaseModel`` (pydantic, ``extra = "forbid"``): an unknown keyword is a
pydantic ValidationError ("Extra inputs are not permitted"), a value of the wrong type one too (pydantic's
lax mode: "0.5" becomes 0.5, "many" does not). KvCacheConfig validates ``free_gpu_memory_fraction`` in
[0, 1] ("kv_cache_config.free_gpu_memory_fraction must be a float between 0 and 1") and
``max_gpu_total_bytes`` >= 0. Fields listed are real ones; real fields exaserve never sets are left out
(the stand-in refuses them, which only makes it stricter).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator


class StrictBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)


class KvCacheConfig(StrictBaseModel):
    enable_block_reuse: bool = True
    max_tokens: Optional[int] = None            # min'd with the fraction's memory (KvCacheCreator, _util.py)
    max_attention_window: Optional[list[int]] = None
    sink_token_length: Optional[int] = None
    free_gpu_memory_fraction: Optional[float] = 0.9
    host_cache_size: Optional[int] = None
    onboard_blocks: bool = True
    cross_kv_cache_fraction: Optional[float] = None
    secondary_offload_min_priority: Optional[int] = None
    event_buffer_max_size: int = 0              # 0: no KV events
    attention_dp_events_gather_period_ms: int = 5
    enable_partial_reuse: bool = True
    copy_on_partial_reuse: bool = True
    use_uvm: bool = False
    max_gpu_total_bytes: int = 0
    dtype: str = "auto"
    tokens_per_block: int = 32

    @field_validator("free_gpu_memory_fraction")
    @classmethod
    def _fraction(cls, v):
        if v is not None and not 0 <= v <= 1:
            raise ValueError("kv_cache_config.free_gpu_memory_fraction must be a float between 0 and 1")
        return v

    @field_validator("max_gpu_total_bytes")
    @classmethod
    def _bytes(cls, v):
        if v < 0:
            raise ValueError("kv_cache_config.max_gpu_total_bytes must be non-negative")
        return v


class TorchLlmArgs(StrictBaseModel):
    # BaseLlmArgs' explicit arguments (the LLM constructor's named parameters)
    model: Union[str, Path]
    tokenizer: Optional[Union[str, Path]] = None
    tokenizer_mode: Literal["auto", "slow"] = "auto"
    skip_tokenizer_init: bool = False
    trust_remote_code: bool = False
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    revision: Optional[str] = None
    tokenizer_revision: Optional[str] = None
    # the rest (keyword arguments)
    pipeline_parallel_size: int = 1
    context_parallel_size: int = 1
    gpus_per_node: Optional[int] = None
    moe_tensor_parallel_size: Optional[int] = None
    moe_expert_parallel_size: Optional[int] = None
    enable_attention_dp: bool = False
    load_format: Literal["auto", "dummy"] = "auto"
    kv_cache_config: KvCacheConfig = Field(default_factory=KvCacheConfig)
    enable_chunked_prefill: bool = False
    max_batch_size: Optional[int] = None
    max_input_len: Optional[int] = None
    max_seq_len: Optional[int] = None
    max_beam_width: Optional[int] = None
    max_num_tokens: Optional[int] = 8192
    num_postprocess_workers: int = 0
    backend: Optional[str] = None
    return_perf_metrics: bool = False
    orchestrator_type: Optional[Literal["rpc", "ray"]] = None
    # TorchLlmArgs' own
    disable_overlap_scheduler: bool = False
    enable_iter_perf_stats: bool = False
    print_iter_log: bool = False
    batch_wait_timeout_ms: float = 0
    batch_wait_timeout_iters: int = 0
    stream_interval: int = 1
