"""Byte-level tokenizer for the reference engine.

Token ids 0..255 are the raw UTF-8 bytes of the text; three special ids
follow: BOS=256, EOS=257, PAD=258 (VOCAB_SIZE=259). Any text round-trips
exactly, and no vocabulary file is needed, so the tiny test checkpoints and
the gateway agree on token counts without shipping a tokenizer.

Call protocol:
- ``ByteTokenizer().encode(text)`` -> ids (BOS first unless ``add_bos=False``).
- ``ByteTokenizer().decode(ids)`` -> text; specials are skipped and invalid
  UTF-8 becomes U+FFFD.
- Streaming: one ``IncrementalDecoder`` per response; ``feed(ids)`` returns
  only the text of complete UTF-8 sequences, ``flush()`` once at the end.
- ``ByteTokenizer`` also satisfies the ``ModelTokenizer`` protocol of
  ``engine/hf_tokenizer.py`` (``eos_token_ids``, ``encode(text,
  add_special_tokens=...)``, ``encode_chat``, ``incremental``), so the gateway
  treats it like a Hugging Face model's tokenizer.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Mapping, Sequence

BOS = 256
EOS = 257
PAD = 258
VOCAB_SIZE = 259
SPECIAL_IDS = frozenset({BOS, EOS, PAD})

CHAT_ROLES = ("system", "user", "assistant")


def _bytes_of(ids: Iterable[int]) -> bytes:
    """Byte ids as bytes, specials dropped; out-of-range ids are an error."""
    if ids.__class__ in (list, tuple):  # the common case, in C, when every id is a byte (else: the loop)
        try:
            return bytes(ids)
        except (ValueError, TypeError):
            pass
    out = bytearray()
    for i in ids:
        if 0 <= i < 256:
            out.append(i)
        elif i not in SPECIAL_IDS:
            raise ValueError(
                f"token id {i} is outside the byte tokenizer's vocabulary "
                f"0..{VOCAB_SIZE - 1}; the ids come from a model with a different "
                "vocabulary"
            )
    return bytes(out)


class ByteTokenizer:
    """Stateless byte tokenizer; see the module docstring for the ids."""

    bos_token_id = BOS
    eos_token_id = EOS
    pad_token_id = PAD
    vocab_size = VOCAB_SIZE

    eos_token_ids = frozenset({EOS})

    def encode(
        self, text: str, add_bos: bool = True, *, add_special_tokens: bool | None = None
    ) -> list[int]:
        """UTF-8 bytes of ``text`` as ids, preceded by BOS when ``add_bos``.

        ``add_special_tokens`` (the ModelTokenizer protocol's name) is an alias of ``add_bos``
        and wins when given.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        if add_special_tokens is not None:
            add_bos = add_special_tokens
        ids = list(text.encode("utf-8"))
        return [BOS, *ids] if add_bos else ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; specials skipped, invalid UTF-8 replaced (U+FFFD)."""
        return _bytes_of(ids).decode("utf-8", errors="replace")

    def encode_chat(
        self, messages: Sequence[Mapping[str, object]], add_generation_prompt: bool = True
    ) -> list[int]:
        """``apply_chat_template(messages)`` encoded with BOS first.

        The byte template always ends with the assistant header, so ``add_generation_prompt``
        is accepted for the ModelTokenizer protocol and otherwise ignored.
        """
        return self.encode(apply_chat_template(messages))

    def incremental(self) -> "IncrementalDecoder":
        """A fresh streaming decoder for one response (the ModelTokenizer protocol)."""
        return IncrementalDecoder()


class IncrementalDecoder:
    """Turns a stream of token ids into text without splitting characters.

    A multi-byte character may arrive over several steps; ``feed`` holds the
    incomplete tail back until the rest arrives, so a streamed response never
    shows a spurious U+FFFD. Bytes that can never form a valid sequence are
    replaced at once. Call ``flush()`` when the stream ends to emit (as
    U+FFFD) a dangling incomplete sequence.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Iterable[int]) -> str:
        """Text completed by ``ids`` (possibly empty)."""
        return self._decoder.decode(_bytes_of(ids), final=False)

    def flush(self) -> str:
        """Text of whatever is still held back; the decoder is then reset."""
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text


def apply_chat_template(messages: Sequence[Mapping[str, object]]) -> str:
    """Render OpenAI-style chat messages as one prompt string.

    Each message becomes ``<|role|>\\ncontent\\n``; a trailing
    ``<|assistant|>\\n`` asks the model for the next assistant turn. Raises
    ValueError naming the message index and the bad role or field.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(
            f"messages must be a list of {{'role', 'content'}} objects, got "
            f"{type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages is empty; send at least one user message")
    parts = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(
                f"messages[{index}] must be an object with 'role' and 'content', "
                f"got {type(message).__name__}"
            )
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(
                f"messages[{index}].role is {role!r}; valid roles are "
                f"{', '.join(CHAT_ROLES)}"
            )
        content = message.get("content")
        if not isinstance(content, str):
            raise ValueError(
                f"messages[{index}].content must be a string, got "
                f"{type(content).__name__}"
            )
        parts.append(f"<|{role}|>\n{content}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)
