"""The stand-in's ``tensorrt_llm.executor``: GenerationResult and the loop test it makes at creation."""

from .result import CompletionOutput, GenerationResult

__all__ = ["CompletionOutput", "GenerationResult"]
