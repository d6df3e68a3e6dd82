"""The stand-in's ``tensorrt_llm.llmapi``: LLM, SamplingParams, KvCacheConfig (what exaserve imports)."""

from ._llm import LLM
from ._llm_args import KvCacheConfig, TorchLlmArgs
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "KvCacheConfig", "TorchLlmArgs"]
