"""The asynchronous engine face: concurrent submits, early close aborts, drain, errors."""

from __future__ import annotations

import asyncio

import pytest

from exaserve_hpc.cache.checkpoint import TinyModelSpec, create_tiny_checkpoint
from exaserve_hpc.engine.async_engine import AsyncEngine
from exaserve_hpc.engine.base import EngineError, EngineRequest
from exaserve_hpc.engine.echo import EchoEngine
from exaserve_hpc.engine.reference import ReferenceEngine


def req(rid: str, prompt=(256, 72, 105), max_tokens: int = 6) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=list(prompt), max_tokens=max_tokens)


async def collect(engine: AsyncEngine, request: EngineRequest) -> list[int]:
    tokens = []
    async for output in engine.submit(request):
        tokens += output.new_token_ids
    return tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return create_tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny", TinyModelSpec())


def test_concurrent_submits_match_the_step_engine(model_dir):
    async def main():
        engine = AsyncEngine(ReferenceEngine(model_dir, max_wait_ms=0))
        engine.warmup()
        engine.start()
        prompts = [(256, 65 + i, 66, 67) for i in range(5)]
        results = await asyncio.gather(*(collect(engine, req(f"r{i}", p, 8)) for i, p in enumerate(prompts)))
        await engine.shutdown()
        return prompts, results

    prompts, results = asyncio.run(main())
    reference = ReferenceEngine(model_dir, max_wait_ms=0)
    for prompt, got in zip(prompts, results):
        reference.add_request(req("solo", prompt, 8))
        expected = []
        while reference.has_unfinished():
            for out in reference.step():
                expected += out.new_token_ids
        assert got == expected


def test_closing_the_iterator_aborts_and_drain_waits():
    async def main():
        echo = EchoEngine(tokens_per_step=1, step_delay=0.005, max_seq_len=4096)
        engine = AsyncEngine(echo).start()
        stream = engine.submit(req("long", max_tokens=1000))
        first = await stream.__anext__()
        await stream.aclose()
        for _ in range(100):
            if not echo.has_unfinished():
                break
            await asyncio.sleep(0.01)
        aborted_early = not echo.has_unfinished()
        short = asyncio.ensure_future(collect(engine, req("short", max_tokens=5)))
        await asyncio.sleep(0.01)
        left = await engine.drain(timeout=5)
        tokens = await short
        with pytest.raises(EngineError, match="draining"):
            await collect(engine, req("late"))
        await engine.shutdown()
        return first, aborted_early, left, tokens

    first, aborted_early, left, tokens = asyncio.run(main())
    assert first.new_token_ids and aborted_early
    assert left == 0 and len(tokens) == 5


def test_a_request_the_engine_refuses_raises_in_the_caller():
    async def main():
        engine = AsyncEngine(EchoEngine(max_seq_len=16)).start()
        try:
            await collect(engine, req("big", prompt=[256] * 10, max_tokens=10))
        finally:
            await engine.shutdown()

    with pytest.raises(ValueError, match="max_seq_len 16"):
        asyncio.run(main())
