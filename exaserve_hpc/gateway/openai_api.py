"""OpenAI's HTTP API as exaserve speaks it: request models, response bodies, errors.

Supported subset of ``/v1/completions`` and ``/v1/chat/completions``: one
text prompt (a string, or a list holding exactly one string), ``max_tokens``
(chat: ``max_completion_tokens`` wins over the older ``max_tokens``),
``temperature`` 0..2, ``top_p`` (0, 1], ``stop`` (a string or up to 4),
``seed``, ``stream`` with ``stream_options.include_usage``, ``user``.

Not supported, rejected with 400 rather than silently ignored because the
answer would differ from what the client asked for: ``n`` > 1, ``best_of`` >
1, ``echo``, ``logprobs`` / ``top_logprobs``, ``suffix``, tools / function
calling, prompts given as token ids, batched prompts (a list of several
strings), and non-text chat content parts (images, audio). Other unknown
fields (``presence_penalty``, ``frequency_penalty``, ``logit_bias``,
``metadata`` ...) are accepted and ignored.

Types are strict, as OpenAI's are: ``"max_tokens": "10"`` is a 400, not 10.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional

import msgspec
from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP_STRINGS = 4


class _StrictBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_StrictBody):
    include_usage: bool = False


# ------------------------------------------------------------ requests


# Fields of OpenAI's API this server cannot honour, and the value meaning "not used".
_UNSUPPORTED_UNLESS = {
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "suffix": (None, ""),
    "tools": (None, []),
    "functions": (None, []),
}


class GenerationParams(_StrictBody):
    """Fields shared by completions and chat completions."""

    model: str = Field(description="A model id from GET /v1/models.")
    max_tokens: Optional[int] = Field(
        None, ge=1, description="Completion tokens at most; default: the site's gateway.default_max_tokens, "
        "lowered to what fits the model's max_seq_len.")
    temperature: float = Field(1.0, ge=0, le=2, description="0: greedy decoding.")
    top_p: float = Field(1.0, gt=0, le=1)
    stop: Any = Field(None, description=f"A string or a list of up to {MAX_STOP_STRINGS} strings; "
                      "generation ends before the first match, which is not returned.")
    seed: Optional[int] = Field(None, ge=0, le=2**63 - 1, description="Same seed, same request: same tokens.")
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, description="Only 1 is supported.")
    user: Optional[str] = None
    best_of: Any = None
    echo: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    suffix: Any = None
    tools: Any = None
    functions: Any = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value: Any) -> Optional[list[str]]:
        if value is None:
            return None
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError(f"must be a string or a list of strings, found {_describe(value)}")
        if len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"has {len(value)} strings; at most {MAX_STOP_STRINGS} are allowed")
        if any(s == "" for s in value):
            raise ValueError("contains an empty string, which would match before any text; remove it")
        return value or None

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError(f"is {value}; only n=1 is supported: send {value} requests instead")
        return value

    @field_validator(*_UNSUPPORTED_UNLESS, mode="before")
    @classmethod
    def _unsupported(cls, value: Any, info) -> Any:
        if value not in _UNSUPPORTED_UNLESS[info.field_name]:
            raise ValueError(f"is {value!r}, but this server does not support {info.field_name}; omit it")
        return None

    @property
    def stop_strings(self) -> list[str]:
        return self.stop or []

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(GenerationParams):
    """Body of POST /v1/completions."""

    prompt: Any = Field(description="A string, or a list holding exactly one string.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_text_prompt(cls, value: Any) -> str:
        if isinstance(value, str):
            return _encodable(value)
        if isinstance(value, list):
            if value and all(isinstance(v, int) and not isinstance(v, bool) for v in value) or (
                    value and all(isinstance(v, list) for v in value)):
                raise ValueError("is given as token ids, which this server does not accept; send the text")
            if len(value) == 1 and isinstance(value[0], str):
                return _encodable(value[0])
            if len(value) > 1 and all(isinstance(v, str) for v in value):
                raise ValueError(f"is a batch of {len(value)} prompts; send one prompt per request")
        raise ValueError(f"must be a string (or a list holding one string), found {_describe(value)}")


class ChatCompletionRequest(GenerationParams):
    """Body of POST /v1/chat/completions."""

    messages: Any = Field(description="[{role: system|developer|user|assistant, content: text}, ...]")
    max_completion_tokens: Optional[int] = Field(None, ge=1, description="Preferred over max_tokens.")

    @field_validator("messages", mode="before")
    @classmethod
    def _text_messages(cls, value: Any) -> list[dict]:
        if not isinstance(value, list) or not value:
            raise ValueError(f"must be a non-empty list of {{role, content}} objects, found {_describe(value)}")
        return [_text_message(i, m) for i, m in enumerate(value)]

    @property
    def completion_limit(self) -> tuple[Optional[int], str]:
        """(requested completion tokens or None, the field that asked for them)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


