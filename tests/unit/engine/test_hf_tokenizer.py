"""HfTokenizer: a checkpoint's tokenizer.json, special tokens, chat template and streaming decode.

The tokenizers are built here with the tokenizers library (no network, no transformers): a
byte-level BPE like GPT-2/Llama-3/Qwen2's, and a byte-fallback BPE like Llama-2/Mistral's in
two decoder styles (Llama-2's Replace/ByteFallback/Fuse/Strip, and the Metaspace decoder).
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers  # noqa: E402
from tokenizers import processors, trainers  # noqa: E402

from exaserve_hpc.engine.hf_tokenizer import (  # noqa: E402
    ChatTemplateError, HfTokenizer, IncrementalDetokenizer, ModelTokenizer, TokenizerError,
    clean_up_tokenization, load_tokenizer,
)
from exaserve_hpc.engine.tokenizer import (  # noqa: E402
    BOS, EOS, ByteTokenizer, IncrementalDecoder, apply_chat_template,
)

CORPUS = [
    "Hello world! How are you today? I'm fine, thanks.",
    "The quick brown fox jumps over the lazy dog.",
    "Don't stop: we're here, they've gone, it's late. Isn't it?",
    "Grüße aus München. Ça va? numbers 12345 67890",
    "世界你好 emoji 😀 party",
] * 3
ASCII_CORPUS = [line for line in CORPUS if line.isascii()]

BYTE_LEVEL_SPECIALS = ["<|begin|>", "<|start|>", "<|end|>", "<|eot|>", "<|pad|>"]

# ChatML-like, written with block tags on their own indented lines: trim_blocks and lstrip_blocks
# are what keep that indentation and those newlines out of the prompt.
CHATML_TEMPLATE = """\
{% for message in messages %}
    {% if message['role'] == 'system' and not loop.first %}
        {{ raise_exception('System message must come first, got one at position ' ~ loop.index0) }}
    {% endif %}
