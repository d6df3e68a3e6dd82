"""Hugging Face checkpoints: their config, weight names and shard files, read as the reference model runs them.

A Hugging Face model directory holds ``config.json`` (``model_type``,
``num_hidden_layers``, ...), ``model.safetensors`` or ``model-0000K-of-0000N.safetensors``
with ``model.safetensors.index.json``, ``tokenizer.json``, ``tokenizer_config.json``,
the chat template (``chat_template.jinja`` as transformers 5 writes it, or inside
``tokenizer_config.json``) and ``generation_config.json``. This module turns such a
config into the internal architecture dict that ``engine/model.py`` runs (the same
keys as the exaserve-llama-v1 format, plus ``head_dim``, ``rope_scaling``,
``attention_bias``), and Hugging Face tensor names into the internal ones.

Families read (their modelling code in huggingface/transformers, ``src/transformers/models/``):
- ``llama`` (``llama/modeling_llama.py``): Llama 2 and 3; ``attention_bias`` adds q/k/v/o
  biases; ``rope_scaling`` of type ``llama3`` (``modeling_rope_utils.py``
  ``_compute_llama3_parameters``) or ``linear``.
- ``mistral`` (``mistral/modeling_mistral.py``): Llama's layers; ``sliding_window``
  limits attention to the last W keys, so the model's context is capped at W here
  (a longer sequence would need the window, which the reference engine does not run).
- ``qwen2`` (``qwen2/modeling_qwen2.py``): q/k/v projections with biases, o without;
  usually ``tie_word_embeddings``.

Anything else (another ``model_type``, an MLP bias, a rope type not listed) is refused by
name, never run wrong.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from exaserve_hpc.cache.manifest import CheckpointError

HF_FORMAT = "hf"  # the internal config's "format" for a checkpoint read from Hugging Face layout
HF_MODEL_TYPES = ("llama", "mistral", "qwen2")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
GENERATION_CONFIG = "generation_config.json"
ROPE_TYPES = ("default", "llama3", "linear")
_HF_SHARD_RE = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")

# Hugging Face tensor name -> internal name (layer tensors: the part after "model.layers.N.").
_TOP = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}
_LAYER = {
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "mlp_norm",
    "self_attn.q_proj.weight": "attn.wq", "self_attn.k_proj.weight": "attn.wk",
    "self_attn.v_proj.weight": "attn.wv", "self_attn.o_proj.weight": "attn.wo",
    "self_attn.q_proj.bias": "attn.bq", "self_attn.k_proj.bias": "attn.bk",
    "self_attn.v_proj.bias": "attn.bv", "self_attn.o_proj.bias": "attn.bo",
    "mlp.gate_proj.weight": "mlp.w1", "mlp.up_proj.weight": "mlp.w3", "mlp.down_proj.weight": "mlp.w2",
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Tensors a checkpoint may carry that the forward pass does not use (older Llama exports).
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


_HF_OF_LAYER = {v: k for k, v in _LAYER.items()}
_HF_OF_TOP = {v: k for k, v in _TOP.items()}


def hf_name(internal: str) -> str:
    """The Hugging Face name of an internal tensor name (the inverse of ``internal_name``)."""
    if internal in _HF_OF_TOP:
        return _HF_OF_TOP[internal]
    _, layer, part = internal.split(".", 2)
    return f"model.layers.{layer}.{_HF_OF_LAYER[part]}"


def is_hf_config(raw: dict) -> bool:
    """Whether a parsed config.json is Hugging Face's (it names a ``model_type``)."""
    return isinstance(raw, dict) and "model_type" in raw and "format" not in raw


def internal_name(name: str) -> str | None:
    """The internal name of a Hugging Face tensor; None for tensors the model does not use."""
    if name in _TOP:
        return _TOP[name]
    if m := _LAYER_RE.match(name):
        part = _LAYER.get(m.group(2))
        if part is not None:
            return f"layers.{m.group(1)}.{part}"
    if _IGNORED.search(name):
        return None
    raise CheckpointError(f"tensor {name!r} is not part of a Llama/Mistral/Qwen2 model as the reference "
                          "engine runs it (an MLP bias or another architecture's layer?)")