def _text_message(index: int, message: Any) -> dict:
    """One chat message with its content flattened to text; roles are checked by the chat template."""
    if not isinstance(message, dict):
        raise ValueError(f"[{index}] must be an object with role and content, found {_describe(message)}")
    role = message.get("role")
    if role == "developer":  # OpenAI's newer name for the system role
        role = "system"
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else _describe(part)
                raise ValueError(f"[{index}].content[{j}] is {kind!r}; only text parts are supported")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise ValueError(f"[{index}].content must be a string or a list of text parts, found {_describe(content)}")
    return {"role": role, "content": content}


def _encodable(text: str) -> str:
    """The text, if it is valid Unicode: JSON's "\\ud800" escapes decode to lone surrogates, which have no UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"contains a lone surrogate ({text[exc.start]!r}) at character {exc.start}, which is not "
                         "valid Unicode text; send UTF-8 text (a surrogate pair for characters beyond U+FFFF)") from None
    return text


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def _field_sentence(param: Optional[str], problem: str) -> str:
    """Our validators word problems to follow the field name: "is 2; ..." or "[0].role ..."."""
    if param is None:
        return problem
    return f"{param}{problem}" if problem.startswith("[") else f"{param} {problem}"


def describe_validation_errors(errors: list[dict]) -> tuple[str, Optional[str]]:
    """A pydantic/FastAPI error list as one message naming each field, what was found and what is allowed.

    Returns (message, param): param is the first offending field (OpenAI's ``param``).
    """
    parts, params = [], []
    for error in errors:
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        params.append(param)
        message = str(error.get("msg", "invalid"))
        if error.get("type") == "missing":
            parts.append(f"missing required field {param!r}" if param else "the request body is empty; send a JSON object")
        elif error.get("type") == "value_error":
            parts.append(_field_sentence(param, message.removeprefix("Value error, ")))
        elif param is None:
            parts.append(f"the request body must be a JSON object, found {_describe(error.get('input'))}")
        else:
            parts.append(f"{param}: {message.rstrip('.')}; found {_describe(error.get('input'))}")
    return "; ".join(parts), next((p for p in params if p), None)


# ------------------------------------------------------------ responses


def new_completion_id(request_id: str) -> str:
    return f"cmpl-{request_id}"


def new_chat_completion_id(request_id: str) -> str:
    return f"chatcmpl-{request_id}"


def new_request_id() -> str:
    return uuid.uuid4().hex


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(id: str, created: int, model: str, text: str, finish_reason: str, usage: dict) -> dict:
    return {
        "id": id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage,
    }


def completion_chunk(id: str, created: int, model: str, text: str, finish_reason: Optional[str],
                     include_usage: bool = False) -> dict:
    chunk = {
        "id": id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }
    if include_usage:  # OpenAI: usage is null on every chunk but the last one when asked for
        chunk["usage"] = None
    return chunk


def chat_body(id: str, created: int, model: str, text: str, finish_reason: str, usage: dict) -> dict:
    return {
        "id": id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{
            "index": 0, "message": {"role": "assistant", "content": text},
            "logprobs": None, "finish_reason": finish_reason,
        }],
        "usage": usage,
    }


def chat_chunk(id: str, created: int, model: str, delta: dict, finish_reason: Optional[str],
               include_usage: bool = False) -> dict:
    chunk = {
        "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(object_: str, id: str, created: int, model: str, usage: dict) -> dict:
    """The extra last chunk of a stream with stream_options.include_usage: no choices, the usage."""
    return {"id": id, "object": object_, "created": created, "model": model, "choices": [], "usage": usage}


# ------------------------------------------------------------ errors and SSE

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "invalid_request_error", 405: "invalid_request_error", 429: "rate_limit_error"}


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


_json = msgspec.json.Encoder()


# Line separators JSON allows raw in strings but clients that split SSE on Unicode line breaks
# (JavaScript's, Python's str.splitlines) cut an event at: U+2028, U+2029 and NEL (U+0085). In UTF-8
# these byte sequences only ever encode those characters, so replacing the bytes is exact.
_LINE_BREAKS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"), (b"\xc2\x85", b"\\u0085"))


def sse_event(data: dict) -> bytes:
    body = _json.encode(data)
    for raw, escaped in _LINE_BREAKS:
        if raw in body:
            body = body.replace(raw, escaped)
    return b"data: " + body + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
