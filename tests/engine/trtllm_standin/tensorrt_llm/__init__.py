"""A stand-in for TensorRT-LLM's LLM API (1.2.x, PyTorch backend), for tests on machines without a GPU.

It refuses what the real library refuses where exaserve's backend depends on it; each rule is stated,
with the real file behind it, in the module that enforces it:

- executor/result.py      the asyncio-queue rule of GenerationResult (the reason a result must be made on
                          the loop that reads it), finish reasons, stop-id trimming, abort()
- sampling_params.py      SamplingParams' exact keywords and construction checks; binding types
- _llm_args.py            KvCacheConfig / LLM keyword arguments: pydantic, unknown names refused
- _llm.py                 LLM: generate / generate_async / abort / shutdown / get_kv_cache_events, and
                          the KV-event format (tensorrt_llm/_utils.py KVCacheEventSerializer)

Its "model" answers each prompt with the prompt's own tokens shifted by one (mod 256), then 32s, one token
per executor iteration, in a thread of its own as TensorRT-LLM's executor runs in its own workers. Every
call is appended as one JSON line to $TRTLLM_STANDIN_RECORD when that is set.
"""

from .llmapi import LLM, KvCacheConfig, SamplingParams
from .version import __version__

__all__ = ["LLM", "SamplingParams", "KvCacheConfig", "__version__"]
