"""The reference engine against Hugging Face transformers on tiny random Llama-3, Mistral and Qwen2 checkpoints.

The checkpoints and golden logits were written by transformers itself
(tests/fixtures/hf/make_golden.py, run once where torch installs; CI has no torch):
Llama-3 with llama3 rope scaling and fp32 weights, Mistral with bf16 weights,
Qwen2 with q/k/v biases and tied embeddings. The logits compared are at the
prompt's last position and after each of 16 greedy tokens; transformers ran in
float32, so the bound is 1e-3 (issue 23).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from exaserve_hpc.cache.checkpoint import CheckpointError, ChecksumError, load_checkpoint, write_manifest
from exaserve_hpc.cache.hf_format import internal_config, rope_inv_freq
from exaserve_hpc.engine.base import EngineRequest
from exaserve_hpc.engine.model import LlamaModel
from exaserve_hpc.engine.reference import ReferenceEngine

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "hf"
FAMILIES = ("llama3", "mistral", "qwen2")
GOLDEN = json.loads((FIXTURES / "golden.json").read_text())["families"]
LOGITS = load_file(str(FIXTURES / "golden_logits.safetensors"))
TOLERANCE = 1e-3


def golden_rows(family: str) -> np.ndarray:
    """[17, vocab]: the prompt's last logits, then the logits after each greedy token."""
    return np.vstack([LOGITS[f"{family}.prefill"][None], LOGITS[f"{family}.decode"]])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_model_matches_transformers_logits_over_prefill_and_16_decode_steps(family):
    config, weights = load_checkpoint(FIXTURES / family, verify=False)
    model = LlamaModel(config, weights)
    golden = GOLDEN[family]
    cache = model.new_cache()
    rows = [model.prefill(golden["prompt_ids"], cache)]
    for token in golden["greedy_ids"]:
        rows.append(model.decode([(token, cache)])[0])
    diff = np.abs(np.vstack(rows) - golden_rows(family)).max()
    assert diff <= TOLERANCE, f"{family}: max abs logit difference {diff:.2e}"
    assert [int(np.argmax(r)) for r in rows[:-1]] == golden["greedy_ids"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_engine_matches_transformers_with_prefix_caching_and_chunked_prefill(family):
    """Through the continuous-batching engine: a first request caches the prompt's first blocks, the second
    reuses them and prefills the rest in chunks of 8 tokens, then greedy-decodes 16 tokens; every logit row
    it sampled from is compared."""
    config, weights = load_checkpoint(FIXTURES / family, verify=False)
    engine = ReferenceEngine.from_weights(config, weights, kv_cache_dtype="fp32", block_size=4,
                                          prefill_chunk_tokens=8, chunked_prefill=True,
                                          enable_prefix_caching=True, max_seq_len=256, max_batch_size=4)
    golden = GOLDEN[family]
    rows: dict[str, list[np.ndarray]] = {}
    sample = engine._sample

    def recording(seq, logits):
        rows.setdefault(seq.req.request_id, []).append(np.array(logits))
        return sample(seq, logits)

    engine._sample = recording

    def run(request: EngineRequest) -> list[int]:
        engine.add_request(request)
        tokens = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
        return tokens

    prompt = golden["prompt_ids"]
    run(EngineRequest("warm", prompt[:20], 1, stop_token_ids=()))
    tokens = run(EngineRequest("golden", prompt, 17, stop_token_ids=()))
    assert engine.stats()["prefix_hit_tokens"] >= 16  # the golden request reused the warm one's blocks
    assert tokens[:16] == golden["greedy_ids"]
    assert len(rows["golden"]) == 17
    diff = np.abs(np.vstack(rows["golden"]) - golden_rows(family)).max()
    assert diff <= TOLERANCE, f"{family}: max abs logit difference {diff:.2e} through the engine"


def test_llama3_rope_scaling_matches_transformers_frequencies():
    golden = GOLDEN["llama3"]["rope"]
    config = internal_config(json.loads((FIXTURES / "llama3" / "config.json").read_text()))
    assert np.allclose(rope_inv_freq(config), golden["inv_freq"], rtol=1e-6)
    assert len(set(golden["bands"])) == 3  # untouched, smoothed and scaled frequencies all occur


@pytest.mark.parametrize("family", FAMILIES)
def test_the_engine_stops_on_every_eos_id_of_the_generation_config(family):
    config, weights = load_checkpoint(FIXTURES / family, verify=False)
    assert list(config["eos_token_ids"]) == GOLDEN[family]["eos_token_ids"]
    engine = ReferenceEngine.from_weights(config, weights, max_seq_len=256)
    assert set(engine.eos_token_ids) == set(GOLDEN[family]["eos_token_ids"])
    greedy = GOLDEN[family]["greedy_ids"]
    # Make the 4th greedy token an EOS of the model by asking the engine to treat it as one: a request
    # with no stop ids of its own takes the model's, so patch the model's set and check the stop.
    engine.eos_token_ids = (greedy[3],)
    engine.add_request(EngineRequest("r", GOLDEN[family]["prompt_ids"], 16))
    tokens, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            final = out if out.finished else final
    assert final.finish_reason == "stop" and tokens == greedy[:greedy.index(greedy[3])]


# ------------------------------------------------------------ the loader's refusals


def copy_of(family: str, tmp_path: Path) -> Path:
    target = tmp_path / family
    shutil.copytree(FIXTURES / family, target)
    return target


def test_a_corrupted_shard_of_an_imported_checkpoint_is_refused_by_name(tmp_path):
    model = copy_of("qwen2", tmp_path)
    write_manifest(model)
    load_checkpoint(model)  # verified: fine
    shard = model / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="model.safetensors"):
        load_checkpoint(model)


def test_an_unsupported_architecture_is_refused_naming_the_supported_ones(tmp_path):
    model = copy_of("llama3", tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="gpt2.*supported: llama, mistral, qwen2"):
        load_checkpoint(model, verify=False)


def test_an_unknown_rope_type_is_refused(tmp_path):
    model = copy_of("llama3", tmp_path)
    config = json.loads((model / "config.json").read_text())
    config["rope_parameters"]["rope_type"] = "yarn"
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="rope type 'yarn'"):
        load_checkpoint(model, verify=False)


def test_a_sharded_checkpoint_missing_a_shard_is_refused_naming_it(tmp_path):
    from safetensors.numpy import save_file
    model = copy_of("llama3", tmp_path)
    tensors = load_file(str(model / "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(model / file))
    (model / "model.safetensors").unlink()
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}))
    config, weights = load_checkpoint(model, verify=False)
    assert np.array_equal(weights["embed"], tensors["model.embed_tokens.weight"])
    (model / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_checkpoint(model, verify=False)
