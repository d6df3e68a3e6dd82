"""The numpy Llama model against a plain, loop-based reference."""

import numpy as np
import pytest

from exaserve_hpc.cache.checkpoint import (
    CheckpointError, TinyModelSpec, create_tiny_checkpoint, load_checkpoint,
)
from exaserve_hpc.engine.model import LlamaModel, apply_rope, rope_tables

SPEC = TinyModelSpec(layers=2, hidden=32, heads=4, kv_heads=2, intermediate=48,
                     max_position=64, shards=1, seed=3)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_checkpoint(create_tiny_checkpoint(tmp_path_factory.mktemp("m") / "tiny", SPEC))


@pytest.fixture(scope="module")
def model(loaded):
    return LlamaModel(*loaded)


def naive_logits(config, w, ids):
    """Logits at every position, written the slow obvious way: full
    recomputation, explicit loops over positions and heads, RoPE as a complex
    rotation, kv head of query head h = h // (heads / kv_heads)."""
    hidden, heads, kvh = config["hidden"], config["heads"], config["kv_heads"]
    hd, eps = hidden // heads, config["norm_eps"]
    half = hd // 2
    freqs = config["rope_theta"] ** (-np.arange(half) * 2.0 / hd)

    def norm(x, g):
        return x / np.sqrt(np.mean(x ** 2) + eps) * g

    def rot(vec, pos):
        z = (vec[:half] + 1j * vec[half:]) * np.exp(1j * pos * freqs)
        return np.concatenate([z.real, z.imag])

    xs = [w["embed"][t].astype(np.float64) for t in ids]
    for n in range(config["layers"]):
        p = f"layers.{n}."
        hs = [norm(x, w[p + "attn_norm"]) for x in xs]
        qs = [(w[p + "attn.wq"] @ h).reshape(heads, hd) for h in hs]
        ks = [(w[p + "attn.wk"] @ h).reshape(kvh, hd) for h in hs]
        vs = [(w[p + "attn.wv"] @ h).reshape(kvh, hd) for h in hs]
        new = []
        for i, x in enumerate(xs):
            out = np.zeros((heads, hd))
            for head in range(heads):
                g = head // (heads // kvh)
                q = rot(qs[i][head], i)
                scores = np.array([q @ rot(ks[j][g], j) for j in range(i + 1)]) / np.sqrt(hd)
                probs = np.exp(scores - scores.max())
                probs /= probs.sum()
                out[head] = sum(probs[j] * vs[j][g] for j in range(i + 1))
            x = x + w[p + "attn.wo"] @ out.reshape(-1)
            h = norm(x, w[p + "mlp_norm"])
            gate, up = w[p + "mlp.w1"] @ h, w[p + "mlp.w3"] @ h
            new.append(x + w[p + "mlp.w2"] @ (gate / (1 + np.exp(-gate)) * up))
        xs = new
    head = w["embed"] if config.get("tie_embeddings") else w["lm_head"]
    bias = w.get("lm_head_bias", 0.0)
    return np.stack([head @ norm(x, w["norm"]) + bias for x in xs])


def test_prefill_and_decode_match_naive_reference(loaded, model):
    config, weights = loaded
    ids = [256, 72, 105, 33, 10, 200, 7, 65, 66]
    want = naive_logits(config, weights, ids)
    cache = model.new_cache()
    got = model.prefill(ids[:5], cache)
    assert got.shape == (config["vocab_size"],)
    np.testing.assert_allclose(got, want[4], rtol=1e-4, atol=1e-4)
    for pos in range(5, len(ids)):
        got = model.decode([(ids[pos], cache)])
        assert got.shape == (1, config["vocab_size"])
        np.testing.assert_allclose(got[0], want[pos], rtol=1e-4, atol=1e-4)
    assert cache.num_tokens == len(ids)


