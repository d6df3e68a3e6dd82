"""The engine registry: one table from which the config, the replica's factory and the agent's sizing derive."""

from __future__ import annotations

import sys

import pytest

from exaserve_hpc.engine.base import Engine, EngineError
from exaserve_hpc.engine.registry import (
    ENGINE_NAMES, ENGINES, TRTLLM_INSTALL, UnknownEngine, build_engine, engine_settings, engine_spec,
    unavailable_engines
)
from exaserve_hpc.protocol import EngineSettings, StartReplica


def replica(engine: str, **options) -> StartReplica:
    return StartReplica(replica_id=f"{engine}/r0", model="m", model_dir="/nonexistent", router_backend="tcp://x:1",
                        settings=EngineSettings(engine=engine, max_batch_size=4, max_seq_len=128, options=options))


def test_every_engine_is_in_the_table_once_with_its_traits():
    assert set(ENGINE_NAMES) == {"reference", "echo", "timing", "trtllm"}
    assert [n for n in ENGINE_NAMES if ENGINES[n].needs_weights] == ["reference", "trtllm"]
    assert ENGINES["trtllm"].package == "tensorrt_llm" and ENGINES["trtllm"].install == TRTLLM_INSTALL
    assert ENGINES["reference"].loads_in_process and not ENGINES["trtllm"].loads_in_process
    with pytest.raises(UnknownEngine, match="engine 'vllm' is unknown; choose one of reference, echo, timing, trtllm"):
        engine_spec("vllm")


def test_weightless_engines_reserve_nothing_and_build_without_a_checkpoint():
    for name in ("echo", "timing"):
        spec = replica(name)
        assert engine_spec(name).memory_bytes(spec) == 0
        engine = build_engine(spec)
        assert isinstance(engine, Engine)
        engine.warmup()
        engine.shutdown()


def test_options_are_typed_per_engine_and_unknown_ones_refused():
    echo = build_engine(replica("echo", tokens_per_step=3.0, step_delay=0.0))
    assert echo.tokens_per_step == 3 and isinstance(echo.tokens_per_step, int)
    timing = build_engine(replica("timing", block_size=8.0, num_kv_blocks=64.0))
    assert (timing.blocks.block_size, timing.blocks.num_blocks) == (8, 64)
    with pytest.raises(ValueError, match="engine 'timing' takes no option tokens_per_step; its options: block_size"):
        build_engine(replica("timing", tokens_per_step=1.0))


def test_an_engine_whose_package_is_missing_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None if name == "tensorrt_llm" else object())
    assert not engine_spec("trtllm").available()
    with pytest.raises(EngineError, match=r"pip install 'exaserve-hpc\[trtllm\]'"):
        build_engine(replica("trtllm"))
    assert list(unavailable_engines(["reference", "trtllm", "trtllm"])) == ["trtllm"]


def test_config_allows_the_registry_engines_and_check_warns_for_a_missing_package(monkeypatch, capsys):
    from exaserve_hpc.cli import main as cli
    from exaserve_hpc.config.schema import ConfigError, parse_site

    with pytest.raises(ConfigError, match="allowed: 'reference', 'echo', 'timing' or 'trtllm'"):
        parse_site({"site": "x", "models": [{"model_name": "a", "engine": "vllm"}]})
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None if name == "tensorrt_llm" else object())
    site = parse_site({"site": "x", "models": [{"model_name": "a", "engine": "trtllm"},
                                               {"model_name": "b", "engine": "reference"}]})
    assert site.engine_warnings() == [f"models[0].engine: {ENGINES['trtllm'].missing_package_message()} (model a)"]
    assert cli.main(["config", "check", "small16-a100"]) == 0  # a warning, not a failure
    captured = capsys.readouterr()
    assert "small16-a100: ok" in captured.out
    assert "warning: models[0].engine: engine 'trtllm' needs the Python package 'tensorrt_llm'" in captured.err
    assert TRTLLM_INSTALL in captured.err


def test_engine_settings_carry_the_site_into_what_each_engine_takes():
    from exaserve_hpc.config.schema import parse_site
    site = parse_site({"site": "x", "batching": {"max_batch_size": 16, "prefill_chunk_tokens": 256},
                       "router": {"policy": "prefix_affinity", "prefix_mode": "precise", "block_size": 32},
                       "models": [{"model_name": "a", "engine": "reference", "max_seq_len": 512},
                                  {"model_name": "b", "engine": "trtllm", "gpu_memory_utilization": 0.4},
                                  {"model_name": "c", "engine": "echo"}]})
    ref, trt, echo = (engine_settings(site, m) for m in site.models)
    assert (ref.engine, ref.max_batch_size, ref.max_seq_len, ref.prefill_chunk_tokens) == ("reference", 16, 512, 256)
    assert ref.options == {"block_size": 32}  # precise mode: the engine's KV blocks are the router's
    assert trt.options == {"gpu_memory_utilization": 0.4, "block_size": 32} and echo.options == {}  # TRT-LLM's too
    timing = StartReplica(replica_id="t", model="a", model_dir="-", router_backend="tcp://x:1",
                          settings=EngineSettings(engine="timing", options=ref.options))
    assert build_engine(timing).blocks.block_size == 32
    approximate = parse_site({"site": "x", "models": [{"model_name": "a"}]})
    assert engine_settings(approximate, approximate.models[0]).options == {}
    assert [n for n in ENGINE_NAMES if ENGINES[n].kv_snapshots] == ["reference"]


def test_a_replica_publishes_kv_events_where_its_router_can_subscribe(monkeypatch):
    from exaserve_hpc.engine.kv_publisher import kv_events_announced, kv_events_bind
    assert kv_events_bind("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:*"
    assert kv_events_bind("tcp://localhost:5555") == "tcp://127.0.0.1:*"
    assert kv_events_bind("tcp://[::1]:5555") == "tcp://[::1]:*"
    assert kv_events_bind("tcp://node17.cluster:5555") == "tcp://*:*"  # the router is on another node
    monkeypatch.setattr("socket.getfqdn", lambda: "node3.cluster")
    assert kv_events_announced("tcp://0.0.0.0:41234") == "tcp://node3.cluster:41234"
    assert kv_events_announced("tcp://127.0.0.1:41234") == "tcp://127.0.0.1:41234"


def test_config_check_warns_when_precise_mode_meets_an_engine_without_kv_events():
    from exaserve_hpc.config.schema import parse_site
    site = parse_site({"site": "x", "router": {"policy": "prefix_affinity", "prefix_mode": "precise"},
                       "models": [{"model_name": "a", "engine": "reference"}, {"model_name": "b", "engine": "echo"}]})
    assert site.engine_warnings() == ["models[1].engine: echo publishes no KV events, so router.prefix_mode precise "
                                      "routes model b by load only"]
    approximate = parse_site({"site": "x", "models": [{"model_name": "b", "engine": "echo"}]})
    assert approximate.engine_warnings() == []
