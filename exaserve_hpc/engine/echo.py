"""An engine that answers with the request's own prompt: no model, no arithmetic.

Benchmarks use it so their figures measure the serving path (gateway, router,
ZeroMQ, replica loop) and not a model. It speaks the same step protocol as the
reference engine (see engine/base.py).
"""

from __future__ import annotations

import time
from collections import OrderedDict

from exaserve_hpc.engine.base import EngineError, EngineRequest, StepOutput
from exaserve_hpc.engine.tokenizer import BOS, EOS


class EchoEngine:
    def __init__(self, *, max_batch_size: int = 32, max_seq_len: int = 2048, tokens_per_step: int = 16,
                 step_delay: float = 0.0):
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.tokens_per_step = int(tokens_per_step)
        self.step_delay = step_delay  # seconds per step: lets tests hold a stream open
        self._running: "OrderedDict[str, tuple[EngineRequest, list[int], int]]" = OrderedDict()
        self._finished = 0
        self._generated = 0

    def add_request(self, request: EngineRequest) -> None:
        total = len(request.prompt_token_ids) + request.max_tokens
        if total > self.max_seq_len:
            raise ValueError(f"prompt ({len(request.prompt_token_ids)} tokens) + max_tokens ({request.max_tokens}) "
                             f"= {total} exceeds max_seq_len {self.max_seq_len}")
        answer = [t for t in request.prompt_token_ids if t not in (BOS, EOS)] or [ord(" ")]
        self._running[request.request_id] = (request, answer, 0)

    def abort(self, request_id: str) -> None:
        self._running.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self._running)

    def step(self) -> list[StepOutput]:
        if self.step_delay:
            time.sleep(self.step_delay)
        outputs = []
        for rid in list(self._running)[: self.max_batch_size]:
            request, answer, done = self._running[rid]
            n = min(self.tokens_per_step, request.max_tokens - done)
            tokens = [answer[(done + i) % len(answer)] for i in range(n)]
            done += n
            finished = done >= request.max_tokens
            if finished:
                del self._running[rid]
                self._finished += 1
            else:
                self._running[rid] = (request, answer, done)
            self._generated += n
            outputs.append(StepOutput(request_id=rid, new_token_ids=tokens, finished=finished,
                                      finish_reason="length" if finished else None,
                                      prompt_tokens=len(request.prompt_token_ids), completion_tokens=done))
        return outputs

    def stats(self) -> dict:
        return {"queue_depth": max(0, len(self._running) - self.max_batch_size),
                "running": min(len(self._running), self.max_batch_size),
                "tokens_generated": self._generated, "requests_finished": self._finished}

    def warmup(self) -> None:
        self.add_request(EngineRequest(request_id="warmup", prompt_token_ids=[BOS, 104, 105], max_tokens=2))
        tokens: list[int] = []
        for _ in range(4):
            for output in self.step():
                tokens += output.new_token_ids
            if not self.has_unfinished():
                break
        if tokens != [104, 105]:
            raise EngineError(f"echo engine warm-up returned tokens {tokens}, expected [104, 105]")

    def shutdown(self) -> None:
        self._running.clear()
