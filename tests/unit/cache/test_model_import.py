"""`exaserve model import`: a Hugging Face model directory into the L3 store, with a manifest every tier verifies."""

from __future__ import annotations

import json
import os
import stat
import struct

import numpy as np
import pytest
import safetensors.numpy

from exaserve_hpc.cli import main as cli
from exaserve_hpc.cache import model_import
from exaserve_hpc.cache.l3_store import copy_verified
from exaserve_hpc.cache.manifest import CheckpointError, ChecksumError, read_manifest, verify_checkpoint
from exaserve_hpc.cache.model_import import import_model, read_safetensors_header, scan_source

CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 16,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 16,
          "max_position_embeddings": 64, "torch_dtype": "float32"}


def _tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"model.embed_tokens.weight": rng.standard_normal((16, 8), dtype=np.float32),
            "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((8, 8), dtype=np.float32).astype(np.float16),
            "model.norm.weight": np.ones(8, np.float32),
            "lm_head.weight": rng.standard_normal((16, 8), dtype=np.float32)}


def _write_tokenizer(path) -> None:
    try:
        from tokenizers import Tokenizer
        from tokenizers.models import WordLevel
        from tokenizers.pre_tokenizers import Whitespace
    except ImportError:  # a minimal valid tokenizer.json
        path.write_text(json.dumps({"version": "1.0", "model": {"type": "WordLevel", "vocab": {"[UNK]": 0},
                                                                 "unk_token": "[UNK]"}}))
        return
    tokenizer = Tokenizer(WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(path))


