"""Byte tokenizer, streaming decoder and chat template."""

import pytest

from exaserve_hpc.engine.tokenizer import (
    BOS, EOS, PAD, VOCAB_SIZE, ByteTokenizer, IncrementalDecoder, apply_chat_template,
)

TEXT = "Grüße, 世界! 😀 tab\tend"


def test_ids_layout():
    assert (BOS, EOS, PAD, VOCAB_SIZE) == (256, 257, 258, 259)


def test_encode_decode_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids[0] == BOS
    assert ids[1:] == list(TEXT.encode("utf-8"))
    assert tok.decode(ids) == TEXT
    assert tok.encode(TEXT, add_bos=False) == ids[1:]
    assert tok.encode("") == [BOS]


def test_decode_skips_specials_and_replaces_invalid_utf8():
    tok = ByteTokenizer()
    assert tok.decode([BOS, 104, PAD, 105, EOS]) == "hi"
    assert tok.decode([0xFF, 104]) == "\ufffdh"
    with pytest.raises(ValueError, match="token id 300"):
        tok.decode([300])
    with pytest.raises(TypeError):
        tok.encode(b"bytes")


def test_incremental_decoder_never_splits_a_character():
    dec = IncrementalDecoder()
    ids = ByteTokenizer().encode(TEXT)
    pieces = [dec.feed([i]) for i in ids]
    assert "".join(pieces) + dec.flush() == TEXT
    assert not any("\ufffd" in p for p in pieces)
    # The emoji's 4 bytes: nothing until the last one arrives.
    emoji = list("😀".encode())
    assert [dec.feed([b]) for b in emoji] == ["", "", "", "😀"]


def test_incremental_decoder_flush_emits_dangling_bytes():
    dec = IncrementalDecoder()
    assert dec.feed([0xE4, 0xB8]) == ""  # first two bytes of a 3-byte char
    assert dec.flush() == "\ufffd"
    assert dec.feed([104, EOS]) == "h"  # reset after flush, specials skipped


def test_incremental_decoder_replaces_invalid_bytes_at_once():
    dec = IncrementalDecoder()
    assert dec.feed([0xFF, 104]) == "\ufffdh"


def test_chat_template_format():
    prompt = apply_chat_template([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Why?"},
    ])
    assert prompt == ("<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello.\n"
                      "<|user|>\nWhy?\n<|assistant|>\n")


@pytest.mark.parametrize("messages, match", [
    ([{"role": "tool", "content": "x"}], r"messages\[0\]\.role is 'tool'"),
    ([{"role": "user", "content": "a"}, {"content": "b"}], r"messages\[1\]\.role is None"),
    ([{"role": "user", "content": None}], r"messages\[0\]\.content must be a string"),
    ([{"role": "user"}], r"messages\[0\]\.content"),
    (["hello"], r"messages\[0\] must be an object"),
    ([], "empty"),
    ("hello", "must be a list"),
])
def test_chat_template_rejects_bad_messages(messages, match):
    with pytest.raises(ValueError, match=match):
        apply_chat_template(messages)
