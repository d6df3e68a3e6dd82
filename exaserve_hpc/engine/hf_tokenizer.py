"""A Hugging Face checkpoint's own tokenizer and chat template, without transformers.

The gateway tokenizes prompts, renders chat messages and streams generated text with the
model's real vocabulary. Everything here uses the ``tokenizers`` library (the Rust
tokenizer behind transformers' fast tokenizers) and ``jinja2``; neither transformers nor
torch is imported.

Files read from a checkpoint directory (``HfTokenizer.from_dir``):

- ``tokenizer.json`` (required): ``tokenizers.Tokenizer.from_file``. A checkpoint with only
  a SentencePiece ``tokenizer.model`` is refused (no slow-tokenizer conversion here).
- ``tokenizer_config.json``: the named special tokens (``bos_token``, ``eos_token``, ...; a
  string or an AddedToken dict ``{"content": ...}``), ``chat_template`` (a string, or a list
  of ``{"name", "template"}`` of which ``"default"`` is used) and
  ``clean_up_tokenization_spaces``.
- ``special_tokens_map.json``: legacy source of the named special tokens, read only when
  tokenizer_config.json has no ``added_tokens_decoder`` (as transformers does).
- ``chat_template.jinja``: takes precedence over tokenizer_config.json's template.
- ``generation_config.json``: ``eos_token_id`` (an int or a list) and ``bos_token_id``;
  ``config.json``'s ``eos_token_id`` is the fallback when generation_config.json has none.

Which real-library file each behaviour follows:

- Loading (template precedence, list-of-named-templates, legacy special_tokens_map.json,
  no add_bos_token/add_eos_token override when tokenizer.json is present):
  transformers ``src/transformers/tokenization_utils_base.py``
  (``PreTrainedTokenizerBase._from_pretrained`` and ``get_chat_template``, transformers 5).
- Rendering: transformers ``src/transformers/utils/chat_template_utils.py``
  (``_compile_jinja_template``: ImmutableSandboxedEnvironment(trim_blocks=True,
  lstrip_blocks=True, extensions=[loopcontrols]), the ``tojson`` filter override,
  ``raise_exception`` and ``strftime_now`` globals; ``render_jinja_template``: the template
  gets ``messages``, ``tools=None``, ``documents=None``, ``add_generation_prompt`` and the
  special tokens) and ``tokenization_utils_base.py`` ``apply_chat_template``
  (``template_kwargs = {**self.special_tokens_map, ...}``: transformers 5's special_tokens_map
  holds the named tokens bos/eos/unk/sep/pad/cls/mask as strings; tokenize=True encodes the
  rendered text with ``add_special_tokens=False``).
- Decoding: transformers' fast-tokenizer ``_decode`` (``tokenizer.decode`` then, when
  tokenizer_config.json sets ``clean_up_tokenization_spaces``, ``clean_up_tokenization``'s
  fixed list of replacements; transformers 5 defaults the flag to False).
- Streaming: vLLM's incremental detokenizer (``vllm/transformers_utils/detokenizer_utils.py``
  ``detokenize_incrementally``: the prefix_offset/read_offset window, holding text that ends in
  U+FFFD) and ``vllm/v1/engine/detokenizer.py`` / tokenizers' ``DecodeStream`` (decode a short
  window, emit what it adds past the window's prefix). See ``IncrementalDetokenizer`` for the
  two places where this module is stricter than both.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from exaserve_hpc.engine.tokenizer import ByteTokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
CONFIG_FILE = "config.json"
SENTENCEPIECE_FILE = "tokenizer.model"
EXASERVE_FORMAT = "exaserve-llama-v1"  # engine checkpoints that use the byte tokenizer

# transformers 5 PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES: the named tokens that
# special_tokens_map (and so the chat template's scope) holds.
SPECIAL_TOKENS_ATTRIBUTES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)

# transformers PreTrainedTokenizerBase.clean_up_tokenization, in its order.
_CLEANUPS = (
    (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
    (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
)
# Characters that can follow the leading space inside one of those patterns.
_CLEANUP_TAIL_CHARS = frozenset(".?!,' ntmsver")
_CLEANUP_MAX_LEN = max(len(p) for p, _ in _CLEANUPS)

REPLACEMENT_CHAR = "\ufffd"


class TokenizerError(ValueError):
    """A checkpoint's tokenizer files are missing or wrong, or a request cannot be tokenized."""


