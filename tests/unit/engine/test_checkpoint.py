"""Model repository: tiny checkpoints, manifests, verification, loading."""

import json
import logging
import os
import re

import blake3
import numpy as np
import pytest

from exaserve_hpc.cache.checkpoint import (
    CheckpointError, ChecksumError, TinyModelSpec, create_tiny_checkpoint,
    ensure_tiny_checkpoint, load_checkpoint, spec_config, verify_checkpoint, weight_shapes,
    write_manifest,
)

SMALL = TinyModelSpec(layers=1, hidden=32, heads=4, kv_heads=2, intermediate=48,
                      max_position=128, shards=2)
SHARD1 = "model-00001-of-00002.safetensors"


def files_of(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.fixture
def ckpt(tmp_path):
    return create_tiny_checkpoint(tmp_path / "tiny", SMALL)


def flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_creation_is_deterministic(tmp_path):
    a = files_of(create_tiny_checkpoint(tmp_path / "a", SMALL))
    b = files_of(create_tiny_checkpoint(tmp_path / "b", SMALL))
    # Hugging Face layout: index + shards, the tiny tokenizer and chat template, the generation config
    assert set(a) == {"config.json", "manifest.json", SHARD1, "model-00002-of-00002.safetensors",
                      "model.safetensors.index.json", "generation_config.json", "tokenizer.json",
                      "tokenizer_config.json", "chat_template.jinja"}
    assert a == b
    c = files_of(create_tiny_checkpoint(tmp_path / "c", TinyModelSpec(**{**SMALL.__dict__, "seed": 1})))
    assert c[SHARD1] != a[SHARD1]


def test_load_returns_config_and_every_weight(ckpt):
    seen = []
    config, weights = load_checkpoint(ckpt, progress=lambda done, total: seen.append((done, total)))
    assert config == spec_config(SMALL)
    assert config["format"] == "hf" and config["eos_token_ids"] == [481, 484]
    for name, shape in weight_shapes(config).items():
        assert weights[name].shape == shape and weights[name].dtype == np.float32
    assert "lm_head_bias" not in weights  # a Llama checkpoint as transformers writes it: no output bias
    assert not weights["lm_head"][[481, 484]].any()  # EOS made rare (logit 0) by the weights themselves
    read = ["config.json", "generation_config.json", *sorted(p.name for p in ckpt.glob("model-*.safetensors"))]
    total = sum((ckpt / name).stat().st_size for name in read)  # the tokenizer's files are the gateway's
    assert seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_manifest_lists_every_other_file_with_sums(ckpt):
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert set(manifest["files"]) == {p.name for p in ckpt.iterdir()} - {"manifest.json"}
    entry = manifest["files"]["config.json"]
    assert entry["size"] == (ckpt / "config.json").stat().st_size
    assert len(entry["blake3"]) == 64 and len(entry["sha256"]) == 64 and len(entry["md5"]) == 32
    assert entry["blake3"] == blake3.blake3((ckpt / "config.json").read_bytes()).hexdigest()
    verify_checkpoint(ckpt)


def sums_in(message, expected, digest):
    """(expected sum named, some other sum of the same length named: the actual one)."""
    words = re.findall(r"[0-9a-f]{32,}", message)
    return expected[digest] in words, any(len(w) == len(expected[digest]) and w not in expected.values()
                                          for w in words)


def test_flipped_byte_raises_checksum_error_naming_file_and_sums(ckpt):
    expected = json.loads((ckpt / "manifest.json").read_text())["files"][SHARD1]
    flip_last_byte(ckpt / SHARD1)
    for check, digests in ((verify_checkpoint, ("blake3", "sha256", "md5")), (load_checkpoint, ("blake3",))):
        with pytest.raises(ChecksumError) as info:
            check(ckpt)
        message = str(info.value)
        assert SHARD1 in message
        for digest in digests:
            assert f"{digest} expected" in message
            assert sums_in(message, expected, digest) == (True, True), message
    config, weights = load_checkpoint(ckpt, verify=False)  # unverified load still reads
    assert "norm" in weights or "lm_head" in weights


def drop_blake3(ckpt):
    """Rewrite the manifest as exaserve wrote it before BLAKE3 (sha256 and md5 only)."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for entry in manifest["files"].values():
        del entry["blake3"]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return manifest["files"]


def test_a_manifest_without_blake3_still_loads_checking_sha256_and_says_so_once(ckpt, caplog):
    files = drop_blake3(ckpt)
    with caplog.at_level(logging.WARNING, logger="exaserve.checkpoint"):
        config, weights = load_checkpoint(ckpt)
        load_checkpoint(ckpt)
    assert config == spec_config(SMALL)
    fallback = [r.getMessage() for r in caplog.records if "no blake3 digests" in r.getMessage()]
    assert len(fallback) == 1 and str(ckpt) in fallback[0] and "check sha256 instead" in fallback[0]
    verify_checkpoint(ckpt)  # sha256 and md5 only
    flip_last_byte(ckpt / SHARD1)
    with pytest.raises(ChecksumError) as info:
        load_checkpoint(ckpt)
    assert "sha256 expected" in str(info.value) and sums_in(str(info.value), files[SHARD1], "sha256") == (True, True)


def test_missing_manifest_is_a_checkpoint_error_with_advice(ckpt):
    (ckpt / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json is missing.*create-tiny"):
        load_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        verify_checkpoint(ckpt)
    write_manifest(ckpt)  # an operator can re-bless a directory they trust
    verify_checkpoint(ckpt)


def test_missing_and_truncated_files(ckpt):
    data = (ckpt / SHARD1).read_bytes()
    (ckpt / SHARD1).write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match=rf"{len(data) - 10} bytes, the manifest says {len(data)}"):
        verify_checkpoint(ckpt)
    (ckpt / SHARD1).unlink()
    with pytest.raises(CheckpointError, match=f"{SHARD1} is missing"):
        load_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match=f"missing shard.*{SHARD1}.*that model.safetensors.index.json lists"):
        load_checkpoint(ckpt, verify=False)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(ckpt.parent / "nowhere")


def test_failed_creation_leaves_nothing(tmp_path):
    def crash(done, total):
        if done < total:
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        create_tiny_checkpoint(tmp_path / "tiny", SMALL, progress=crash)
    assert list(tmp_path.iterdir()) == []


def test_create_refuses_a_non_empty_directory(ckpt, tmp_path):
    with pytest.raises(CheckpointError, match="already exists"):
        create_tiny_checkpoint(ckpt, SMALL)
    (tmp_path / "empty").mkdir()
    create_tiny_checkpoint(tmp_path / "empty", SMALL)  # an empty directory is fine
    verify_checkpoint(tmp_path / "empty")


def test_ensure_creates_then_reuses_then_rejects_other_model(tmp_path):
    target = ensure_tiny_checkpoint(tmp_path / "m", SMALL)
    mtime = (target / SHARD1).stat().st_mtime_ns
    assert ensure_tiny_checkpoint(target, SMALL) == target
    assert (target / SHARD1).stat().st_mtime_ns == mtime
    other = TinyModelSpec(**{**SMALL.__dict__, "seed": 7})
    with pytest.raises(CheckpointError, match="different model.*init"):
        ensure_tiny_checkpoint(target, other)
    flip_last_byte(target / SHARD1)
    with pytest.raises(ChecksumError):
        ensure_tiny_checkpoint(target, SMALL)


def test_float16_and_three_shards(tmp_path):
    spec = TinyModelSpec(**{**SMALL.__dict__, "dtype": "float16", "shards": 3})
    ckpt = create_tiny_checkpoint(tmp_path / "h", spec)
    shards = sorted(p.name for p in ckpt.glob("*.safetensors"))
    assert shards == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    config, weights = load_checkpoint(ckpt)
    assert config["dtype"] == "float16"
    assert {w.dtype for w in weights.values()} == {np.dtype(np.float16)}
    assert set(weights) == set(weight_shapes(config))
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards


@pytest.mark.parametrize("fields, match", [
    ({"heads": 4, "kv_heads": 3}, "not a multiple of kv_heads=3"),
    ({"hidden": 30, "heads": 4}, "not divisible by heads=4"),
    ({"dtype": "bfloat16"}, "float32, float16"),
    ({"vocab_size": 100}, "at least 485"),
    ({"layers": 0}, "layers must be a positive integer"),
    ({"shards": 99}, "into 99 shards"),
])
def test_bad_specs_are_rejected(tmp_path, fields, match):
    with pytest.raises(ValueError, match=match):
        create_tiny_checkpoint(tmp_path / "x", TinyModelSpec(**{**SMALL.__dict__, **fields}))
    assert not os.path.exists(tmp_path / "x")


def test_ensure_refuses_a_directory_without_manifest(tmp_path):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no manifest.json: an interrupted copy"):
        ensure_tiny_checkpoint(tmp_path / "half", SMALL)


def test_manifest_entries_cannot_escape_the_directory(ckpt):
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["../outside"] = {"size": 1, "sha256": "0" * 64, "md5": "0" * 32}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="points outside the checkpoint"):
        verify_checkpoint(ckpt)