def make_hf_dir(root, *, shards: int = 1, model_type: str = "llama", seed: int = 0):
    """A small Hugging Face layout: config, tokenizer, chat template, weights (one file or `shards` shards)."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({**CONFIG, "model_type": model_type}))
    _write_tokenizer(root / "tokenizer.json")
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (root / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    (root / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    tensors = _tensors(seed)
    if shards == 1:
        safetensors.numpy.save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
        return root
    names = list(tensors)
    weight_map = {}
    for k in range(shards):
        shard = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::shards]}
        safetensors.numpy.save_file(part, str(root / shard), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, shard)
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


@pytest.fixture
def hf(tmp_path):
    return make_hf_dir(tmp_path / "hf")


@pytest.fixture
def store(tmp_path):
    return tmp_path / "store"


def _files(directory) -> set[str]:
    return {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}


def _hidden(store) -> list[str]:
    return sorted(p.name for p in store.iterdir() if p.name.startswith(".")) if store.exists() else []


def test_import_copies_every_file_with_a_manifest_that_verifies(hf, store):
    seen = []
    dest = import_model(hf, store, "tiny-llama", progress=lambda done, total: seen.append((done, total)))
    assert dest == store / "tiny-llama"
    verify_checkpoint(dest)
    listed = set(read_manifest(dest))
    assert listed == _files(hf) == _files(dest) - {"manifest.json"}
    for name in listed:
        assert (dest / name).read_bytes() == (hf / name).read_bytes()
    total = sum((hf / n).stat().st_size for n in listed)
    assert seen[-1] == (total, total)
    # private to its user, as the project writes checkpoints
    assert stat.S_IMODE(dest.stat().st_mode) == 0o700
    assert {stat.S_IMODE((dest / n).stat().st_mode) for n in _files(dest)} == {0o600}
    assert _hidden(store) == []  # no temporary directory left
    # the L3 -> L2 copy (every load's path out of the store) accepts it
    l2 = store.parent / "l2"
    l2.mkdir()
    assert copy_verified(dest, l2) == total


def test_a_corrupt_byte_in_the_copied_shard_fails_verification_naming_it(hf, store):
    dest = import_model(hf, store, "tiny-llama")
    shard = dest / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="model.safetensors is corrupt"):
        verify_checkpoint(dest)


def test_sharded_import_in_small_chunks(tmp_path, store, monkeypatch):
    monkeypatch.setattr(model_import, "CHUNK", 96)  # many chunks per file: the buffers are recycled
    src = make_hf_dir(tmp_path / "hf", shards=3)
    dest = import_model(src, store, "sharded")
    verify_checkpoint(dest)
    assert {"model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors",
            "model.safetensors.index.json"} <= set(read_manifest(dest))
    for name in _files(src):
        assert (dest / name).read_bytes() == (src / name).read_bytes()


def test_hf_cache_snapshot_of_symbolic_links_is_copied_and_subdirectories_are_skipped(hf, tmp_path, store):
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for name in os.listdir(hf):
        (snapshot / name).symlink_to(hf / name)
    (snapshot / "original").mkdir()
    (snapshot / "original" / "consolidated.00.pth").write_bytes(b"not read")
    (snapshot / "tokenizer.model").write_bytes(b"sentencepiece")
    notes = []
    dest = import_model(snapshot, store, "snap", note=notes.append)
    assert set(read_manifest(dest)) == _files(hf)
    assert not any(p.is_symlink() for p in dest.iterdir())
    assert len(notes) == 1 and "original/ (a subdirectory)" in notes[0] and "tokenizer.model" in notes[0]


def test_missing_shard_is_refused_naming_it(tmp_path, store):
    src = make_hf_dir(tmp_path / "hf", shards=2)
    (src / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors .*missing"):
        import_model(src, store, "x")
    assert not (store / "x").exists() and _hidden(store) == []


def test_unlisted_safetensors_is_refused(tmp_path, store):
    src = make_hf_dir(tmp_path / "hf", shards=2)
    safetensors.numpy.save_file({"w": np.zeros(2, np.float32)}, str(src / "consolidated.safetensors"))
    with pytest.raises(CheckpointError, match=r"consolidated\.safetensors is not listed"):
        import_model(src, store, "x")


def test_shards_without_index_are_refused(tmp_path, store):
    src = make_hf_dir(tmp_path / "hf", shards=2)
    (src / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json is missing"):
        import_model(src, store, "x")


def test_index_that_does_not_match_the_shards_is_refused(tmp_path, store):
    src = make_hf_dir(tmp_path / "hf", shards=2)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["lm_head.weight"] = "model-00001-of-00002.safetensors"  # it is in shard 2
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"maps tensor 'lm_head\.weight' to model-00001-of-00002\.safetensors, "
                                              r"but it is in model-00002-of-00002\.safetensors"):
        import_model(src, store, "x")
    index["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"
    del index["weight_map"]["model.norm.weight"]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"holds tensor\(s\) \['model\.norm\.weight'\] that "
                                              r"model\.safetensors\.index\.json does not list"):
        import_model(src, store, "x")


@pytest.mark.parametrize("pickle_name", ["pytorch_model.bin", "model.pt", "consolidated.pth"])
def test_pytorch_pickles_are_refused(hf, store, pickle_name):
    (hf / pickle_name).write_bytes(b"\x80\x02}q\x00.")
    with pytest.raises(CheckpointError, match=rf"{pickle_name} is a PyTorch pickle .*can run arbitrary code.*"
                                              "move the pickle files out"):
        import_model(hf, store, "x")
    (hf / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="convert them to safetensors"):
        import_model(hf, store, "x")
    assert not store.exists() or list(store.iterdir()) == []


def test_missing_tokenizer_json_is_refused(hf, store):
    (hf / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json is missing"):
        import_model(hf, store, "x")
    (hf / "tokenizer.model").write_bytes(b"sentencepiece")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json is missing: .*only tokenizer\.model, a "
                                              "sentencepiece tokenizer, which exaserve does not support"):
        import_model(hf, store, "x")


def test_missing_config_and_unsupported_model_type_are_refused(tmp_path, store):
    src = make_hf_dir(tmp_path / "gemma", model_type="gemma")
    with pytest.raises(CheckpointError, match=r"model_type 'gemma' is not supported; supported: llama, mistral, "
                                              "qwen2"):
        import_model(src, store, "x")
    (src / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json is missing"):
        import_model(src, store, "x")


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_other_supported_families_import(tmp_path, store, model_type):
    verify_checkpoint(import_model(make_hf_dir(tmp_path / model_type, model_type=model_type), store, model_type))


def test_unsupported_dtype_is_refused_naming_the_tensor(hf, store):
    safetensors.numpy.save_file({"model.norm.weight": np.ones(8, np.float32),
                                 "model.layers.0.mlp.down_proj.weight": np.ones((8, 16), np.int8)},
                                str(hf / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.0\.mlp\.down_proj\.weight' has dtype I8; "
                                              "supported: F32, F16, BF16"):
        import_model(hf, store, "x")


def _raw_safetensors(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def test_bf16_header_is_accepted_and_malformed_headers_are_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(_raw_safetensors({"__metadata__": {"format": "pt"},
                                       "w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]}}, bytes(12)))
    prefix, tensors = read_safetensors_header(path)
    assert set(tensors) == {"w"} and path.read_bytes().startswith(prefix)
    path.write_bytes(_raw_safetensors({"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]}}, bytes(8)))
    with pytest.raises(CheckpointError, match="data_offsets"):  # truncated data
        read_safetensors_header(path)
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(CheckpointError, match="header length"):
        read_safetensors_header(path)
    path.write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 123\n")
    with pytest.raises(CheckpointError, match="Git LFS pointer"):
        read_safetensors_header(path)


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ".", ".hidden", "", "a b", "x@", "x@y@z", "a" * 65])
def test_bad_names_are_refused(hf, store, name):
    with pytest.raises(CheckpointError, match="is not valid"):
        import_model(hf, store, name)
    assert not store.exists()


def test_version_names_are_accepted(hf, store):
    assert import_model(hf, store, "tiny-llama@v2.1").name == "tiny-llama@v2.1"


def test_existing_destination_is_refused_and_force_replaces_it(hf, tmp_path, store):
    dest = import_model(hf, store, "m")
    before = (dest / "manifest.json").read_bytes()
    with pytest.raises(CheckpointError, match="already exists; pass --force"):
        import_model(hf, store, "m")
    assert (dest / "manifest.json").read_bytes() == before
    other = make_hf_dir(tmp_path / "other", seed=1)
    assert import_model(other, store, "m", force=True) == dest
    verify_checkpoint(dest)
    assert (dest / "model.safetensors").read_bytes() == (other / "model.safetensors").read_bytes()
    assert (dest / "manifest.json").read_bytes() != before
    assert sorted(p.name for p in store.iterdir()) == ["m"]  # the old copy and the temporary are gone


def test_force_replaces_without_rename_exchange(hf, tmp_path, store, monkeypatch):
    """Where the file system cannot exchange two directories: the old one is moved aside, then removed."""
    import_model(hf, store, "m")
    monkeypatch.setattr(model_import, "_rename_exchange", lambda a, b: False)
    other = make_hf_dir(tmp_path / "other", seed=1)
    dest = import_model(other, store, "m", force=True)
    verify_checkpoint(dest)
    assert (dest / "model.safetensors").read_bytes() == (other / "model.safetensors").read_bytes()
    assert sorted(p.name for p in store.iterdir()) == ["m"]


def test_interrupt_during_the_copy_leaves_no_partial_destination(hf, tmp_path, store, monkeypatch):
    monkeypatch.setattr(model_import, "CHUNK", 64)

    def interrupt(done, total):
        if done > total // 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        import_model(hf, store, "m", progress=interrupt)
    assert list(store.iterdir()) == []
    dest = import_model(hf, store, "m")  # an interrupted --force keeps the old model whole
    before = {n: (dest / n).read_bytes() for n in _files(dest)}
    with pytest.raises(KeyboardInterrupt):
        import_model(make_hf_dir(tmp_path / "other", seed=1), store, "m", force=True, progress=interrupt)
    assert {n: (dest / n).read_bytes() for n in _files(dest)} == before
    assert sorted(p.name for p in store.iterdir()) == ["m"]
    verify_checkpoint(dest)


def test_scan_lists_metadata_before_weights(hf):
    (hf / "LICENSE").write_text("license")
    (hf / "README.md").write_text("readme")
    (hf / ".gitattributes").write_text("*.safetensors filter=lfs")
    notes = []
    plan = scan_source(hf, notes.append)
    names = [f.name for f in plan.files]
    assert names[-1] == "model.safetensors" and {"LICENSE", "README.md", "chat_template.jinja"} <= set(names)
    assert ".gitattributes" not in names and ".gitattributes" in notes[0]
    assert plan.model_type == "llama" and plan.total == sum((hf / n).stat().st_size for n in names)


def test_cli_imports_with_store_and_site_and_exits_2_on_refusal(hf, tmp_path, store, capsys):
    assert cli.main(["model", "import", str(hf), "--name", "tiny-llama", "--store", str(store)]) == 0
    printed = capsys.readouterr().out
    assert f"imported tiny-llama -> {store / 'tiny-llama'}" in printed
    assert f"model_path: {store / 'tiny-llama'}" in printed and "model_name: tiny-llama" in printed
    assert cli.main(["model", "verify", str(store / "tiny-llama")]) == 0
    capsys.readouterr()

    assert cli.main(["model", "import", str(hf), "--name", "tiny-llama", "--store", str(store)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert cli.main(["model", "import", str(hf), "--name", "tiny-llama", "--store", str(store), "--force"]) == 0
    assert cli.main(["model", "import", str(hf), "--name", "../x", "--store", str(store)]) == 2
    (hf / "tokenizer.json").unlink()
    assert cli.main(["model", "import", str(hf), "--name", "y", "--store", str(store)]) == 2
    assert "tokenizer.json is missing" in capsys.readouterr().err

    site = tmp_path / "site.yaml"  # --site: the store is the site's weight_cache.l3_path
    l3 = tmp_path / "site-l3"
    site.write_text("site: t\ncluster: {name: t, nodes: 1, nodelist: localhost, gpus_per_node: 0}\n"
                    f"weight_cache: {{l3_path: {l3}}}\nmodels:\n  - {{model_name: tiny-llama, engine: echo}}\n")
    _write_tokenizer(hf / "tokenizer.json")
    assert cli.main(["model", "import", str(hf), "--name", "tiny-llama@v2", "--site", str(site)]) == 0
    assert "exaserve rollout start tiny-llama v2" in capsys.readouterr().out
    verify_checkpoint(l3 / "tiny-llama@v2")
    with pytest.raises(SystemExit) as exc:  # argparse: --site and --store together
        cli.main(["model", "import", str(hf), "--name", "z", "--site", str(site), "--store", str(store)])
    assert exc.value.code == 2