class ChatTemplateError(TokenizerError):
    """The chat template refused the messages (its ``raise_exception``) or failed to render them.

    ``str(err)`` is the template's own message for ``raise_exception``; the gateway answers it
    as HTTP 400.
    """


@runtime_checkable
class ModelTokenizer(Protocol):
    """What the gateway needs from a model's tokenizer (ByteTokenizer and HfTokenizer)."""

    vocab_size: int
    eos_token_ids: frozenset[int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def incremental(self) -> Any: ...


def clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization``: drop the space before punctuation and contractions."""
    for pattern, replacement in _CLEANUPS:
        text = text.replace(pattern, replacement)
    return text


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{path} is not valid JSON: {exc}") from exc
    except OSError as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc


def _read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None when the file does not exist."""
    if not path.is_file():
        return None
    data = _read_json(path)
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any, path: Path, key: str) -> str | None:
    """A special token given as a string or as an AddedToken dict ``{"content": ...}``."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(
        f"{path}: {key} must be a string or an object with a string 'content', got {value!r}"
    )


def _id_list(value: Any, path: Path, key: str) -> list[int]:
    """``eos_token_id``-style value: an int, a list of ints, or null."""
    if value is None:
        return []
    if isinstance(value, bool):
        raise TokenizerError(f"{path}: {key} must be an int or a list of ints, got {value!r}")
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise TokenizerError(f"{path}: {key} must be an int or a list of ints, got {value!r}")


def _select_template(value: Any, path: Path) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of named templates."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {}
        for entry in value:
            if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise TokenizerError(
                    f"{path}: chat_template is a list, so each entry must be "
                    f"{{'name': str, 'template': str}}; got {entry!r}"
                )
            named[entry["name"]] = entry["template"]
        if "default" not in named:
            # transformers' get_chat_template raises the same way when no name is passed.
            raise TokenizerError(
                f"{path}: chat_template lists templates {sorted(named)} but none is named "
                "'default'; the gateway renders chats with the default template"
            )
        return named["default"]
    raise TokenizerError(
        f"{path}: chat_template must be a string or a list of {{'name', 'template'}}, "
        f"got {type(value).__name__}"
    )


def _compile_template(source: str):
    """Compile like transformers' ``_compile_jinja_template`` (chat_template_utils.py)."""

    def raise_exception(message):
        raise ChatTemplateError(str(message))

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers overrides jinja's tojson: no HTML escaping, and these options.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


