"""The stand-in's ``tensorrt_llm.llmapi``: KvCacheConfig keeps its keyword arguments (recorded with LLM's)."""


class KvCacheConfig:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)