<|start|>{{ message['role'] }}
{{ message['content'] }}<|end|>
{% endfor %}
{% if add_generation_prompt %}
<|start|>assistant
{% endif %}
"""

LLAMA2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}{% endfor %}"
)

NAMED_DEFAULT = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
NAMED_TOOL = "TOOLS {{ tools | tojson }}"

HI = [{"role": "user", "content": "Hi"}]


# ----------------------------------------------------------------------------- building


def _byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420, special_tokens=BYTE_LEVEL_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    begin = tok.token_to_id("<|begin|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin|> $A", special_tokens=[("<|begin|>", begin)]
    )
    return tok


def _byte_fallback(metaspace_decoder: bool) -> Tokenizer:
    """A Llama-2-like BPE: <unk> <s> </s>, then <0x00>..<0xFF>, then pieces from ASCII text."""
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    base.train_from_iterator(ASCII_CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    data = json.loads(base.to_str())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece, _ in sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in data["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if metaspace_decoder:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([
            decoders.ByteFallback(),
            decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False),
        ])
    else:  # Llama-2's tokenizer.json
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence([
            decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
        ])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def _write(path: Path, name: str, data) -> None:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    (path / name).write_text(text, encoding="utf-8")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """Checkpoint directories, one per tokenizer kind and template layout."""
    out = {}

    # Byte-level BPE; template in chat_template.jinja (wins over the config's); EOS list.
    d = out["bytelevel"] = tmp_path_factory.mktemp("bytelevel")
    tok = _byte_level()
    tok.save(str(d / "tokenizer.json"))
    _write(d, "tokenizer_config.json", {
        "bos_token": "<|begin|>",
        "eos_token": {"__type": "AddedToken", "content": "<|eot|>", "special": True},
        "pad_token": "<|pad|>",
        "chat_template": "CONFIG TEMPLATE MUST NOT BE USED",
        "clean_up_tokenization_spaces": False,
    })
    _write(d, "chat_template.jinja", CHATML_TEMPLATE)
    _write(d, "generation_config.json", {
        "bos_token_id": tok.token_to_id("<|begin|>"),
        "eos_token_id": [tok.token_to_id("<|end|>"), tok.token_to_id("<|eot|>")],
    })

    # The same, with clean_up_tokenization_spaces (as Llama-3's tokenizer_config.json has).
    d = out["bytelevel_cleanup"] = tmp_path_factory.mktemp("bytelevel_cleanup")
    tok.save(str(d / "tokenizer.json"))
    _write(d, "tokenizer_config.json", {
        "bos_token": "<|begin|>", "eos_token": "<|eot|>", "clean_up_tokenization_spaces": True,
    })
    _write(d, "generation_config.json", {"eos_token_id": tok.token_to_id("<|eot|>")})

    # Llama-2 style byte fallback; template string in tokenizer_config.json; EOS an int.
    d = out["llama2"] = tmp_path_factory.mktemp("llama2")
    _byte_fallback(metaspace_decoder=False).save(str(d / "tokenizer.json"))
    _write(d, "tokenizer_config.json", {
        "bos_token": {"content": "<s>", "lstrip": False, "special": True},
        "eos_token": "</s>", "unk_token": "<unk>", "chat_template": LLAMA2_TEMPLATE,
        "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
    })
    _write(d, "generation_config.json", {"bos_token_id": 1, "eos_token_id": 2})

    # Metaspace decoder; list of named templates; EOS from config.json (no generation_config).
    d = out["metaspace"] = tmp_path_factory.mktemp("metaspace")
    _byte_fallback(metaspace_decoder=True).save(str(d / "tokenizer.json"))
    _write(d, "tokenizer_config.json", {
        "bos_token": "<s>", "unk_token": "<unk>",
        "chat_template": [
            {"name": "tool_use", "template": NAMED_TOOL},
            {"name": "default", "template": NAMED_DEFAULT},
        ],
    })
    _write(d, "config.json", {"architectures": ["MistralForCausalLM"], "eos_token_id": 2})
    return out


@pytest.fixture(scope="module")
def toks(dirs) -> dict[str, HfTokenizer]:
    return {kind: HfTokenizer.from_dir(path) for kind, path in dirs.items()}


# ----------------------------------------------------------------------------- loading


def test_special_tokens_and_eos_from_a_list(toks):
    tok = toks["bytelevel"]
    raw = tok._tokenizer
    assert tok.bos_token == "<|begin|>" and tok.eos_token == "<|eot|>"
    assert tok.eos_token_ids == frozenset({raw.token_to_id("<|end|>"), raw.token_to_id("<|eot|>")})
    assert tok.bos_token_id == raw.token_to_id("<|begin|>")
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True) == len(raw.get_vocab())
    assert tok.has_chat_template


def test_eos_from_an_int_and_from_config_json(toks):
    assert toks["llama2"].eos_token_ids == frozenset({2})
    assert toks["llama2"].bos_token == "<s>" and toks["llama2"].eos_token == "</s>"
    # No generation_config.json and no eos_token: config.json's eos_token_id.
    assert toks["metaspace"].eos_token is None
    assert toks["metaspace"].eos_token_ids == frozenset({2})


def test_the_tokenizer_eos_is_added_to_the_generation_config_list(tmp_path, dirs):
    d = tmp_path / "ck"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((dirs["bytelevel"] / "tokenizer.json").read_bytes())
    _write(d, "tokenizer_config.json", {"eos_token": "<|eot|>"})
    _write(d, "generation_config.json", {"eos_token_id": 2})  # <|end|>
    tok = HfTokenizer.from_dir(d)
    assert tok.eos_token_ids == frozenset({2, tok._tokenizer.token_to_id("<|eot|>")})


def test_both_satisfy_the_protocol(toks):
    for tok in [*toks.values(), ByteTokenizer()]:
        assert isinstance(tok, ModelTokenizer)


# ----------------------------------------------------------------------------- encode/decode

TEXTS = ["Hello world! How are you?", "Grüße, 世界! 😀 🦀 tab\tend", "", " leading space", "a  b   c"]


@pytest.mark.parametrize("kind", ["bytelevel", "bytelevel_cleanup", "llama2", "metaspace"])
@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(toks, kind, text):
    tok = toks[kind]
    ids = tok.encode(text)
    plain = tok.encode(text, add_special_tokens=False)
    bos = tok._tokenizer.token_to_id("<|begin|>" if kind.startswith("bytelevel") else "<s>")
    assert ids == [bos, *plain]
    assert tok.decode(ids) == tok.decode(plain)
    expected = clean_up_tokenization(text) if kind == "bytelevel_cleanup" else text
    if kind == "metaspace":  # its Metaspace decoder drops every "▁" of the first token
        assert tok.decode(ids) == tok._tokenizer.decode(ids, skip_special_tokens=True)
    else:
        assert tok.decode(ids) == expected
    if kind != "metaspace":
        assert tok.decode(ids, skip_special_tokens=False).startswith(
            "<|begin|>" if kind.startswith("bytelevel") else "<s>")


def test_byte_fallback_splits_unknown_characters_into_byte_tokens(toks):
    tok = toks["llama2"]
    pieces = [tok._tokenizer.id_to_token(i) for i in tok.encode("世", add_special_tokens=False)]
    assert pieces[-3:] == ["<0xE4>", "<0xB8>", "<0x96>"]


def test_clean_up_tokenization_spaces(toks):
    text = "Hello , world . Is n't it ? I 'm here !"
    ids = toks["bytelevel_cleanup"].encode(text, add_special_tokens=False)
    assert toks["bytelevel_cleanup"].decode(ids) == "Hello, world. Isn't it? I'm here!"
    assert toks["bytelevel"].decode(ids) == text


def test_decode_rejects_ids_outside_the_vocabulary(toks):
    with pytest.raises(TokenizerError, match=r"token id 9999 is outside"):
        toks["bytelevel"].decode([5, 9999])
    with pytest.raises(TokenizerError, match="outside"):
        toks["bytelevel"].incremental().feed([-1])


# ----------------------------------------------------------------------------- chat


def test_chat_template_file_wins_and_trim_lstrip_blocks(toks):
    tok = toks["bytelevel"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = "<|start|>system\nBe brief.<|end|>\n<|start|>user\nHi<|end|>\n"
    assert tok.render_chat(messages, add_generation_prompt=False) == expected
    assert tok.render_chat(messages) == expected + "<|start|>assistant\n"
    # Without trim_blocks/lstrip_blocks the block lines would leave whitespace behind.
    plain = jinja2.Environment().from_string(CHATML_TEMPLATE).render(
        messages=messages, add_generation_prompt=True)
    assert plain != tok.render_chat(messages)
    ids = tok.encode_chat(messages)
    assert ids == tok.encode(expected + "<|start|>assistant\n", add_special_tokens=False)
    start = tok._tokenizer.token_to_id("<|start|>")
    assert ids[0] == start and ids.count(start) == 3  # specials matched, no BOS added


def test_template_raise_exception_gives_its_message(toks):
    messages = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "late"}]
    with pytest.raises(ChatTemplateError) as info:
        toks["bytelevel"].render_chat(messages)
    assert str(info.value) == "System message must come first, got one at position 1"
    assert isinstance(info.value, ValueError)
    with pytest.raises(ChatTemplateError, match="^Conversation roles must alternate"):
        toks["llama2"].encode_chat([{"role": "assistant", "content": "x"}])


def test_llama2_template_uses_bos_and_eos_tokens(toks):
    tok = toks["llama2"]
    messages = [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Why?"},
    ]
    rendered = tok.render_chat(messages)
    assert rendered == "<s>[INST] Hi [/INST] Hello.</s>[INST] Why? [/INST]"
    ids = tok.encode_chat(messages)
    assert ids[0] == 1 and ids.count(1) == 1 and 2 in ids  # BOS from the template only


def test_named_templates_use_default(toks, dirs, tmp_path):
    tok = toks["metaspace"]
    assert tok.render_chat(HI) == "<user>Hi<assistant>"
    assert tok.render_chat(HI, add_generation_prompt=False) == "<user>Hi"
    d = tmp_path / "nodefault"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((dirs["metaspace"] / "tokenizer.json").read_bytes())
    _write(d, "tokenizer_config.json", {"eos_token": "</s>", "chat_template": [
        {"name": "tool_use", "template": NAMED_TOOL}]})
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json.*none is named 'default'"):
        HfTokenizer.from_dir(d)


def test_tojson_and_strftime_now_as_transformers_defines_them(tmp_path, dirs):
    d = tmp_path / "tj"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((dirs["bytelevel"] / "tokenizer.json").read_bytes())
    _write(d, "tokenizer_config.json", {"eos_token": "<|eot|>", "unk_token": "<|pad|>"})
    _write(d, "chat_template.jinja",
           "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2) }}|{{ strftime_now('%Y') | length }}"
           "|{{ unk_token }}|{{ bos_token is defined }}|{{ tools is none }}")
    tok = HfTokenizer.from_dir(d)
    messages = [{"role": "user", "content": "<b>é</b> & \"q\""}]
    out = tok.render_chat(messages)
    assert out == (json.dumps(messages, ensure_ascii=False) + "|"
                   + json.dumps(messages[0], ensure_ascii=False, indent=2) + "|4|<|pad|>|False|True")


def test_template_failures_are_chat_template_errors(tmp_path, dirs):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((dirs["bytelevel"] / "tokenizer.json").read_bytes())
    _write(d, "tokenizer_config.json", {"eos_token": "<|eot|>"})
    _write(d, "chat_template.jinja", "{{ messages[0]['content'] + 1 }}")
    with pytest.raises(ChatTemplateError, match="failed on these messages"):
        HfTokenizer.from_dir(d).render_chat(HI)
    _write(d, "chat_template.jinja", "{% for m in messages %}")  # does not compile
    with pytest.raises(TokenizerError, match="chat_template.jinja does not compile"):
        HfTokenizer.from_dir(d).render_chat(HI)
    # The sandbox refuses attribute access to internals.
    _write(d, "chat_template.jinja", "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        HfTokenizer.from_dir(d).render_chat(HI)


def test_no_chat_template(toks, dirs):
    tok = toks["bytelevel_cleanup"]
    assert not tok.has_chat_template
    with pytest.raises(TokenizerError, match="use /v1/completions") as info:
        tok.encode_chat(HI)
    assert str(dirs["bytelevel_cleanup"]) in str(info.value)


def test_concurrent_rendering(toks):
    from concurrent.futures import ThreadPoolExecutor

    tok = toks["llama2"]

    def one(i):
        messages = [{"role": "user", "content": f"n{i}"}]
        return tok.render_chat(messages) == f"<s>[INST] n{i} [/INST]" and tok.encode_chat(messages)

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(one, range(200)))


# ----------------------------------------------------------------------------- missing/bad files


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match="needs a fast tokenizer file"):
        HfTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(TokenizerError, match="tokenizer.model alone is not supported"):
        HfTokenizer.from_dir(tmp_path)
    with pytest.raises(TokenizerError, match="does not exist"):
        HfTokenizer.from_dir(tmp_path / "nope")


def _copy_tokenizer(dirs, tmp_path, name="ck") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "tokenizer.json").write_bytes((dirs["bytelevel"] / "tokenizer.json").read_bytes())
    return d


@pytest.mark.parametrize("files, match", [
    ({"tokenizer_config.json": "{not json"}, r"tokenizer_config.json is not valid JSON"),
    ({"tokenizer_config.json": "[]"}, r"tokenizer_config.json must hold a JSON object"),
    ({"tokenizer_config.json": {"eos_token": 5}}, r"tokenizer_config.json: eos_token must be a string"),
    ({"tokenizer_config.json": {"eos_token": "<|nope|>"}}, r"eos_token '<\|nope\|>' is not in the vocabulary"),
    ({"tokenizer_config.json": {"chat_template": 3, "eos_token": "<|eot|>"}}, r"chat_template must be a string"),
    ({"tokenizer_config.json": {}, "generation_config.json": {"eos_token_id": "x"}},
     r"generation_config.json: eos_token_id must be an int or a list"),
    ({"tokenizer_config.json": {}, "generation_config.json": {"eos_token_id": [99999]}},
     r"eos_token_id \[99999\] is outside the vocabulary"),
    ({"tokenizer_config.json": {}}, r"names no end-of-sequence token"),
    ({"tokenizer.json": "{}"}, r"tokenizer.json is not a tokenizer file"),
])
def test_bad_files_are_named(dirs, tmp_path, files, match):
    d = _copy_tokenizer(dirs, tmp_path)
    for name, data in files.items():
        _write(d, name, data)
    with pytest.raises(TokenizerError, match=match):
        HfTokenizer.from_dir(d)


def test_load_tokenizer(dirs, tmp_path):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer(dirs["llama2"]), HfTokenizer)
    exa = tmp_path / "exa"
    exa.mkdir()
    _write(exa, "config.json", {"format": "exaserve-llama-v1", "vocab_size": 259})
    assert isinstance(load_tokenizer(exa), ByteTokenizer)
    other = tmp_path / "other"
    other.mkdir()
    _write(other, "config.json", {"architectures": ["LlamaForCausalLM"]})
    with pytest.raises(TokenizerError, match="has no tokenizer.json"):
        load_tokenizer(other)
    (other / "tokenizer.model").write_bytes(b"\x00")
    with pytest.raises(TokenizerError, match="tokenizer.model alone is not supported"):
        load_tokenizer(other)
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")


# ----------------------------------------------------------------------------- streaming

KINDS = ["bytelevel", "bytelevel_cleanup", "llama2", "metaspace"]


def _stream(tok, ids, chunks):
    """Feed ``ids`` in pieces of the given sizes; the pieces and the flush."""
    det = tok.incremental()
    out, i = [], 0
    for size in chunks:
        out.append(det.feed(ids[i:i + size]))
        i += size
    out.append(det.feed(ids[i:]))
    return out, det.flush()


@pytest.mark.parametrize("kind", KINDS)
def test_incremental_never_splits_characters(toks, kind):
    tok = toks[kind]
    text = "Grüße, 世界! 😀 🦀 I'm ok , fine . Done"
    ids = tok.encode(text)
    pieces, rest = _stream(tok, ids, [1] * len(ids))
    assert "".join(pieces) + rest == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)
    assert len([p for p in pieces if p]) > 3  # it did stream


def test_incremental_emoji_over_byte_tokens(toks):
    tok = toks["llama2"]
    raw = tok._tokenizer
    ids = [raw.token_to_id(f"<0x{b:02X}>") for b in "😀".encode()]
    ids += tok.encode("ok", add_special_tokens=False)  # the normalizer prepends "▁"
    det = tok.incremental()
    assert [det.feed([i]) for i in ids[:4]] == ["", "", "", ""]  # a byte run may still grow
    assert det.feed(ids[4:]) == "😀 ok"
    assert det.flush() == ""
    assert tok.decode(ids) == "😀 ok"
    # A byte run that turns out invalid: every byte of the run becomes U+FFFD, as decode has it.
    bad = ids[:3] + [raw.token_to_id("<0xFF>")] + ids[4:]
    det = tok.incremental()
    streamed = "".join(det.feed([i]) for i in bad) + det.flush()
    assert streamed == tok.decode(bad) == "\ufffd" * 4 + " ok"


def test_incremental_byte_level_holds_half_characters(toks):
    tok = toks["bytelevel"]
    raw = tok._tokenizer
    byte_to_char = {b: c for b, c in zip(range(256), _bytes_to_unicode())}
    ids = [raw.token_to_id(byte_to_char[b]) for b in "🦀".encode()]
    det = tok.incremental()
    assert [det.feed([i]) for i in ids] == ["", "", "", "🦀"]
    # A dangling half character comes out (as U+FFFD) only at the end, as decode has it.
    assert det.feed(ids[:2]) == ""
    assert det.flush() == tok.decode(ids[:2]) == "\ufffd"


def test_incremental_keeps_mid_stream_leading_spaces(toks):
    """Llama-2's Strip decoder drops the first space of the whole text, and only that one."""
    tok = toks["llama2"]
    raw = tok._tokenizer
    space = raw.token_to_id("▁")
    word = tok.encode("Hello", add_special_tokens=False)
    ids = [space, *word, space, *word, space, space, *word]
    det = tok.incremental()
    out = "".join(det.feed([i]) for i in ids) + det.flush()
    assert out == tok.decode(ids)
    assert out.count(" ") == tok.decode(ids).count(" ") and " Hello" in out


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table (the ByteLevel alphabet), in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def _interesting_ids(tok: HfTokenizer) -> list[int]:
    """Byte tokens, specials, bare spaces and multi-byte pieces: where streaming goes wrong."""
    raw = tok._tokenizer
    ids = set(tok._byte_fallback_ids) | set(tok._special_ids)
    for piece in ["▁", "Ġ", "ä", "¸", "ĸ", "ð", "Ł", "ĺ", "Ģ", ".", ",", "'", "n", "s", "t"]:
        if raw.token_to_id(piece) is not None:
            ids.add(raw.token_to_id(piece))
    for text in ["世界", "😀", " 's", " n't", " ."]:
        ids.update(tok.encode(text, add_special_tokens=False))
    return sorted(ids)


