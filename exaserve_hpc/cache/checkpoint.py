"""Model repository: checkpoints with checksum manifests.

A checkpoint is a Hugging Face model directory (``hf_format.py``: config.json
with ``model_type``, ``model.safetensors`` or index + shards, tokenizer.json,
tokenizer_config.json, chat template, generation_config.json) plus
``manifest.json``: size, BLAKE3, sha256, md5 of every other file. The older
exaserve-llama-v1 layout (config.json with ``"format": "exaserve-llama-v1"``,
internal tensor names, the byte tokenizer) still loads.

Internally a config is the dict ``weight_shapes(config)`` reads (``layers``,
``hidden``, ``heads`` ...: ``hf_format.internal_config`` maps Hugging Face's
names), and weights carry internal names (PyTorch [out, in] layout).
``lm_head`` is absent when ``tie_embeddings`` is true; ``lm_head_bias`` is
optional (exaserve-llama-v1 tiny models have one).

Call protocol:
- ``create_tiny_checkpoint(dir, spec)`` writes a deterministic random Llama-3-style
  model in Hugging Face layout with the small BPE tokenizer and chat template
  shipped in ``tiny_tokenizer/`` (same spec -> byte-identical files).
- ``ensure_tiny_checkpoint(dir, spec)`` creates it if absent, else checks it
  is the same model and intact.
- ``verify_checkpoint(dir)`` hashes every file listed in the manifest
  (manifest code lives in ``manifest.py``; re-exported here).
- ``load_checkpoint(dir)`` -> (config, weights), hashing the bytes as it
  reads them, so a verified load reads each file once.
All failures raise ``CheckpointError`` (``ChecksumError`` for a bad hash)
with the file, the numbers and what to do.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors.numpy
from tokenizers import Tokenizer

# Re-exported: callers import the checkpoint API from this module.
from exaserve_hpc.cache.hf_format import (
    GENERATION_CONFIG, HF_FORMAT, INDEX_FILE, SINGLE_FILE, generation_eos_ids, hf_name, internal_config, is_hf_config,
    parse_safetensors, rename_weights, shard_files
)
from exaserve_hpc.cache.manifest import (  # noqa: F401
    MANIFEST_FILE, MANIFEST_FORMAT, CheckpointError, ChecksumError, Progress, check_size, fsync_dir, read_bytes,
    read_manifest, verify_checkpoint, write_manifest, write_synced
)

log = logging.getLogger("exaserve.checkpoint")

FORMAT = "exaserve-llama-v1"
CONFIG_FILE = "config.json"
SHARD_RE = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")
DTYPES = ("float32", "float16")
_ARCH_INT_FIELDS = ("layers", "hidden", "heads", "kv_heads", "intermediate",
                    "vocab_size", "max_position")
# The tiny models' tokenizer (package data): a byte-level BPE of 480 pieces and Llama 3's special tokens,
# written by transformers (tests/fixtures/hf/make_golden.py: the llama3 fixture's tokenizer).
TINY_TOKENIZER_DIR = Path(__file__).resolve().parent / "tiny_tokenizer"
TINY_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TINY_VOCAB = 485
TINY_BOS, TINY_EOS_IDS = 480, (481, 484)  # <|begin_of_text|>; <|end_of_text|>, <|eot_id|>
TINY_SPECIAL_IDS = range(480, 485)


@dataclass(frozen=True)
class TinyModelSpec:
    """A small random Llama-style model for tests, laptops and CI."""

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 172
    vocab_size: int = TINY_VOCAB
    max_position: int = 2048
    rope_theta: float = 10000.0
    seed: int = 0
    shards: int = 2
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in (*_ARCH_INT_FIELDS, "shards"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TinyModelSpec.{name} must be a positive integer, got {value!r}")
        if self.vocab_size < TINY_VOCAB:
            raise ValueError(
                f"TinyModelSpec.vocab_size is {self.vocab_size}; the tiny tokenizer "
                f"needs at least {TINY_VOCAB}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"TinyModelSpec.dtype is {self.dtype!r}; valid: {', '.join(DTYPES)}")
        if self.rope_theta <= 0:
            raise ValueError(f"TinyModelSpec.rope_theta must be > 0, got {self.rope_theta}")
        try:
            validate_config(spec_config(self))
        except CheckpointError as e:  # a bad spec is bad input, like the checks above
            raise ValueError(f"TinyModelSpec: {e}") from e


def hf_config(spec: TinyModelSpec) -> dict:
    """The Hugging Face config.json of the tiny checkpoint ``spec`` describes (LlamaForCausalLM)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "num_hidden_layers": spec.layers,
        "head_dim": spec.hidden // spec.heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position,
        "rope_theta": float(spec.rope_theta),
        "rope_scaling": None,
        "rms_norm_eps": 1e-5,
        "vocab_size": spec.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": spec.dtype,
        "bos_token_id": TINY_BOS,
        "eos_token_id": list(TINY_EOS_IDS),
        "exaserve_tiny": {"kind": "tiny-random", "seed": spec.seed, "shards": spec.shards},
    }


