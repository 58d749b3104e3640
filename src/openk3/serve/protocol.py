"""OpenAI-compatible request bodies (pydantic) and the error object (``docs/references.md#openai-api``).

Errors are ``{"error": {"message", "type", "param", "code"}}`` with status 400 (bad input), 404 (a model
the server does not serve), 413 (a body over the server's byte limit, refused before it is read),
429 (queue full; with ``Retry-After``), 500 (engine error), 503 (shutting down). Fields the server does not implement
(``echo``, ``suffix``, penalties, ``logit_bias``, ``best_of`` other than ``n``,
``response_format`` other than text, tools, and the sampling extensions of other servers ``top_k``, ``min_p``,
``repetition_penalty``) are refused with 400 naming the field when they ask for something other than the
no-op default, rather than silently ignored; other unknown fields are ignored, as OpenAI does. Booleans are strict (``"stream": "yes"`` is refused), floats must be finite, text must be
valid Unicode (JSON can carry a lone surrogate such as ``"\\ud800"``, which no tokenizer can encode), and
``seed`` is a signed 64-bit integer (OpenAI's range).
"""

from __future__ import annotations

import json
from typing import Literal

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from starlette.requests import ClientDisconnect

from openk3.serve.request import MAX_LOGPROBS
from openk3.speculative import MAX_SPECULATIVE_TOKENS

MAX_STOP_STRINGS = 4
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
"""``seed`` range (int64, as in OpenAI's API); choice ``k`` samples with ``(seed + k) mod 2**64``, which
``torch.Generator.manual_seed`` accepts (it takes ``[-2**63, 2**64)``)."""


class APIError(Exception):
    """An error answered to the client as an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def json_object(raw: bytes) -> dict:
    """A request body parsed as a JSON object; raises the 400 :class:`APIError` with ``code: "invalid_json"``
    for malformed JSON and for JSON that is not an object (the server and the router answer alike)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad UTF-8 or syntax, deep nesting, a 5,000-digit number
        raise APIError(
            400, f"We could not parse the JSON body of your request: {e}", code="invalid_json"
        ) from e
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object", code="invalid_json")
    return body


BODY_READ_TIMEOUT_S = 60.0
"""Most seconds a request body may take to arrive (as web servers' client-body timeouts): a client that
sends a few bytes a minute would otherwise hold its connection and coroutine for ever."""


async def read_body(http, limit: int, timeout_s: float = BODY_READ_TIMEOUT_S) -> bytes:
    """The body of the Starlette request ``http``, read only while it stays within ``limit`` bytes and
    ``timeout_s`` seconds.

    A body over the limit is refused with 413 (``code: "request_too_large"``) as soon as that is known: from
    its ``Content-Length`` before any of it is read, or, for a streamed (chunked) body, at the chunk that
    passes the limit. So an oversized request costs neither memory beyond the limit nor parsing and
    tokenizing, and the requests beside it keep being served (the server and the router alike). A body
    still arriving after ``timeout_s`` is refused with 408 (``code: "request_timeout"``). A client that
    disconnects before the body ends gets a 400 ``client_disconnected`` that nobody reads, rather than an
    unhandled error in the log."""
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(f"{int(declared):,} bytes", limit)
    chunks, size = [], 0
    try:
        with anyio.fail_after(timeout_s):
            async for chunk in http.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large(f"over {limit:,} bytes", limit)
                chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(
            400, "the client disconnected before the body ended", code="client_disconnected"
        ) from None
    except TimeoutError:
        raise APIError(
            408,
            f"the request body did not arrive within {timeout_s:g} s ({size:,} bytes came)",
            code="request_timeout",
        ) from None
    return b"".join(chunks)


def too_large(size: str, limit: int) -> APIError:
    """The 413 ``request_too_large`` of a body of ``size`` (words, e.g. ``"2,000 bytes"``) over ``limit``."""
    return APIError(
        413,
        f"The request body is {size}; this server reads at most {limit:,} bytes (start it with a larger "
        "--max-request-mib for bigger batches or images)",
        code="request_too_large",
    )


def validation_error(e: ValidationError) -> APIError:
    """The first pydantic error as a 400 OpenAI error (``param`` = the field path, e.g. ``messages.0.role``).

    Pydantic's union-member tags in the location (``prompt.str``, ``stop.list[str]``) are dropped: only field
    names and list indices name the parameter. A union reports one error per member; the deepest one under
    the first error's field is kept (a bad ``messages.0.content.0.text`` rather than "content should be a
    string")."""
    names = _field_names()
    errors = [([p for p in err["loc"] if isinstance(p, int) or p in names], err["msg"]) for err in e.errors()]
    head = errors[0][0][:1]
    loc, msg = max((err for err in errors if err[0][:1] == head), key=lambda err: len(err[0]))
    param = ".".join(str(p) for p in loc) or None
    msg = msg.removeprefix("Value error, ")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


def _field_names() -> set[str]:
    return {
        name
        for model in (
            CompletionRequest,
            ChatCompletionRequest,
            ChatMessage,
            TextPart,
            ImagePart,
            ImageURL,
            StreamOptions,
        )
        for name in model.model_fields
    }