def test_gqa_equals_mha_with_repeated_kv_heads(tmp_path, loaded, model):
    """Query head h must use kv head h // group: an MHA model whose k/v heads
    are the GQA heads repeated group-wise gives the same logits."""
    config, weights = loaded
    mha_config = {**config, "kv_heads": config["heads"]}
    hd = config["hidden"] // config["heads"]
    group = config["heads"] // config["kv_heads"]
    mha = dict(weights)
    for n in range(config["layers"]):
        for name in ("attn.wk", "attn.wv"):
            w = weights[f"layers.{n}.{name}"].reshape(config["kv_heads"], hd, -1)
            mha[f"layers.{n}.{name}"] = np.repeat(w, group, axis=0).reshape(-1, config["hidden"])
    ids = [256, 1, 2, 3, 4, 5, 6]
    got = model.prefill(ids, model.new_cache())
    want = LlamaModel(mha_config, mha).prefill(ids, LlamaModel(mha_config, mha).new_cache())
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Sanity: a wrong mapping (h % kv_heads) would differ.
    wrong = dict(mha)
    for n in range(config["layers"]):
        for name in ("attn.wk", "attn.wv"):
            w = weights[f"layers.{n}.{name}"].reshape(config["kv_heads"], hd, -1)
            wrong[f"layers.{n}.{name}"] = np.tile(w, (group, 1, 1)).reshape(-1, config["hidden"])
    other = LlamaModel(mha_config, wrong)
    assert not np.allclose(other.prefill(ids, other.new_cache()), want, atol=1e-3)


def test_rope_scores_depend_only_on_relative_position():
    cos, sin = rope_tables(256, 16, 10000.0)
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 1, 1, 16)).astype(np.float32)

    def score(m, n):
        qm = apply_rope(q, cos[[m]], sin[[m]])
        kn = apply_rope(k, cos[[n]], sin[[n]])
        return float((qm * kn).sum())

    base = score(5, 2)
    for shift in (1, 17, 200):
        assert score(5 + shift, 2 + shift) == pytest.approx(base, rel=1e-4, abs=1e-4)
    assert score(9, 2) != pytest.approx(base, rel=1e-3)
    # Rotation preserves the norm.
    rotated = apply_rope(q, cos[[77]], sin[[77]])
    assert np.linalg.norm(rotated) == pytest.approx(np.linalg.norm(q), rel=1e-5)


def test_batched_decode_equals_unbatched(model):
    prompts = [[256, 10, 20], [256, 1, 2, 3, 4, 5, 6, 7], [256]]
    alone = [model.new_cache() for _ in prompts]
    batched = [model.new_cache() for _ in prompts]
    for ids, a in zip(prompts, alone):
        model.prefill(ids, a)
    prefill = model.prefill_batch(list(zip(prompts, batched)))
    assert prefill.shape == (3, model.vocab_size)
    for ids, row in zip(prompts, prefill):
        np.testing.assert_allclose(row, model.prefill(ids, model.new_cache()), rtol=1e-5, atol=1e-5)
    tokens = [65, 66, 67]
    for _ in range(4):
        got = model.decode(list(zip(tokens, batched)))
        want = np.stack([model.decode([(t, c)])[0] for t, c in zip(tokens, alone)])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        tokens = [int(t) for t in got.argmax(axis=1)]
    assert [c.num_tokens for c in batched] == [len(p) + 4 for p in prompts]


def test_cache_grows_past_initial_capacity_and_stops_at_limit(model):
    cache = model.new_cache(max_tokens=70)  # capped at max_position=64
    model.prefill(list(range(60)), cache)
    for t in range(4):
        model.decode([(t, cache)])
    assert cache.num_tokens == 64
    with pytest.raises(ValueError, match="max_position=64"):
        model.decode([(1, cache)])


def test_tied_embeddings_and_bad_inputs(loaded):
    config, weights = loaded
    tied = {k: v for k, v in weights.items() if k != "lm_head"}
    model = LlamaModel({**config, "tie_embeddings": True}, tied)
    logits = model.prefill([256, 5], model.new_cache())
    want = naive_logits({**config, "tie_embeddings": True}, tied, [256, 5])[-1]
    np.testing.assert_allclose(logits, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="token id 485 is outside the vocabulary 0..484"):
        model.prefill([485], model.new_cache())
    with pytest.raises(CheckpointError, match="missing.*lm_head"):
        LlamaModel(config, tied)
    bad = {**weights, "norm": np.ones(7, np.float32)}
    with pytest.raises(CheckpointError, match=r"norm has shape \(7,\)"):
        LlamaModel(config, bad)