def spec_config(spec: TinyModelSpec) -> dict:
    """The internal config ``load_checkpoint`` returns for the tiny checkpoint ``spec`` describes."""
    if spec.hidden % spec.heads:
        raise CheckpointError(f"config.hidden={spec.hidden} is not divisible by heads={spec.heads}")
    return {**internal_config(hf_config(spec)), "eos_token_ids": list(TINY_EOS_IDS)}


def validate_config(config: dict) -> dict:
    """Check an architecture config (exaserve-llama-v1, or the internal form of a Hugging Face
    config from ``hf_format.internal_config``); returns it, raises CheckpointError."""
    if config.get("format") not in (FORMAT, HF_FORMAT):
        raise CheckpointError(
            f"config format is {config.get('format')!r}, expected {FORMAT!r} or a Hugging Face config.json "
            "(with model_type); import the model with `exaserve model import` or re-create it with "
            "`exaserve model create-tiny DIR`"
        )
    missing = [k for k in (*_ARCH_INT_FIELDS, "rope_theta", "norm_eps") if k not in config]
    if missing:
        raise CheckpointError(f"config is missing field(s): {', '.join(missing)}")
    for name in _ARCH_INT_FIELDS:
        if not isinstance(config[name], int) or config[name] < 1:
            raise CheckpointError(f"config.{name} must be a positive integer, got {config[name]!r}")
    hidden, heads, kv_heads = config["hidden"], config["heads"], config["kv_heads"]
    if "head_dim" not in config and hidden % heads:
        raise CheckpointError(f"config.hidden={hidden} is not divisible by heads={heads}")
    if heads % kv_heads:
        raise CheckpointError(
            f"config.heads={heads} is not a multiple of kv_heads={kv_heads} "
            "(grouped-query attention shares each kv head among heads/kv_heads query heads)"
        )
    if head_dim_of(config) % 2:
        raise CheckpointError(
            f"head dim {head_dim_of(config)} is odd; RoPE rotates pairs, make it even"
        )
    return config


def head_dim_of(config: dict) -> int:
    """Width of one attention head: Hugging Face's explicit head_dim, else hidden / heads."""
    return config.get("head_dim") or config["hidden"] // config["heads"]


def weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Required weight names -> shapes, in the canonical (init and shard) order."""
    h, v, i = config["hidden"], config["vocab_size"], config["intermediate"]
    hd = head_dim_of(config)
    q, kv = config["heads"] * hd, config["kv_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {"embed": (v, h)}
    for n in range(config["layers"]):
        p = f"layers.{n}."
        shapes |= {p + "attn_norm": (h,), p + "attn.wq": (q, h), p + "attn.wk": (kv, h),
                   p + "attn.wv": (kv, h), p + "attn.wo": (h, q), p + "mlp_norm": (h,),
                   p + "mlp.w1": (i, h), p + "mlp.w3": (i, h), p + "mlp.w2": (h, i)}
        if config.get("qkv_bias"):
            shapes |= {p + "attn.bq": (q,), p + "attn.bk": (kv,), p + "attn.bv": (kv,)}
        if config.get("o_bias"):
            shapes[p + "attn.bo"] = (h,)
    shapes["norm"] = (h,)
    if not config.get("tie_embeddings", False):
        shapes["lm_head"] = (v, h)
    return shapes


def check_weights(config: dict, weights: dict[str, np.ndarray]) -> None:
    """Raise CheckpointError unless ``weights`` has exactly the config's tensors."""
    shapes = weight_shapes(config)
    optional = {"lm_head_bias": (config["vocab_size"],)}
    missing = sorted(set(shapes) - set(weights))
    unexpected = sorted(set(weights) - set(shapes) - set(optional))
    if missing or unexpected:
        raise CheckpointError(
            f"weights do not match the config: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}; "
            "the shards are from a different model than config.json"
        )
    for name, array in weights.items():
        want = shapes.get(name) or optional[name]
        if tuple(array.shape) != want:
            raise CheckpointError(
                f"weight {name} has shape {tuple(array.shape)}, config says {want}"
            )


# ---------------------------------------------------------------- creation

def _rare_tiny_tokens() -> list[int]:
    """Tiny-tokenizer ids given logit 0 (rare, never a greedy pick): the special tokens, and byte pieces that
    are not text alone (half a UTF-8 character, control bytes), so the random model's text reads as words."""
    tokenizer = Tokenizer.from_file(str(TINY_TOKENIZER_DIR / "tokenizer.json"))
    rare = list(TINY_SPECIAL_IDS)
    for i in range(TINY_SPECIAL_IDS.start):
        text = tokenizer.decode([i])
        if not text or "\ufffd" in text or any(not c.isprintable() and c not in " \n" for c in text):
            rare.append(i)
    return rare


def _init_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    """Deterministic random init under Hugging Face names, scaled so logits are not flat (std ~2.5) and
    the special tokens' logits are 0: never a greedy pick, rare when sampled (Llama has no output bias)."""
    rng = np.random.default_rng(seed)
    depth_scale = 1.0 / np.sqrt(2.0 * config["layers"])  # residual adds stay O(1)
    weights = {}
    for name, shape in weight_shapes(config).items():
        if name.endswith("norm"):
            w = np.ones(shape, np.float32)
        elif name == "embed":
            w = rng.standard_normal(shape, dtype=np.float32)
        else:
            w = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[1]))
            if name.endswith(("attn.wo", "mlp.w2")):
                w *= np.float32(depth_scale)
        weights[name] = w
    weights["lm_head"] *= np.float32(2.5)
    weights["lm_head"][_rare_tiny_tokens()] = 0.0
    dtype = np.dtype(config["dtype"])
    return {hf_name(n): v.astype(dtype) for n, v in weights.items()}


