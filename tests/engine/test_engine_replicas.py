"""Every registered engine runs in a real replica process, started as the agent starts it, behind the real router.

trtllm: no GPU here, so the replica imports a stand-in `tensorrt_llm` (tests/engine/trtllm_standin, put on
PYTHONPATH by the test) that records the calls TensorRT-LLM's API would receive; the request still goes
gateway socket -> router -> replica process -> backend -> stream -> router -> gateway.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
import uuid
from pathlib import Path

import pytest
import zmq

from exaserve_hpc.agent.node_agent import spawn_replica
from exaserve_hpc.protocol import EngineSettings, GenerateRequest, RequestError, StartReplica, TokenChunk, decode, encode
from exaserve_hpc.router.balancing import RoundRobin
from exaserve_hpc.router.dispatch import Dispatcher, DispatchSettings
from exaserve_hpc.router.zmq_router import ZmqRouter

pytestmark = pytest.mark.process
STANDIN = Path(__file__).parent / "trtllm_standin"


@pytest.fixture
def router():
    dispatcher = Dispatcher(RoundRobin(), DispatchSettings(first_token_timeout=20, replica_expiry=5.0,
                                                           request_timeout=60), {"m"})
    r = ZmqRouter(dispatcher, context=zmq.Context()).start()
    yield r
    r.stop()
    r.context.destroy(linger=0)


def start(router: ZmqRouter, engine: str, model_dir: str = "-", devices: int = 1, **settings):
    spec = StartReplica(replica_id=f"m/{engine}-{uuid.uuid4().hex[:6]}", model="m", model_dir=model_dir,
                        router_backend=router.backend_endpoint, devices=devices, stats_interval=0.2,
                        settings=EngineSettings(engine=engine, max_batch_size=8, max_seq_len=256, **settings))
    return spawn_replica(spec, "test-node")


def status_lines(slot, until: str, timeout: float = 60.0) -> list[str]:
    """The replica's status lines, read from its pipe until one starts with `until` (or it exits)."""
    buffer, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = os.read(slot.status_fd, 65536)
        except BlockingIOError:
            chunk = None
        if chunk:
            buffer += chunk
        lines = buffer.decode().splitlines()
        if any(line.startswith(until) for line in lines) or (chunk == b"" and slot.process.poll() is not None):
            return lines
        time.sleep(0.02)
    raise AssertionError(f"no {until!r} line in time: {buffer.decode()}")


def generate(router: ZmqRouter, prompt: list[int], max_tokens: int, timeout: float = 60.0) -> tuple[list[int], TokenChunk]:
    deadline = time.monotonic() + timeout
    while not router.snapshot()["replicas"]:
        assert time.monotonic() < deadline, "no replica registered"
        time.sleep(0.05)
    gateway = router.context.socket(zmq.DEALER)
    gateway.setsockopt(zmq.LINGER, 0)
    gateway.connect(router.frontend_endpoint)
    try:
        rid = uuid.uuid4().hex
        gateway.send(encode(GenerateRequest(request_id=rid, model="m", prompt_token_ids=prompt, max_tokens=max_tokens,
                                            seed=7)))
        tokens: list[int] = []
        while time.monotonic() < deadline:
            if gateway.poll(100):
                message = decode(gateway.recv())
                assert not isinstance(message, RequestError), message
                tokens += message.token_ids
                if message.finished:
                    return tokens, message
        raise AssertionError(f"request not finished in time; tokens so far {tokens}")
    finally:
        gateway.close()


def stop(slot) -> None:
    if slot.process.poll() is None:
        slot.process.terminate()
    assert slot.process.wait(20) == 0


def test_a_timing_replica_serves_a_request_through_the_router(router):
    slot = start(router, "timing")
    try:
        tokens, final = generate(router, [256, 72, 105, 33], 12)
        assert len(tokens) == 12 and final.finish_reason == "length" and final.completion_tokens == 12
        assert bytes(tokens) == b"exaserve tim"  # the timing engine's filler
    finally:
        stop(slot)


