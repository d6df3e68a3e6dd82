"""`exaserve config check` and TensorRT-LLM: what the backend cannot start is refused, naming why; what it does
not apply is named; the shipped GPU sites pass and their trtllm replicas would start (arguments the
stand-in's copy of TensorRT-LLM's argument models accept, a KV pool that fits each placement reservation)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from exaserve_hpc.config.schema import ConfigError, load_site, parse_site
from exaserve_hpc.engine.registry import engine_settings
from exaserve_hpc.engine.trtllm_backend import ACTIVATION_RESERVE, ACTIVATION_RESERVE_MIN, llm_args

SITES = Path(__file__).resolve().parents[2] / "site-configs"
STANDIN = Path(__file__).resolve().parents[1] / "engine" / "trtllm_standin"
GPU_SITE = {"cluster": {"nodes": 2, "gpus_per_node": 8, "gpu_memory": "80GiB"}}


def site(models, **extra):
    return parse_site({"site": "x", **GPU_SITE, "models": models, **extra})


def test_pipeline_parallel_with_trtllm_is_refused_naming_why():
    with pytest.raises(ConfigError) as info:
        site([{"model_name": "big", "engine": "trtllm", "tensor_parallel": 8, "pipeline_parallel": 2}])
    text = str(info.value)
    assert "models[0]" in text and "pipeline_parallel 2 with engine trtllm" in text
    assert "one process on one node" in text and "pipeline_parallel: 1" in text
    site([{"model_name": "big", "engine": "reference", "pipeline_parallel": 2}])  # the reference engine runs stages


def test_trtllm_tensor_parallel_beyond_one_node_is_refused():
    with pytest.raises(ConfigError, match="tensor_parallel 16 with engine trtllm needs 16 GPUs on one node"):
        site([{"model_name": "big", "engine": "trtllm", "tensor_parallel": 16}])


def test_precise_mode_needs_trtllm_blocks_of_a_power_of_two():
    router = {"policy": "prefix_affinity", "prefix_mode": "precise", "block_size": 24}
    with pytest.raises(ConfigError, match="router.block_size 24 is not a power of two"):
        site([{"model_name": "m", "engine": "trtllm"}], router=router)
    site([{"model_name": "m", "engine": "reference"}], router=router)  # the reference engine takes any size
    ok = site([{"model_name": "m", "engine": "trtllm"}], router={**router, "block_size": 32})
    assert engine_settings(ok, ok.models[0]).options["block_size"] == 32  # TRT-LLM's tokens_per_block
    assert not [w for w in ok.engine_warnings() if "KV events" in w]  # trtllm publishes them now


def test_batching_knobs_trtllm_lacks_are_named():
    plain = site([{"model_name": "m", "engine": "trtllm"}])
    assert not [w for w in plain.engine_warnings() if w.startswith("batching.")]  # the defaults: nothing asked
    tuned = site([{"model_name": "m", "engine": "trtllm"}, {"model_name": "r", "engine": "reference"}],
                 batching={"max_wait_ms": 5, "decode_batch_size": 32, "max_batch_size": 64})
    (warning,) = [w for w in tuned.engine_warnings() if w.startswith("batching.")]
    assert warning.startswith("batching.max_wait_ms, batching.decode_batch_size: not applied to trtllm replicas "
                              "(models m)")


@pytest.mark.parametrize("name", ["small16-a100", "exa256-a100"])
def test_shipped_gpu_sites_pass_config_check_and_their_trtllm_replicas_would_start(name, monkeypatch):
    checked = subprocess.run([sys.executable, "-m", "exaserve_hpc.cli", "config", "check", name],
                             capture_output=True, text=True)
    assert checked.returncode == 0 and f"{name}: ok" in checked.stdout, checked.stderr
    gpu_site = load_site(SITES / f"{name}.yaml")
    monkeypatch.syspath_prepend(str(STANDIN))
    from tensorrt_llm.llmapi import KvCacheConfig, TorchLlmArgs  # the stand-in's copies of the real models

    for model in gpu_site.models:
        assert model.engine == "trtllm" and model.pipeline_parallel == 1
        s = engine_settings(gpu_site, model)
        args = llm_args(f"/models/{model.model_name}", tensor_parallel_size=model.tensor_parallel,
                        max_batch_size=s.max_batch_size, max_seq_len=s.max_seq_len,
                        enable_prefix_caching=s.enable_prefix_caching, kv_cache_dtype=s.kv_cache_dtype,
                        chunked_prefill=s.chunked_prefill, prefill_chunk_tokens=s.prefill_chunk_tokens,
                        kv_max_tokens=s.max_seq_len, kv_events=True, **s.options)
        TorchLlmArgs(**{**args, "kv_cache_config": KvCacheConfig(**args["kv_cache_config"])})
        # placement reserves gpu_memory_utilization of each GPU (controller/catalogue.py); the engine's KV pool
        # (trtllm_backend.kv_token_budget) must hold at least one max_seq_len sequence in what is left
        reserved = int(model.gpu_memory_utilization * gpu_site.cluster.gpu_memory)
        tp = model.tensor_parallel
        left = reserved - model.weight_bytes // tp - max(ACTIVATION_RESERVE_MIN, int(ACTIVATION_RESERVE * reserved))
        assert left // (model.kv_bytes_per_token // tp) >= model.max_seq_len, model.model_name
    for mod in [m for m in sys.modules if m == "tensorrt_llm" or m.startswith("tensorrt_llm.")]:
        del sys.modules[mod]