@pytest.mark.parametrize("kind", KINDS)
def test_incremental_equals_full_decode(toks, kind):
    tok = toks[kind]
    interesting = _interesting_ids(tok)
    token = st.one_of(st.integers(0, tok.vocab_size - 1), st.sampled_from(interesting))
    from_text = st.one_of(
        st.text(st.characters(codec="utf-8", categories=["L", "N", "P", "Zs", "So"]), max_size=30),
        # Clean-up patterns (" .", " n't", " ' ", ...), spaces and multi-byte characters.
        st.lists(st.sampled_from([" ", "  ", ".", ",", "?", "!", "'", "n't", "'s", "'m", "'re",
                                  "'ve", "a", "is", "世", "😀", "é", "▁"]), max_size=20).map("".join),
    ).map(lambda s: tok.encode(s))

    @settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
    @given(
        ids=st.one_of(st.lists(token, max_size=40), from_text,
                      st.tuples(from_text, st.lists(token, max_size=6)).map(lambda t: t[0] + t[1])),
        chunks=st.lists(st.integers(1, 4), max_size=40),
    )
    def check(ids, chunks):
        pieces, rest = _stream(tok, ids, chunks)
        assert "".join(pieces) + rest == tok.decode(ids)

    check()


def test_flush_resets(toks):
    tok = toks["bytelevel"]
    det = tok.incremental()
    ids = tok.encode("Hello world")
    assert det.feed(ids) + det.flush() == "Hello world"
    assert det.feed(ids) + det.flush() == "Hello world"
    assert isinstance(det, IncrementalDetokenizer)


