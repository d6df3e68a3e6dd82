"""A stand-in for TensorRT-LLM's LLM API, for tests on machines without a GPU.

It has the names and call shapes exaserve's backend uses (``LLM(**kwargs)``,
``LLM.generate``, streaming ``LLM.generate_async``, ``SamplingParams``,
``llmapi.KvCacheConfig``) and appends every call, with the arguments it got,
as one JSON line to the file named by $TRTLLM_STANDIN_RECORD. Its "model"
answers each prompt with the prompt's own tokens, shifted by one, streamed
one token at a time as cumulative outputs (what GenerationResult yields).
"""

from __future__ import annotations

import asyncio
import json
import os
from types import SimpleNamespace


def _record(call: str, **fields) -> None:
    with open(os.environ["TRTLLM_STANDIN_RECORD"], "a") as f:
        f.write(json.dumps({"call": call, **fields}, default=lambda o: vars(o)) + "\n")


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)
        _record("SamplingParams", **kwargs)


class _Stream:
    def __init__(self, prompt, params):
        self.params, self.cancelled = params, False
        self.tokens = [(t + 1) % 256 for t in prompt][: params.max_tokens]
        self.tokens += [32] * (params.max_tokens - len(self.tokens))

    def abort(self):
        _record("abort")
        self.cancelled = True

    async def __aiter__(self):
        stops = set(getattr(self.params, "stop_token_ids", None) or ())
        for n in range(1, len(self.tokens) + 1):
            await asyncio.sleep(0.001)
            if self.cancelled:
                yield SimpleNamespace(finished=True, outputs=[SimpleNamespace(
                    token_ids=self.tokens[:n - 1], finish_reason="cancelled")])
                return
            ids = self.tokens[:n]
            stop = ids[-1] in stops
            done = stop or n == len(self.tokens)
            yield SimpleNamespace(finished=done, outputs=[SimpleNamespace(
                token_ids=ids, finish_reason=("stop" if stop else "length") if done else None)])
            if done:
                return


class LLM:
    def __init__(self, **kwargs):
        _record("LLM", **kwargs)

    def generate(self, prompts, sampling_params=None):
        _record("generate", prompts=prompts)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[(t + 1) % 256 for t in p][:4])])
                for p in prompts]

    def generate_async(self, inputs, sampling_params=None, streaming=False):
        _record("generate_async", inputs=inputs, streaming=streaming)
        return _Stream(inputs, sampling_params)

    def shutdown(self):
        _record("shutdown")