class HfTokenizer:
    """A Hugging Face checkpoint's fast tokenizer, special tokens and chat template.

    Thread-safe: the ``tokenizers.Tokenizer`` and the compiled jinja template are only read
    after construction (jinja builds a fresh context per render).
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        model_dir: str | os.PathLike[str] = "<memory>",
        special_tokens: Mapping[str, str] | None = None,
        chat_template: str | None = None,
        chat_template_source: str = "",
        generation_eos_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self.model_dir = str(model_dir)
        self.special_tokens: dict[str, str] = {
            k: v for k, v in (special_tokens or {}).items() if v is not None
        }
        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")
        self.pad_token: str | None = self.special_tokens.get("pad_token")
        self.unk_token: str | None = self.special_tokens.get("unk_token")
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.clean_up_tokenization_spaces = bool(clean_up_tokenization_spaces)

        eos_ids = set(generation_eos_ids)
        self.eos_token_id: int | None = (
            tokenizer.token_to_id(self.eos_token) if self.eos_token is not None else None
        )
        if self.eos_token_id is not None:
            eos_ids.add(self.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        if bos_token_id is None and self.bos_token is not None:
            bos_token_id = tokenizer.token_to_id(self.bos_token)
        self.bos_token_id: int | None = bos_token_id
        self.pad_token_id: int | None = (
            tokenizer.token_to_id(self.pad_token) if self.pad_token is not None else None
        )

        self.chat_template: str | None = chat_template
        self.chat_template_source = chat_template_source
        self._template = None
        self._template_error: Exception | None = None
        if chat_template is not None:
            try:
                self._template = _compile_template(chat_template)
            except Exception as exc:  # jinja2.TemplateSyntaxError and friends
                self._template_error = exc

        # For the incremental detokenizer: the ids of special tokens (skipped), of
        # byte-fallback tokens "<0xNN>" (when the decoder groups them) and an anchor token.
        added = tokenizer.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, tok in added.items() if tok.special)
        self._byte_fallback_ids = frozenset(self._find_byte_fallback_ids())
        self._anchor_id = self._find_anchor()

    # ----------------------------------------------------------------- loading

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> "HfTokenizer":
        """Load the tokenizer of the checkpoint directory ``path`` (see the module docstring)."""

        root = Path(path)
        if not root.is_dir():
            raise TokenizerError(f"tokenizer directory {root} does not exist or is not a directory")
        tok_file = root / TOKENIZER_FILE
        if not tok_file.is_file():
            if (root / SENTENCEPIECE_FILE).is_file():
                raise TokenizerError(
                    f"{root} has {SENTENCEPIECE_FILE} but no {TOKENIZER_FILE}: the checkpoint needs "
                    f"a fast tokenizer file ({TOKENIZER_FILE}); a SentencePiece {SENTENCEPIECE_FILE} "
                    "alone is not supported (convert it once with transformers: "
                    "AutoTokenizer.from_pretrained(dir).save_pretrained(dir))"
                )
            raise TokenizerError(
                f"{root} has no {TOKENIZER_FILE}: the checkpoint needs a fast tokenizer file "
                f"({TOKENIZER_FILE}, as saved by transformers' fast tokenizers)"
            )
        try:
            tokenizer = Tokenizer.from_file(str(tok_file))
        except Exception as exc:
            raise TokenizerError(f"{tok_file} is not a tokenizer file that tokenizers can load: {exc}") from exc

        cfg_path = root / TOKENIZER_CONFIG_FILE
        config = _read_json_object(cfg_path) or {}
        special: dict[str, str] = {}
        for key in SPECIAL_TOKENS_ATTRIBUTES:
            value = _token_content(config.get(key), cfg_path, key)
            if value is not None:
                special[key] = value
        stm_path = root / SPECIAL_TOKENS_MAP_FILE
        if "added_tokens_decoder" not in config:
            stm = _read_json_object(stm_path)
            if stm:
                for key in SPECIAL_TOKENS_ATTRIBUTES:
                    value = _token_content(stm.get(key), stm_path, key)
                    if value is not None:
                        special[key] = value

        template_path = root / CHAT_TEMPLATE_FILE
        if template_path.is_file():
            try:
                chat_template = template_path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise TokenizerError(f"cannot read {template_path}: {exc}") from exc
            template_source = str(template_path)
        else:
            chat_template = _select_template(config.get("chat_template"), cfg_path)
            template_source = f"{cfg_path} (chat_template)" if chat_template is not None else ""

        clean_up = config.get("clean_up_tokenization_spaces", False)
        if not isinstance(clean_up, bool):
            raise TokenizerError(
                f"{cfg_path}: clean_up_tokenization_spaces must be true or false, got {clean_up!r}"
            )

        gen_path = root / GENERATION_CONFIG_FILE
        gen = _read_json_object(gen_path) or {}
        eos_ids = _id_list(gen.get("eos_token_id"), gen_path, "eos_token_id")
        if not eos_ids:
            model_cfg_path = root / CONFIG_FILE
            model_cfg = _read_json_object(model_cfg_path) or {}
            eos_ids = _id_list(model_cfg.get("eos_token_id"), model_cfg_path, "eos_token_id")
        bos_ids = _id_list(gen.get("bos_token_id"), gen_path, "bos_token_id")

        self = cls(
            tokenizer,
            model_dir=root,
            special_tokens=special,
            chat_template=chat_template,
            chat_template_source=template_source,
            generation_eos_ids=eos_ids,
            bos_token_id=bos_ids[0] if bos_ids else None,
            clean_up_tokenization_spaces=clean_up,
        )
        if self.eos_token is not None and self.eos_token_id is None:
            raise TokenizerError(
                f"{cfg_path}: eos_token {self.eos_token!r} is not in the vocabulary of {tok_file}"
            )
        bad = sorted(i for i in self.eos_token_ids if not 0 <= i < self.vocab_size)
        if bad:
            raise TokenizerError(
                f"{root}: eos_token_id {bad} is outside the vocabulary of {tok_file} "
                f"(0..{self.vocab_size - 1})"
            )
        if not self.eos_token_ids:
            raise TokenizerError(
                f"{root} names no end-of-sequence token: set eos_token in {TOKENIZER_CONFIG_FILE} "
                f"or eos_token_id in {GENERATION_CONFIG_FILE} (or {CONFIG_FILE})"
            )
        return self

    def _find_byte_fallback_ids(self) -> list[int]:
        """Ids of "<0xNN>" tokens when the model uses byte fallback (their decoding is grouped)."""
        model = self._tokenizer.model
        if not getattr(model, "byte_fallback", False):
            return []
        ids = []
        for byte in range(256):
            tid = self._tokenizer.token_to_id(f"<0x{byte:02X}>")
            if tid is not None:
                ids.append(tid)
        return ids

    def _find_anchor(self) -> int | None:
        """A plain token that decodes to one visible ASCII character on its own.

        Decoded first in each window, it takes the decoder's first-token treatment (the
        Metaspace decoder's dropped leading space, the Llama-2 Strip decoder's) so that the
        window's own first token decodes as it does mid-text.
        """
        for ch in "a!xe.0":
            tid = self._tokenizer.token_to_id(ch)
            if tid is None or tid in self._special_ids or tid in self._byte_fallback_ids:
                continue
            if self._tokenizer.decode([tid], skip_special_tokens=True) == ch:
                return tid
        return None

    # ----------------------------------------------------------------- tokenizing

    def _check_ids(self, ids: Sequence[int]) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(i for i in ids if not 0 <= i < self.vocab_size)
            raise TokenizerError(
                f"token id {bad} is outside the vocabulary of {self.model_dir} "
                f"0..{self.vocab_size - 1}; the ids come from a model with a different vocabulary"
            )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` runs tokenizer.json's post-processor (BOS)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` as transformers' fast tokenizer decodes it."""
        ids = ids if isinstance(ids, list) else list(ids)
        self._check_ids(ids)
        text = self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces:
            text = clean_up_tokenization(text)
        return text

    def _raw_decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    # ----------------------------------------------------------------- chat

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def render_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The chat as the model's template renders it (transformers' apply_chat_template, tokenize=False).

        Raises TokenizerError when the model has no template or it does not compile, and
        ChatTemplateError when the template refuses the messages (its raise_exception, with the
        template's message) or fails on them.
        """
        if self.chat_template is None:
            raise TokenizerError(
                f"the model at {self.model_dir} has no chat template (no {CHAT_TEMPLATE_FILE} and "
                f"no chat_template in {TOKENIZER_CONFIG_FILE}); it cannot serve chat completions, "
                "use /v1/completions with a plain prompt"
            )
        if self._template is None:
            raise TokenizerError(
                f"the chat template in {self.chat_template_source} does not compile: "
                f"{self._template_error}"
            )
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise ChatTemplateError(
                f"messages must be a list of {{'role', 'content'}} objects, got "
                f"{type(messages).__name__}"
            )

        scope = dict(self.special_tokens)
        try:
            return self._template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **scope,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(
                f"the chat template of {self.model_dir} failed on these messages: {exc}"
            ) from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(
                f"the chat template of {self.model_dir} failed on these messages: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        """transformers' apply_chat_template(tokenize=True): the rendering, encoded without specials."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)

    # ----------------------------------------------------------------- streaming

    def incremental(self) -> "IncrementalDetokenizer":
        """A fresh streaming detokenizer for one response."""
        return IncrementalDetokenizer(self)


class IncrementalDetokenizer:
    """Turns a stream of token ids into final text; ``feed`` + ... + ``flush`` == ``decode(all)``.

    The window algorithm follows vLLM (``detokenize_incrementally``'s prefix_offset /
    read_offset; the v1 ``FastIncrementalDetokenizer`` over tokenizers' ``DecodeStream``): decode
    ``ids[prefix:]`` and ``ids[prefix:read]``, emit what the first adds past the second, hold
    back text that ends in U+FFFD (a character whose remaining bytes are still to come), then
    slide the window. Special tokens are skipped. Stricter than both, so that the streamed text
    is exactly the full decode for any id sequence:

    - Each window after the first is decoded after an anchor token (a plain one-character
      token), so its first token decodes as it does mid-text: the Llama-2 ``Strip`` decoder
      drops the first space of the whole text only, and the ``Metaspace`` decoder drops the "▁"
      of the text's first token only. (Diffing against the window's prefix already cancels
      both for those decoders; the anchor keeps it exact whatever a decoder does to a first
      token.)
    - With byte fallback, the ``ByteFallback`` decoder decodes a run of ``<0xNN>`` tokens as one
      group: valid UTF-8, or one U+FFFD per byte if any byte of the run is invalid. So text is
      held while the last token is a byte token; the run is final once a normal token follows.
    - With ``clean_up_tokenization_spaces``, cleaned text is emitted only up to a cut no
      clean-up pattern can straddle.
    """

    def __init__(self, tokenizer: HfTokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []  # the non-special ids so far
        self._prefix = 0  # vLLM's prefix_offset: the window starts here
        self._read = 0  # vLLM's read_offset: text up to here is final
        self._clean = tokenizer.clean_up_tokenization_spaces
        self._emitted = 0  # characters emitted (of the cleaned text in clean-up mode)
        self._pending = ""  # clean-up mode: final raw text not yet past a safe cut

    def _decode_to(self, start: int, end: int) -> str:
        """Text of ids[start:end] as it decodes in context (after the anchor when start > 0)."""
        tok = self._tok
        if start == 0:
            return tok._raw_decode(self._ids[:end])
        if tok._anchor_id is None:  # no anchor (no LLM vocabulary lacks one): decode from 0
            return tok._raw_decode(self._ids[:end])
        return tok._raw_decode([tok._anchor_id, *self._ids[start:end]])

    def feed(self, ids: Iterable[int]) -> str:
        """Text made final by ``ids`` (possibly empty)."""
        ids = ids if isinstance(ids, list) else list(ids)
        if not ids:
            return ""
        tok = self._tok
        tok._check_ids(ids)
        special = tok._special_ids
        self._ids.extend(i for i in ids if i not in special)
        if len(self._ids) == self._read:
            return ""
        if self._ids[-1] in tok._byte_fallback_ids:
            return ""  # the run of byte tokens may still grow (see the class docstring)
        prefix_text = self._decode_to(self._prefix, self._read) if self._read > self._prefix else ""
        new_text = self._decode_to(self._prefix, len(self._ids))
        if (len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR)
                or not new_text.startswith(prefix_text)):
            return ""
        piece = new_text[len(prefix_text):]
        if tok._anchor_id is not None:
            self._prefix = self._read
        self._read = len(self._ids)
        if not self._clean:
            self._emitted += len(piece)
            return piece
        # Clean-up mode: clean and emit the pending raw text up to its last safe cut.
        raw = self._pending + piece
        cut = len(raw)
        while cut > 0 and not _safe_cleanup_cut(raw, cut):
            cut -= 1
        self._pending = raw[cut:]
        out = clean_up_tokenization(raw[:cut])
        self._emitted += len(out)
        return out

    def flush(self) -> str:
        """The rest of the text at the end of the stream; the detokenizer is then reset."""
        full = self._tok.decode(self._ids, skip_special_tokens=True)
        rest = full[self._emitted:]
        self.__init__(self._tok)
        return rest


def _safe_cleanup_cut(raw: str, cut: int) -> bool:
    """Whether no clean-up pattern occurrence can straddle ``cut`` in ``raw`` + any continuation.

    Every pattern starts with a space and the replacements only delete spaces, so an occurrence
    straddling the cut holds raw[cut-1] after its leading space (or raw[cut-1] is that space):
    the cut is safe when raw[cut-1] is no character a pattern has after its space, or when the
    last characters before the cut hold no space (the occurrence would be longer than the
    longest pattern). Safe cuts make clean-up of the parts equal clean-up of the whole.
    """
    if raw[cut - 1] not in _CLEANUP_TAIL_CHARS:
        return True
    return " " not in raw[max(0, cut - _CLEANUP_MAX_LEN):cut]


def load_tokenizer(model_dir: str | os.PathLike[str] | None) -> ModelTokenizer:
    """The tokenizer for a model directory.

    - None (engines without weights) or an exaserve checkpoint (config.json with
      ``"format": "exaserve-llama-v1"``): the byte tokenizer.
    - A directory with tokenizer.json: ``HfTokenizer.from_dir``.
    - Otherwise TokenizerError naming what is missing.
    """

    if model_dir is None:
        return ByteTokenizer()
    root = Path(model_dir)
    if not root.is_dir():
        raise TokenizerError(f"model directory {root} does not exist or is not a directory")
    if (root / TOKENIZER_FILE).is_file():
        return HfTokenizer.from_dir(root)
    config = _read_json_object(root / CONFIG_FILE)
    if config is not None and config.get("format") == EXASERVE_FORMAT:
        return ByteTokenizer()
    if (root / SENTENCEPIECE_FILE).is_file():
        return HfTokenizer.from_dir(root)  # raises, explaining tokenizer.model is not enough
    raise TokenizerError(
        f"{root} has no {TOKENIZER_FILE} (a Hugging Face checkpoint needs its fast tokenizer file) "
        f"and its {CONFIG_FILE} is not an exaserve checkpoint's "
        f"(\"format\": \"{EXASERVE_FORMAT}\"), so there is no tokenizer for this model"
    )