def trtllm_checkpoint(path: Path, eos=(257,)) -> Path:
    """A Hugging Face config and generation config: the stand-in reads no weights."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2,
                                                  "num_attention_heads": 4, "num_key_value_heads": 2,
                                                  "hidden_size": 64, "torch_dtype": "bfloat16"}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(eos)}))
    return path


def test_trtllm_replica_drives_the_llm_api_and_streams_through_the_router(router, tmp_path, monkeypatch):
    record = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(STANDIN), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("TRTLLM_STANDIN_RECORD", str(record))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # the stand-in counts these: TP 2 needs two
    checkpoint = trtllm_checkpoint(tmp_path / "llama-hf", eos=(257, 41))
    slot = start(router, "trtllm", str(checkpoint), devices=2, kv_cache_dtype="fp8", prefill_chunk_tokens=128,
                 options={"gpu_memory_utilization": 0.5})
    try:
        prompt = [256, 10, 20, 30, 40]
        tokens, final = generate(router, prompt, 6)
        assert tokens == [1, 11, 21, 31] and final.finish_reason == "stop"  # 41: the model's second EOS id
        tokens, final = generate(router, [256, 10, 20], 6)
        assert tokens == [1, 11, 21, 32, 32, 32] and final.finish_reason == "length"
    finally:
        stop(slot)
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    kinds = [c["call"] for c in calls]
    llm = calls[kinds.index("LLM")]
    assert llm == {"call": "LLM", "model": str(checkpoint), "skip_tokenizer_init": True, "tensor_parallel_size": 2,
                   "max_batch_size": 8, "max_seq_len": 256, "enable_chunked_prefill": True,
                   "max_num_tokens": 128 + 8,
                   # the non-defaults: and the event buffer, since a replica publishes KV events
                   "kv_cache_config": {"dtype": "fp8", "free_gpu_memory_fraction": 0.5, "event_buffer_max_size": 16384}}
    assert kinds.index("LLM") < kinds.index("generate") < kinds.index("generate_async")  # warm-up before serving
    streamed = [c for c in calls if c["call"] == "generate_async" and c["streaming"]][0]
    assert streamed == {"call": "generate_async", "inputs": prompt, "streaming": True}
    params = [c for c in calls if c["call"] == "SamplingParams"][-1]
    assert params == {"call": "SamplingParams", "end_id": 257, "max_tokens": 6, "stop_token_ids": [257, 41],
                      "top_k": 1, "seed": 7, "ignore_eos": False, "detokenize": False}
    assert kinds[-1] == "shutdown"  # the drained replica closed the LLM


def test_trtllm_replica_kv_events_steer_the_routers_precise_mode(tmp_path, monkeypatch):
    """A real trtllm replica process (the stand-in's TensorRT-LLM, its KV events in the real format) behind a
    router in precise prefix mode: the router's index holds the prompt's blocks, named as it hashes them."""
    from exaserve_hpc.router.affinity import AffinitySettings, PrefixAffinity
    from exaserve_hpc.router.prefix_index import EngineBlockHasher

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(STANDIN), os.environ.get("PYTHONPATH", "")]))
    policy = PrefixAffinity(AffinitySettings(mode="precise", block_size=16), compiled=False)
    dispatcher = Dispatcher(policy, DispatchSettings(first_token_timeout=20, replica_expiry=5.0, request_timeout=60),
                            {"m"})
    precise = ZmqRouter(dispatcher, context=zmq.Context()).start()
    slot = start(precise, "trtllm", str(trtllm_checkpoint(tmp_path / "m")), options={"block_size": 16})
    try:
        prompt = list(range(300, 340))  # two whole blocks of 16, and a part
        generate(precise, prompt, 2)
        hashes = EngineBlockHasher(16)(prompt)
        deadline = time.monotonic() + 20
        while not all(policy.index.holders(h) == [slot.spec.replica_id] for h in hashes):
            assert time.monotonic() < deadline, [policy.index.holders(h) for h in hashes]
            generate(precise, [7, 8, 9], 1)  # TensorRT-LLM hands out events after each new request
            time.sleep(0.1)
    finally:
        stop(slot)
        precise.stop()
        precise.context.destroy(linger=0)


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None, reason="tensorrt_llm is installed here")
def test_without_tensorrt_llm_a_trtllm_replica_fails_naming_the_install(router, tmp_path):
    slot = start(router, "trtllm", str(tmp_path))
    lines = status_lines(slot, "failed")
    failed = [line for line in lines if line.startswith("failed")]
    assert failed and "pip install 'exaserve-hpc[trtllm]'" in failed[0] and "tensorrt_llm" in failed[0], lines
    assert not any(line.startswith("loading") for line in lines)  # refused before reading any weights
    assert slot.process.wait(20) == 1


def test_the_agent_stages_a_trtllm_checkpoint_in_l2_and_reserves_from_its_size(tmp_path, monkeypatch):
    """Through a real node agent: the registry says trtllm needs weights read by the engine itself, so the
    agent copies the checkpoint L3 -> L2 and TensorRT-LLM is pointed at the L2 copy, not at L3."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "agent"))
    from agent_harness import TINY, AgentUnderTest
    from exaserve_hpc.cache.checkpoint import create_tiny_checkpoint
    from exaserve_hpc.cache.l3_store import manifest_bytes

    record = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(STANDIN), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("TRTLLM_STANDIN_RECORD", str(record))
    checkpoint = create_tiny_checkpoint(tmp_path / "l3" / "hf-model", TINY)  # a Hugging Face checkpoint
    agent = AgentUnderTest(tmp_path, block_size=1 << 10)
    try:
        agent.start("t0", checkpoint, engine="trtllm")
        agent.wait_state("t0", "serving")
        beat = agent.settle(lambda b: b.memory is not None and "t0" in b.memory.reservations)
        assert beat.memory.reservations["t0"] >= manifest_bytes(checkpoint) * 1.25
        assert [s.load_source for s in beat.replicas] == ["l3"]  # the agent's fill, then the replica reads L2
        llm = next(json.loads(line) for line in record.read_text().splitlines() if '"call": "LLM"' in line)
        assert Path(llm["model"]).is_relative_to(tmp_path / "l2") and Path(llm["model"]).is_dir()
        agent.stop("t0")
        agent.wait_terminal("t0")
    finally:
        agent.close()