# ----------------------------------------------------------------------------- byte tokenizer


def test_byte_tokenizer_protocol_additions():
    tok = ByteTokenizer()
    assert tok.eos_token_ids == frozenset({EOS})
    assert tok.encode("hi", add_special_tokens=False) == tok.encode("hi", add_bos=False) == [104, 105]
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi") == [BOS, 104, 105]
    assert tok.encode("hi", False) == [104, 105]  # the old positional add_bos still works
    assert tok.encode_chat(HI) == tok.encode(apply_chat_template(HI))
    det = tok.incremental()
    assert isinstance(det, IncrementalDecoder)
    assert det.feed(tok.encode("😀")[:3]) == "" and det.feed(tok.encode("😀")[3:]) == "😀"


# ----------------------------------------------------------------------------- golden fixtures

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "hf"
FAMILIES = ["llama3", "mistral", "qwen2"]


def _golden(family: str) -> dict:
    """The family's cases: tests/fixtures/hf/golden.json["families"][family] (make_golden.py)."""
    per_family = FIXTURES / family / "golden.json"
    if per_family.is_file():
        return json.loads(per_family.read_text(encoding="utf-8"))
    shared = json.loads((FIXTURES / "golden.json").read_text(encoding="utf-8"))
    return shared.get("families", shared)[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_transformers_golden(family):
    """Renderings, ids, decodes, raises and special tokens exactly as real transformers made them."""
    if not (FIXTURES / family).is_dir():
        pytest.skip(f"no golden fixture folder {FIXTURES / family}")
    tok = HfTokenizer.from_dir(FIXTURES / family)
    assert isinstance(load_tokenizer(FIXTURES / family), HfTokenizer)
    golden = _golden(family)
    assert golden.get("chat") and golden.get("encode"), f"{family}: golden.json has no cases"
    if "vocab_size" in golden:
        assert tok.vocab_size == golden["vocab_size"]
    if "eos_token_ids" in golden:
        assert tok.eos_token_ids == frozenset(golden["eos_token_ids"])
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if name in golden:
            assert tok.special_tokens.get(name) == golden[name], name
    assert tok.has_chat_template
    for case in golden["chat"]:
        add = case.get("add_generation_prompt", True)
        if "raises" in case:
            with pytest.raises(ChatTemplateError) as info:
                tok.render_chat(case["messages"], add_generation_prompt=add)
            assert str(info.value) == case["raises"], case
            continue
        assert tok.render_chat(case["messages"], add_generation_prompt=add) == case["rendered"], case
        assert tok.encode_chat(case["messages"], add_generation_prompt=add) == case["ids"], case
    for case in golden["encode"]:
        assert tok.encode(case["text"], add_special_tokens=False) == case["ids"], case
        assert tok.encode(case["text"]) == case["ids_with_specials"], case
        assert tok.decode(case["ids"]) == case["decoded"], case
        if "decoded_keep_specials" in case:
            assert tok.decode(case["ids"], skip_special_tokens=False) == case["decoded_keep_specials"], case
        for ids in (case["ids"], case["ids_with_specials"]):
            det = tok.incremental()
            streamed = "".join(det.feed([i]) for i in ids) + det.flush()
            assert streamed == tok.decode(ids), case