def _int(raw: dict, key: str, where: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CheckpointError(f"{where}: {key} must be a positive integer, found {value!r}")
    return value


def _rope(raw: dict, where: str) -> tuple[float, dict | None]:
    """(rope_theta, rope scaling or None). transformers 4 writes ``rope_theta`` and ``rope_scaling``;
    transformers 5 writes both inside ``rope_parameters`` (``modeling_rope_utils.py``)."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or None
    if params and not scaling:
        scaling = params
    theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise CheckpointError(f"{where}: rope_theta must be a positive number, found {theta!r}")
    if scaling is None:
        return float(theta), None
    if not isinstance(scaling, dict):
        raise CheckpointError(f"{where}: rope_scaling must be an object, found {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise CheckpointError(f"{where}: rope type {kind!r} is not supported by the reference engine; "
                              f"supported: {', '.join(ROPE_TYPES)}")
    if kind == "default":
        return float(theta), None
    out = {"rope_type": kind, "factor": float(scaling.get("factor", 0) or 0)}
    if out["factor"] <= 0:
        raise CheckpointError(f"{where}: rope scaling {kind} needs a positive factor, found {scaling.get('factor')!r}")
    if kind == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if not isinstance(scaling.get(key), (int, float)) or scaling[key] <= 0:
                raise CheckpointError(f"{where}: rope scaling llama3 needs a positive {key}, "
                                      f"found {scaling.get(key)!r}")
            out[key] = float(scaling[key])
        if out["high_freq_factor"] <= out["low_freq_factor"]:
            raise CheckpointError(f"{where}: rope scaling llama3 needs high_freq_factor > low_freq_factor")
    return float(theta), out


def internal_config(raw: dict, where: str = "config.json") -> dict:
    """The internal architecture dict of a Hugging Face ``config.json``; CheckpointError naming what is off."""
    model_type = raw.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise CheckpointError(f"{where}: model_type {model_type!r} is not supported by the reference engine; "
                              f"supported: {', '.join(HF_MODEL_TYPES)}")
    if raw.get("mlp_bias"):
        raise CheckpointError(f"{where}: mlp_bias is true; the reference engine runs MLPs without biases")
    if raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act {raw.get('hidden_act')!r} is not supported; supported: silu")
    heads = _int(raw, "num_attention_heads", where)
    hidden = _int(raw, "hidden_size", where)
    head_dim = raw.get("head_dim") or hidden // heads
    theta, scaling = _rope(raw, where)
    max_position = _int(raw, "max_position_embeddings", where)
    window = raw.get("sliding_window") if raw.get("use_sliding_window", model_type == "mistral") else None
    if isinstance(window, int) and 0 < window < max_position:
        max_position = window  # beyond the window the model attends differently: never serve past it
    eps = raw.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, (int, float)) or eps <= 0:
        raise CheckpointError(f"{where}: rms_norm_eps must be a positive number, found {eps!r}")
    bias = bool(raw.get("attention_bias", False))
    return {
        "format": HF_FORMAT,
        "model_type": model_type,
        "layers": _int(raw, "num_hidden_layers", where),
        "hidden": hidden,
        "heads": heads,
        "kv_heads": _int(raw, "num_key_value_heads", where, heads),
        "head_dim": head_dim,
        "intermediate": _int(raw, "intermediate_size", where),
        "vocab_size": _int(raw, "vocab_size", where),
        "max_position": max_position,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "norm_eps": float(eps),
        "tie_embeddings": bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases and no o bias; Llama's attention_bias adds all four.
        "qkv_bias": model_type == "qwen2" or bias,
        "o_bias": model_type != "qwen2" and bias,
        "dtype": str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        **({"init": raw["exaserve_tiny"]} if isinstance(raw.get("exaserve_tiny"), dict) else {}),
    }


def rope_inv_freq(config: dict) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] (float64) with the config's rope scaling applied, as
    transformers' ``modeling_rope_utils.py`` computes them (``_compute_default_rope_parameters``,
    ``_compute_llama3_parameters``, ``_compute_linear_scaling_rope_parameters``)."""
    head_dim = config.get("head_dim") or config["hidden"] // config["heads"]
    inv_freq = 1.0 / (float(config["rope_theta"]) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    scaling = config.get("rope_scaling")
    if not scaling:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled)


# ---------------------------------------------------------------- files

def shard_files(root: Path, names: list[str]) -> list[str]:
    """The safetensors files of a Hugging Face checkpoint, in order: those its index names (every one
    present), or the single ``model.safetensors``. ``names``: the files the directory (or manifest) has."""
    present = set(names)
    if INDEX_FILE in present:
        try:
            index = json.loads((root / INDEX_FILE).read_bytes())
            weight_map = index["weight_map"]
            wanted = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{root / INDEX_FILE} is not a safetensors index with a weight_map ({e})") from e
        bad = [w for w in wanted if not isinstance(w, str) or "/" in w or w.startswith(".")]
        if bad:
            raise CheckpointError(f"{root / INDEX_FILE} names shard(s) outside the directory: {bad[:3]}")
        missing = [w for w in wanted if w not in present]
        if missing:
            raise CheckpointError(f"{root} is missing shard(s) {missing[:5]} that {INDEX_FILE} lists; re-copy "
                                  "the checkpoint")
        return wanted
    if SINGLE_FILE in present:
        return [SINGLE_FILE]
    sharded = sorted(n for n in present if _HF_SHARD_RE.match(n))
    if sharded:
        raise CheckpointError(f"{root} has shards {sharded[:3]} but no {INDEX_FILE} naming them; re-copy it")
    raise CheckpointError(f"{root} has no {SINGLE_FILE} and no {INDEX_FILE}: no weights in safetensors form")


_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
           "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def safetensors_dtype(code: str, where: str) -> np.dtype:
    """numpy dtype of a safetensors dtype code; BF16 through ml_dtypes (numpy has none)."""
    if code == "BF16":
        return np.dtype(ml_dtypes.bfloat16)
    if code not in _DTYPES:
        raise CheckpointError(f"{where}: dtype {code!r} is not supported; valid: BF16, {', '.join(_DTYPES)}")
    return np.dtype(_DTYPES[code])


def parse_safetensors(data, where: str) -> dict[str, np.ndarray]:
    """Tensors of a safetensors file's bytes (views of ``data``; bfloat16 included, which
    ``safetensors.numpy`` cannot load); CheckpointError naming the file if malformed."""
    try:
        (header_len,) = struct.unpack_from("<Q", data, 0)
        header = json.loads(bytes(data[8:8 + header_len]))
        base = 8 + header_len
        buffer = np.frombuffer(data, np.uint8)
        out = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = (int(x) for x in info["data_offsets"])
            if base + end > len(buffer) or begin > end:
                raise CheckpointError(f"{where} is truncated: tensor {name} ends at byte {base + end}, "
                                      f"the file has {len(buffer)}")
            dtype = safetensors_dtype(info["dtype"], f"{where}:{name}")
            out[name] = buffer[base + begin:base + end].view(dtype).reshape(tuple(info["shape"]))
        return out
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise CheckpointError(f"{where} is not a valid safetensors file ({e})") from e


def rename_weights(tensors: dict[str, np.ndarray], tied: bool = False) -> dict[str, np.ndarray]:
    """Hugging Face tensor names -> internal ones (unused tensors dropped; with ``tied`` embeddings a
    stored copy of lm_head is dropped too: the model reads the embedding)."""
    out = {}
    for name, array in tensors.items():
        internal = internal_name(name)
        if internal is not None and not (tied and internal == "lm_head"):
            out[internal] = array
    return out


def generation_eos_ids(root: Path, read=None) -> list[int]:
    """``eos_token_id`` of ``generation_config.json`` (an id or a list), else config.json's; [] if neither.
    ``read(name) -> bytes``: how to read a file (a verified read), default plain."""
    read = read or (lambda name: (root / name).read_bytes())
    for name in (GENERATION_CONFIG, "config.json"):
        if not (root / name).exists():
            continue
        try:
            value = json.loads(read(name)).get("eos_token_id")
        except (ValueError, AttributeError) as e:
            raise CheckpointError(f"{root / name} is not a JSON object ({e})") from e
        ids = value if isinstance(value, list) else [value] if value is not None else []
        if ids and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            return list(ids)
        if ids:
            raise CheckpointError(f"{root / name}: eos_token_id must be an id or a list of ids, found {value!r}")
    return []