def check_unicode(text: str, what: str) -> str:
    """``text`` unchanged; raises ``ValueError`` when it holds a lone surrogate (not encodable as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} contains text that is not valid Unicode (lone surrogate)") from None
    return text


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class StreamOptions(BaseModel):
    include_usage: bool = Field(False, strict=True)


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    n: int = Field(1, ge=1, strict=True)
    stop: str | list[str] | None = None
    stream: bool = Field(False, strict=True)
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, strict=True)
    presence_penalty: float = Field(0.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = Field(None, strict=True)
    """vLLM's extension, not implemented: only its no-op values (-1, 0, None) pass."""
    min_p: float = Field(0.0, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, allow_inf_nan=False)
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS, strict=True)
    """openk3 extension: drafted tokens per step on a server with ``--draft`` (0: none; default: the
    server's ``--speculative-tokens``)."""

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        for s in stops:
            check_unicode(s, "stop")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v, info: ValidationInfo):
        if v is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    @field_validator("seed")
    @classmethod
    def _check_seed(cls, v):
        if v is not None and not SEED_MIN <= v <= SEED_MAX:
            raise ValueError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported by this server (omit it or pass {})")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v):
        if v != 0:
            raise ValueError("penalties are not supported by this server (use 0)")
        return v

    @field_validator("top_k", "min_p", "repetition_penalty")
    @classmethod
    def _no_extension(cls, v, info: ValidationInfo):
        no_op = {"top_k": (None, -1, 0), "min_p": (0.0,), "repetition_penalty": (1.0,)}[info.field_name]
        if v not in no_op:
            raise ValueError(
                f"{info.field_name} is not supported by this server (omit it; it accepts only the no-op "
                f"{' or '.join(map(str, no_op))}); temperature and top_p are"
            )
        return v

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


COMPLETION_MAX_TOKENS = 16
"""A completion's ``max_tokens`` when absent or null (OpenAI's default)."""


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int = Field(COMPLETION_MAX_TOKENS, ge=1, strict=True)

    echo: bool = Field(False, strict=True)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    """The sampled token's log-probability and the ``logprobs`` most likely tokens' at each position."""
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _null_is_the_default(cls, v):
        """``"max_tokens": null`` is the default, as OpenAI reads it (not "up to the context length")."""
        return COMPLETION_MAX_TOKENS if v is None else v

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_type(cls, v):
        ok = isinstance(v, str) or (
            isinstance(v, list)
            and (
                all(isinstance(p, str) for p in v)
                or all(_is_int(p) for p in v)
                or all(isinstance(p, list) and all(_is_int(t) for t in p) for p in v)
            )
        )
        if not ok:
            raise ValueError(
                "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"
            )
        return v

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list) and (not v or any(isinstance(p, (str, list)) and len(p) == 0 for p in v)):
            raise ValueError("prompt must not be empty")
        if v == "":
            raise ValueError("prompt must not be empty")
        for p in [v] if isinstance(v, str) else v:
            if isinstance(p, str):
                check_unicode(p, "prompt")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v, info: ValidationInfo):
        if v is not None and v != info.data.get("n", 1):
            raise ValueError("best_of is not supported by this server (omit it or set it equal to n)")
        return v

    @field_validator("echo", "suffix")
    @classmethod
    def _unsupported(cls, v, info):
        if v not in (None, False):  # echo=false is the default
            raise ValueError(f"{info.field_name} is not supported by this server")
        return v


class TextPart(BaseModel):
    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _unicode(cls, v):
        return check_unicode(v, "message content")


class ImageURL(BaseModel):
    url: str
    """A ``data:image/...;base64,...`` URL, or a local file (``file://`` or a path) inside the server's
    ``--allowed-local-media-path``; web URLs are refused (nothing is downloaded)."""
    detail: Literal["auto", "low", "high"] | None = None
    """Accepted and ignored: every image is read at its own size (up to 3584 × 3584)."""


class ImagePart(BaseModel):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart]
    """Required for every role: ``null`` (OpenAI's assistant turn that only calls tools) is refused, since
    this server has no tool calls."""

    @field_validator("content", mode="before")
    @classmethod
    def _not_null(cls, v):
        if v is None:
            raise ValueError(
                "content must be a string or a list of content parts, not null (this server has no tool "
                "calls, so every message needs content)"
            )
        return v

    @field_validator("content")
    @classmethod
    def _unicode(cls, v):
        return check_unicode(v, "message content") if isinstance(v, str) else v

    @property
    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content if isinstance(p, TextPart))
        return self.content

    @property
    def image_urls(self) -> list[str]:
        """The ``image_url`` parts' URLs, in order."""
        if not isinstance(self.content, list):
            return []
        return [p.image_url.url for p in self.content if isinstance(p, ImagePart)]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, strict=True)
    max_completion_tokens: int | None = Field(None, ge=1, strict=True)
    logprobs: bool | None = Field(None, strict=True)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)
    """With ``logprobs``: the most likely tokens listed at each position (0 to 20)."""
    tools: list | None = None
    functions: list | None = None
    tool_choice: str | dict | None = None
    response_format: dict | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info: ValidationInfo):
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @field_validator("functions", "tools")
    @classmethod
    def _unsupported(cls, v, info):
        if v:
            raise ValueError(f"{info.field_name} is not supported by this server")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, v):
        if v not in (None, "none", "auto"):
            raise ValueError("tool_choice is not supported by this server (tools are not supported)")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v):
        if v is not None and v.get("type") != "text":
            raise ValueError('response_format is not supported by this server (only {"type": "text"})')
        return v