def _shard_names(names: list[str], sizes: list[int], shards: int) -> list[list[str]]:
    """Split names (in order) into ``shards`` contiguous, non-empty, balanced runs."""
    if shards > len(names):
        raise ValueError(f"cannot split {len(names)} tensors into {shards} shards; use fewer shards")
    total, before, index = sum(sizes), 0, 0
    groups: list[list[str]] = [[] for _ in range(shards)]
    for pos, (name, size) in enumerate(zip(names, sizes)):
        want = int((before + size / 2) * shards // total)
        # Monotone, at most one step at a time, and leave a tensor for every later shard.
        index = min(max(want, index), index + 1 if pos else 0, shards - 1)
        index = max(index, shards - (len(names) - pos))
        groups[index].append(name)
        before += size
    return groups


def create_tiny_checkpoint(directory: str | os.PathLike, spec: TinyModelSpec = TinyModelSpec(),
                           progress: Progress | None = None) -> Path:
    """Write the random checkpoint ``spec`` describes at ``directory``; returns it.

    Files are written into a temporary sibling directory that is renamed into
    place only when complete, so a crash leaves no half checkpoint under the
    final name. ``directory`` must not exist or be empty. ``progress(done,
    total)`` is called with bytes written.
    """
    target = Path(directory)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CheckpointError(
            f"{target} already exists and is not empty; remove it or use "
            "ensure_tiny_checkpoint to reuse it"
        )
    weights = _init_weights(spec_config(spec), spec.seed)
    names = list(weights)
    groups = _shard_names(names, [weights[n].nbytes for n in names], spec.shards)

    def as_json(value: dict) -> bytes:
        return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()

    blobs = {CONFIG_FILE: as_json(hf_config(spec)),
             GENERATION_CONFIG: as_json({"bos_token_id": TINY_BOS, "eos_token_id": list(TINY_EOS_IDS)})}
    blobs |= {name: (TINY_TOKENIZER_DIR / name).read_bytes() for name in TINY_TOKENIZER_FILES}
    shard_of = {}
    for k, group in enumerate(groups, start=1):
        shard = SINGLE_FILE if spec.shards == 1 else f"model-{k:05d}-of-{spec.shards:05d}.safetensors"
        blobs[shard] = safetensors.numpy.save({n: weights[n] for n in group}, metadata={"format": "pt"})
        shard_of |= dict.fromkeys(group, shard)
    if spec.shards > 1:
        size = sum(w.nbytes for w in weights.values())
        blobs[INDEX_FILE] = as_json({"metadata": {"total_size": size}, "weight_map": shard_of})
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        total, done = sum(map(len, blobs.values())), 0
        for name, data in blobs.items():
            write_synced(tmp / name, data)
            done += len(data)
            if progress:
                progress(done, total)
        write_manifest(tmp)
        # mkdtemp makes it 0700 and its files are 0600: a checkpoint is its user's own (another user's
        # weights or manifest must not be read, nor one of ours replaced); share a store with chmod if wanted
        try:
            os.rename(tmp, target)  # atomic; replaces an empty directory only
        except OSError as e:
            raise CheckpointError(f"{target} appeared while creating it ({e}); "
                                  "another process may have created it") from e
        fsync_dir(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _is_old_tiny(raw: bytes) -> bool:
    try:
        config = json.loads(raw)
    except ValueError:
        return False
    return isinstance(config, dict) and config.get("format") == FORMAT and \
        (config.get("init") or {}).get("kind") == "tiny-random"


def ensure_tiny_checkpoint(directory: str | os.PathLike, spec: TinyModelSpec = TinyModelSpec(),
                           progress: Progress | None = None) -> Path:
    """Create the checkpoint if absent; otherwise check it is ``spec``'s and intact."""
    target = Path(directory)
    if not (target / MANIFEST_FILE).exists():
        if target.is_dir() and any(target.iterdir()):
            raise CheckpointError(
                f"{target} is not empty but has no {MANIFEST_FILE}: an interrupted copy or "
                "not a checkpoint. Remove it (or point the site config elsewhere) and retry"
            )
        try:
            return create_tiny_checkpoint(target, spec, progress)
        except CheckpointError:
            if not (target / MANIFEST_FILE).exists():  # not a lost creation race
                raise
    # Verify first, so a corrupt config.json reads as corruption, not as another model.
    verify_checkpoint(target, progress)
    raw = read_bytes(target, CONFIG_FILE, None)
    if _is_old_tiny(raw):  # made by an earlier version (byte tokenizer, own layout): generated data, made anew
        log.warning("%s holds a tiny model in the older exaserve-llama-v1 layout; re-creating it in Hugging "
                    "Face layout", target)
        shutil.rmtree(target)
        return ensure_tiny_checkpoint(target, spec, progress)
    config = parse_config(target, raw)
    want = spec_config(spec)
    diff = sorted(k for k in set(want) | set(config) if want.get(k) != config.get(k))
    if diff:
        details = ", ".join(f"{k}: found {config.get(k)!r}, wanted {want.get(k)!r}" for k in diff)
        raise CheckpointError(
            f"{target} holds a different model ({details}); point the site config "
            "at another directory or remove this one"
        )
    return target


# ---------------------------------------------------------------- loading

def _shard_files(root: Path, names: list[str]) -> list[str]:
    """The shard names, checked complete (1..N of N) and in order."""
    found = {}
    for name in names:
        if m := SHARD_RE.match(name):
            found[name] = (int(m.group(1)), int(m.group(2)))
    if not found:
        raise CheckpointError(f"{root} has no model-XXXXX-of-XXXXX.safetensors shards")
    counts = {of for _, of in found.values()}
    count = max(counts)
    want = [f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]
    missing = [w for w in want if w not in found]
    if len(counts) > 1 or missing:
        raise CheckpointError(
            f"{root} has an incomplete shard set: expected {count} shards, missing "
            f"{missing or 'none'}, found {sorted(found)}; re-copy the checkpoint"
        )
    return want


def parse_config(root: Path, data: bytes, read=None) -> dict:
    """The architecture config of a checkpoint from its config.json bytes: an exaserve-llama-v1 config as
    it is, a Hugging Face one in internal form with ``eos_token_ids`` from its generation config.
    ``read(name) -> bytes`` reads another file of the checkpoint (verified, where the caller verifies)."""
    try:
        raw = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{root / CONFIG_FILE} is not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise CheckpointError(f"{root / CONFIG_FILE} is not a JSON object")
    if is_hf_config(raw):
        config = internal_config(raw, str(root / CONFIG_FILE))
        config["eos_token_ids"] = generation_eos_ids(root, read)
        return validate_config(config)
    return validate_config(raw)


def weight_files(root: Path, names: list[str], config: dict) -> list[str]:
    """The safetensors files holding a checkpoint's weights, in load order."""
    return shard_files(root, names) if config["format"] == HF_FORMAT else _shard_files(root, names)


def internal_weights(config: dict, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A checkpoint's tensors under the names ``weight_shapes`` uses."""
    if config["format"] == HF_FORMAT:
        return rename_weights(tensors, tied=config["tie_embeddings"])
    return tensors


def load_checkpoint(directory: str | os.PathLike, verify: bool = True,
                    progress: Progress | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """Read (config, weights) from a checkpoint (exaserve-llama-v1 or Hugging Face layout); each file
    is read once.

    With ``verify`` the bytes are hashed as they are read and compared with
    the manifest (ChecksumError on mismatch). ``progress(done, total)``
    reports bytes read. Weights keep the stored dtype (bfloat16 through ml_dtypes).
    """
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(
            f"checkpoint directory {root} does not exist; create one with "
            f"`exaserve model create-tiny {root}`, import one with `exaserve model import SRC --name NAME`, "
            "or fix the model path"
        )
    entries = read_manifest(root) if verify else None
    names = list(entries) if entries is not None else [p.name for p in root.iterdir()]
    done, total = 0, 0

    def on_bytes(n: int) -> None:
        nonlocal done
        done += n
        if progress:
            progress(done, total)

    def read(name: str) -> bytes:
        if entries is not None and name not in entries:
            raise CheckpointError(f"{root / name} is not listed in the manifest; re-create it")
        return read_bytes(root, name, entries[name] if entries else None, on_bytes)

    if CONFIG_FILE not in names:
        raise CheckpointError(f"{root} has no {CONFIG_FILE}; not a checkpoint directory")
    config = parse_config(root, read(CONFIG_FILE), read)
    shards = weight_files(root, names, config)
    total = done + sum(check_size(root, n, entries.get(n) if entries else None) for n in shards)
    weights: dict[str, np.ndarray] = {}
    for shard in shards:
        tensors = internal_weights(config, parse_safetensors(read(shard), str(root / shard)))
        if dup := sorted(set(tensors) & set(weights)):
            raise CheckpointError(f"{root / shard} repeats tensor(s) {dup[:5]} from an earlier shard")
        weights.update(tensors)
    check_weights(config, weights)
    return config, weights
