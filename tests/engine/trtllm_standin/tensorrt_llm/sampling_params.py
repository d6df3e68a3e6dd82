"""The stand-in's SamplingParams: tensorrt_llm/sampling_params.py's fields and construction rules.

The real class is ``@dataclass(slots=True, kw_only=True)``: a keyword it does not have (``random_seed``, the
C++ SamplingConfig's old name, ``stop_ids``, ...) raises TypeError ("__init__() got an unexpected keyword
argument"), positional arguments raise TypeError, and no attribute can be added afterwards. ``__post_init__``
sets ``pad_id = end_id`` when unset and ``best_of = best_of or n``, then ``_validate``. The field list is the
real one's public fields (1.x); private fields and tensor/processor types are omitted.

Stop semantics the backend relies on (same file): ``end_id`` is ONE id (None: the LLM fills it from its
tokenizer in ``_setup``, and ``LLM._prepare_sampling_params`` raises when there is no tokenizer);
``stop_token_ids`` is a list of ids, each a one-token stop word (``_get_stop_words``); ``ignore_eos``
makes the request's end_id -1 (tensorrt_llm/executor/base_worker.py ``_enqueue_request``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Optional, Union


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    end_id: Optional[int] = None
    pad_id: Optional[int] = None
    max_tokens: int = 32
    bad: Optional[Union[str, List[str]]] = None
    bad_token_ids: Optional[List[int]] = None
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    include_stop_str_in_output: bool = False
    embedding_bias: Any = None
    logits_processor: Any = None
    apply_batched_logits_processor: bool = False
    n: int = 1
    best_of: Optional[int] = None
    use_beam_search: bool = False
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    top_p_min: Optional[float] = None
    top_p_reset_ids: Optional[int] = None
    top_p_decay: Optional[float] = None
    seed: Optional[int] = None
    temperature: Optional[float] = None
    min_tokens: Optional[int] = None
    beam_search_diversity_rate: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    length_penalty: Optional[float] = None
    early_stopping: Optional[int] = None
    no_repeat_ngram_size: Optional[int] = None
    min_p: Optional[float] = None
    beam_width_array: Optional[List[int]] = None
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = True
    return_encoder_output: bool = False
    return_perf_metrics: bool = False
    additional_model_outputs: Any = None
    lookahead_config: Any = None
    guided_decoding: Any = None
    ignore_eos: bool = False
    detokenize: bool = True
    add_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.pad_id is None:
            self.pad_id = self.end_id
        self.best_of = self.best_of or self.n
        self._validate()

    def _validate(self) -> None:
        if self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) cannot be less than n ({self.n})")
        if self.best_of > 1 and self._greedy_decoding and not os.environ.get("TLLM_ALLOW_N_GREEDY_DECODING"):
            raise ValueError(f"Greedy decoding in the LLM API does not allow multiple returns. Please set to "
                             f"best_of=1, got best_of={self.best_of}.")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ValueError(f"truncate_prompt_tokens must be >= 1, got {self.truncate_prompt_tokens}")

    @property
    def _greedy_decoding(self) -> bool:
        return (not self.use_beam_search and (self.top_k is None or self.top_k == 1)
                and (self.top_p is None or self.top_p == 0.0))


# What the C++ binding objects the request is converted into accept (SamplingConfig, Request): pybind
# refuses other types with TypeError ("incompatible constructor arguments") when the request is enqueued
# (tensorrt_llm/executor/base_worker.py builds tllm.Request from these fields).
_BINDING_TYPES = {
    "end_id": (int,), "pad_id": (int,), "max_tokens": (int,), "top_k": (int,), "seed": (int,),
    "top_p": (float, int), "temperature": (float, int), "min_p": (float, int),
}


def check_binding_types(params: SamplingParams) -> None:
    for name, types in _BINDING_TYPES.items():
        value = getattr(params, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            raise TypeError(f"incompatible constructor arguments: SamplingParams.{name}={value!r} "
                            f"({type(value).__name__})")
    for name in ("stop_token_ids", "bad_token_ids"):
        value = getattr(params, name)
        if value is not None and (not isinstance(value, list)
                                  or not all(isinstance(i, int) and not isinstance(i, bool) for i in value)):
            raise TypeError(f"incompatible constructor arguments: SamplingParams.{name} must be a list of "
                            f"int, got {value!r}")
