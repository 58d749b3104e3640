"""The OpenAI completions and chat-completions handlers on top of :class:`AsyncEngine`.

One API request becomes ``prompts × n`` engine requests ("choices"). Their outputs come back on the event
loop through an ``asyncio.Queue``; each choice has an :class:`IncrementalDetokenizer` that holds back stop
strings. Streaming (SSE, ``docs/references.md#openai-api``): ``data: <json>\\n\\n`` chunks, then ``data:
[DONE]``;
with ``stream_options.include_usage`` every chunk has ``"usage": null`` and one extra chunk with
``"choices": []`` carries the usage. The response (or stream) starts only after the first output, so a
request that is rejected while queued still gets a plain 429. When the client goes away (a stream closed
early, or a disconnect seen while waiting), every engine request of the call is aborted, which frees its
blocks.

Tokenization (and chat-template rendering) runs on one worker thread, off the event loop, so a huge prompt
does not stall ``/health`` and the other clients (the ``tokenizers`` backend releases the GIL); one thread
keeps the tokenizer's calls serialized. Choice ``k`` of a request with ``seed`` samples with the
generator seeded ``(seed + k) mod 2**64``. When the server shuts down, the engine ends every request
("abort"), so open streams finish at once, and new requests get 503.

Special tokens (eos, chat markers, …) never appear in the text. Usage counts each prompt once and every choice's generated tokens (an end-of-sequence token included);
``prompt_tokens_details.cached_tokens`` is the prefix-cache hit of each prompt's first choice.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from openk3.data.images import MediaInputs, image_patches, load_image
from openk3.model.vision import media_token_count
from openk3.serve.async_engine import AsyncEngine, EngineClosedError
from openk3.serve.chat_template import ChatTemplate
from openk3.serve.detokenizer import IncrementalDetokenizer
from openk3.serve.mailbox import LoopMailbox
from openk3.serve.metrics import ServerMetrics
from openk3.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    TextPart,
    validation_error,
)
from openk3.serve.request import Request, RequestOutput, SamplingParams, TokenLogprobs
from openk3.serve.scheduler import QueueFullError

DISCONNECT_POLL_S = 0.5
CLIENT_CLOSED_STATUS = 499
"""Status logged for a non-streaming request whose client went away (nobody receives it)."""


def _logprobs_of(req) -> int | None:
    """``SamplingParams.logprobs`` of a completions (``logprobs``: int) or chat (``logprobs``: bool with
    ``top_logprobs``) request."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


class ClientDisconnectedError(Exception):
    """The HTTP client closed the connection while its request was running."""


@dataclass
class ServingConfig:
    model_name: str
    max_model_len: int
    max_n: int = 8
    """Most choices (``n``) per request."""
    retry_after_s: int = 1
    """``Retry-After`` seconds sent with 429."""
    allowed_local_media_path: str | None = None
    """Folder whose files an ``image_url`` may name; ``None``: only ``data:`` URLs."""
    max_choices: int = 128
    """Most choices (prompts × ``n``) one request may make: the scheduler's ``max_waiting``, since a
    request's choices are queued together (beyond it: 400, where a retry could never succeed)."""
    max_request_bytes: int = 1 << 20
    """Largest request body read (beyond it: 413 before parsing); :func:`request_bytes_limit` gives the
    server's default."""


def request_bytes_limit(max_model_len: int, vision: bool) -> int:
    """The default body limit of a server whose requests hold at most ``max_model_len`` tokens: 1 MiB for
    the JSON around the prompt, plus 64 bytes a token of text (several times what a full context of text or
    token ids takes, escapes included) and, for a model with a vision tower, 4 KiB a token (an image token
    covers 28 × 28 pixels: 2,352 bytes of raw RGB, 3,136 in base64). Batched prompts share the limit."""
    return (1 << 20) + max_model_len * (64 + (4096 if vision else 0))


@dataclass
class _Choice:
    index: int
    prompt_index: int
    request: Request
    detok: IncrementalDetokenizer
    text: str = ""
    num_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    started: bool = False
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    """Of the choice's tokens so far (stop tokens excluded), when the request asked for them."""
    sent_logprobs: int = 0
    """How many of ``logprobs`` a stream has sent."""


@dataclass
class _Call:
    """The engine requests of one API call and the queue their outputs arrive on."""

    choices: list[_Choice]
    prompt_lens: list[int]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.monotonic)
    last_disconnect_check: float = field(default_factory=time.monotonic)

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def usage(self) -> dict:
        completion = sum(c.num_tokens for c in self.choices)
        prompt = sum(self.prompt_lens)
        cached = sum(
            next(c.num_cached_tokens for c in self.choices if c.prompt_index == p)
            for p in range(len(self.prompt_lens))
        )
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


def _sse(payload) -> str:
    return f"data: {json.dumps(payload) if not isinstance(payload, str) else payload}\n\n"


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer,
        chat_template: ChatTemplate,
        metrics: ServerMetrics,
        config: ServingConfig,
    ) -> None:
        self.engine, self.tokenizer, self.chat_template = engine, tokenizer, chat_template
        self.metrics, self.config = metrics, config
        self.hidden_ids = set(tokenizer.special_tokens.values())
        """Special tokens are not written into the text (vLLM ``skip_special_tokens``)."""
        self._mailbox: LoopMailbox | None = None
        """How the engine thread's outputs reach the calls' queues on the serving event loop (one per loop:
        a call keeps the mailbox of the loop it started on)."""
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="openk3-tokenize")
        per_token = tokenizer.max_token_bytes
        self._max_text_bytes = None if per_token is None else per_token * (config.max_model_len - 1)
        """A prompt's text over this many UTF-8 bytes encodes to at least ``max_model_len`` tokens
        (:attr:`openk3.data.Tokenizer.max_token_bytes`): refused without tokenizing it."""

    def close(self) -> None:
        """Drop queued tokenization work (the app's shutdown)."""
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn: Callable, *args):
        """``fn(*args)`` on the tokenizer thread; the event loop keeps serving meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    # ---- validation and submission ---------------------------------------------------------------------
    def _check_common(self, req) -> None:
        if req.model != self.config.model_name:
            raise APIError(  # OpenAI's status and code for a model it does not serve
                404,
                f"The model {req.model!r} does not exist; this server serves {self.config.model_name!r}",
                param="model",
                code="model_not_found",
            )
        if req.n > self.config.max_n:
            raise APIError(
                400, f"n must be at most {self.config.max_n}, got {req.n}", param="n", code="invalid_value"
            )

    def _max_tokens(self, requested: int | None, prompt_len: int, param: str) -> int:
        limit = self.config.max_model_len
        if prompt_len >= limit or (requested is not None and prompt_len + requested > limit):
            asked = prompt_len + (requested or 0)
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens; the request asks for "
                f"{asked} ({prompt_len} in the prompt)",
                param=param,
                code="context_length_exceeded",
            )
        return requested if requested is not None else limit - prompt_len

    def _refuse_many_choices(self, prompts: int, n: int) -> None:
        """The 400 of a request with more choices than the waiting queue holds (a 429 would ask the client
        to retry what can never be admitted); a completion's is counted on the raw body, before its prompts
        are validated or tokenized (an invalid ``n`` counts as 1 there, and validation names it). An ``n``
        over ``max_n`` gets that limit's message, whatever the count."""
        if n > self.config.max_n:
            raise APIError(
                400, f"n must be at most {self.config.max_n}, got {n}", param="n", code="invalid_value"
            )
        if prompts * n > self.config.max_choices:
            raise APIError(
                400,
                f"This request makes {prompts * n:,} choices ({prompts:,} prompts × n = {n}); this server "
                f"queues at most {self.config.max_choices} (--max-waiting): split the batch",
                param="prompt" if prompts > 1 else "n",
                code="invalid_value",
            )

    def _refuse_long_text(self, texts: list[str], param: str) -> None:
        """The 400 ``context_length_exceeded`` of a prompt whose text alone holds ``max_model_len`` tokens
        or more, told from its size before the tokenizer thread spends seconds on it (the body limit still
        lets through megabytes of text)."""
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
        if self._max_text_bytes is not None and size > self._max_text_bytes:
            raise APIError(
                400,
                f"This model's maximum context length is {self.config.max_model_len} tokens; the "
                f"{size:,} bytes of text in {param} encode to at least "
                f"{-(-size // self.tokenizer.max_token_bytes):,}",
                param=param,
                code="context_length_exceeded",
            )

    def _tokenize_prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [self.tokenizer.encode(prompt)]
        elif all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        else:
            prompts = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
        vocab = self.engine.engine.vocab_size
        for ids in prompts:
            if not ids:
                raise APIError(400, "prompt encodes to no tokens", param="prompt")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise APIError(
                    400,
                    f"token id {bad[0]} is outside the vocabulary [0, {vocab})",
                    param="prompt",
                    code="invalid_value",
                )
        return prompts

    def _start(
        self, req, prompts: list[list[int]], max_tokens: list[int], stop_ids: set[int], media=None
    ) -> _Call:
        if req.num_speculative_tokens and self.engine.engine.runner.speculative is None:
            raise APIError(
                400,
                "num_speculative_tokens needs a server started with --draft",
                param="num_speculative_tokens",
                code="invalid_value",
            )
        base = uuid.uuid4().hex
        choices = []
        for p, ids in enumerate(prompts):
            for k in range(req.n):
                index = p * req.n + k
                seed = None if req.seed is None else (req.seed + k) % 2**64
                params = SamplingParams(
                    max_tokens[p], req.temperature, req.top_p, seed, frozenset(stop_ids), _logprobs_of(req),
                    req.num_speculative_tokens,
                )  # fmt: skip
                detok = IncrementalDetokenizer(self.tokenizer, req.stop_strings, self.hidden_ids | stop_ids)
                request = Request(f"{base}-{index}", ids, params, media=media)
                choices.append(_Choice(index, p, request, detok))
        call = _Call(choices, [len(ids) for ids in prompts])
        loop = asyncio.get_running_loop()
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = LoopMailbox(loop)
        mailbox = self._mailbox
        for choice in choices:

            def callback(out: RequestOutput, c=choice) -> None:
                mailbox.post(call.queue, (c, out))

            try:
                self.engine.submit(choice.request, callback)
            except QueueFullError as e:
                self._abort(call)
                self.metrics.rejections.inc()
                raise APIError(
                    429,
                    f"The server is busy: {e}. Retry later.",
                    type="rate_limit_exceeded",
                    code="queue_full",
                    headers={"Retry-After": str(self.config.retry_after_s)},
                ) from e
            except EngineClosedError as e:
                self._abort(call)
                raise APIError(503, str(e), type="server_error", code="server_shutting_down") from e
            except ValueError as e:
                self._abort(call)
                raise APIError(400, str(e), param="prompt") from e
        self.metrics.prompt_tokens.inc(sum(call.prompt_lens))
        return call

    def _abort(self, call: _Call) -> None:
        for choice in call.choices:
            self.engine.abort(choice.request.request_id)

    # ---- outputs ---------------------------------------------------------------------------------------
    def _apply(self, call: _Call, choice: _Choice, out: RequestOutput) -> str | None:
        """Fold one engine output into its choice; returns new text (None when the choice already ended)."""
        if choice.finish_reason is not None:
            return None
        if out.error:
            raise APIError(500, out.error, type="server_error", code="engine_error")
        if out.finish_reason == "rejected":
            self.metrics.rejections.inc()
            raise APIError(
                429,
                "The request waited too long in the queue. Retry later.",
                type="rate_limit_exceeded",
                code="queue_timeout",
                headers={"Retry-After": str(self.config.retry_after_s)},
            )
        if out.new_token_ids and not call.choices[0].num_tokens and choice is call.choices[0]:
            self.metrics.ttft.observe(time.monotonic() - call.arrival)
        choice.num_tokens += len(out.new_token_ids)
        choice.num_cached_tokens = out.num_cached_tokens
        stop_ids = choice.request.sampling_params.stop_token_ids
        choice.logprobs += [lp for lp in out.new_logprobs or () if lp.token_id not in stop_ids]
        text, stopped = choice.detok.push(out.new_token_ids)
        if stopped:
            choice.finish_reason = "stop"
            self.engine.abort(choice.request.request_id)
        elif out.finished:
            text += choice.detok.flush()
            choice.finish_reason = out.finish_reason
        choice.text += text
        return text

    async def _next(self, call: _Call, http: HTTPRequest | None) -> tuple[_Choice, str | None]:
        """Next output of the call; raises ClientDisconnectedError once the client has gone (checked at least
        every DISCONNECT_POLL_S, also while outputs keep arriving)."""
        while True:
            try:
                choice, out = await asyncio.wait_for(call.queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                choice = out = None
            now = time.monotonic()
            if http is not None and (out is None or now - call.last_disconnect_check >= DISCONNECT_POLL_S):
                call.last_disconnect_check = now
                if await http.is_disconnected():
                    raise ClientDisconnectedError() from None
            if out is not None:
                return choice, self._apply(call, choice, out)

    # ---- endpoints -------------------------------------------------------------------------------------
    def _parse(self, model_cls, body):
        """Validate ``body`` as ``model_cls`` and the checks both endpoints share; raises the 400 error."""
        try:
            req = model_cls.model_validate(body)
        except ValidationError as e:
            raise validation_error(e) from e
        self._check_common(req)
        return req

    async def completions(self, body, http: HTTPRequest):
        prompt, n = body.get("prompt"), body.get("n")  # counted before validating 200,000 prompts
        batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], (str, list))
        self._refuse_many_choices(len(prompt) if batch else 1, n if type(n) is int and n >= 1 else 1)
        req = self._parse(CompletionRequest, body)
        for text in [req.prompt] if isinstance(req.prompt, str) else req.prompt:
            if isinstance(text, str):
                self._refuse_long_text([text], "prompt")
        prompts = await self._off_loop(self._tokenize_prompts, req.prompt)
        max_tokens = [self._max_tokens(req.max_tokens, len(p), "prompt") for p in prompts]
        call = self._start(req, prompts, max_tokens, {self.tokenizer.eos_id})
        return await self._respond(call, req, http, chat=False)

    async def chat(self, body, http: HTTPRequest):
        req = self._parse(ChatCompletionRequest, body)
        self._refuse_many_choices(1, req.n)
        self._refuse_long_text([m.text for m in req.messages], "messages")
        ids, media = await self._off_loop(self._chat_prompt, req.messages)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = [self._max_tokens(requested, len(ids), "messages")]
        call = self._start(req, [ids], max_tokens, set(self.chat_template.stop_token_ids), media)
        return await self._respond(call, req, http, chat=True)

    def _chat_prompt(self, messages) -> tuple[list[int], MediaInputs | None]:
        """Prompt ids and images of a chat request (on the tokenizer thread, where images are decoded): each
        ``image_url`` part becomes its ``(h/2)·(w/2)`` media placeholder tokens at its place in the message.
        Raises a 400 :class:`APIError` naming the part for an image that cannot be read or taken."""
        if not any(m.image_urls for m in messages):
            return self.chat_template.encode([{"role": m.role, "content": m.text} for m in messages]), None
        model = self.engine.engine.model
        vision = getattr(model.config, "vision_config", None)
        if vision is None:
            raise APIError(
                400,
                "this model has no vision tower: it cannot read images",
                param="messages",
                code="images_not_supported",
            )
        placeholder = model.config.media_placeholder_token_id
        allowed = self.config.allowed_local_media_path or ""
        pixels, grids, counts, turns = [], [], [], []
        for i, m in enumerate(messages):
            if not isinstance(m.content, list):
                turns.append({"role": m.role, "content": m.text})
                continue
            pieces: list = []
            for j, part in enumerate(m.content):
                if isinstance(part, TextPart):
                    pieces.append(part.text)
                    continue
                param = f"messages.{i}.content.{j}.image_url"
                try:
                    patches, grid = image_patches(load_image(part.image_url.url, allowed), vision)
                except ValueError as e:
                    raise APIError(400, f"{param}: {e}", param=param, code="invalid_image") from None
                pixels.append(patches)
                grids.append(grid)
                counts.append(media_token_count(vision, grid))
                pieces.append([placeholder] * counts[-1])
            turns.append({"role": m.role, "content": pieces})
        try:
            ids = self.chat_template.encode(turns)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        return ids, MediaInputs(torch.cat(pixels), torch.tensor(grids, dtype=torch.int64), counts)

    async def _respond(self, call: _Call, req, http: HTTPRequest, chat: bool):
        cid = ("chatcmpl-" if chat else "cmpl-") + call.choices[0].request.request_id.split("-")[0]
        created = int(time.time())
        try:
            first = await self._next(call, http)  # 429 / 500 can still be a plain error response here
        except ClientDisconnectedError:
            self._abort(call)
            return Response(status_code=CLIENT_CLOSED_STATUS)
        except BaseException:
            self._abort(call)
            raise
        if req.stream:
            return StreamingResponse(
                self._stream(call, req, first, cid, created, chat),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        try:
            while not call.done:
                await self._next(call, http)
        except ClientDisconnectedError:
            return Response(status_code=CLIENT_CLOSED_STATUS)
        finally:
            self._abort(call)
        body = {
            "id": cid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": self.config.model_name,
            "choices": [],
            "usage": call.usage(),
        }
        for c in call.choices:
            if chat:
                body["choices"].append(
                    {
                        "index": c.index,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": self._logprobs_json(c, chat, 0),
                        "finish_reason": c.finish_reason,
                    }
                )
            else:
                body["choices"].append(
                    {
                        "index": c.index,
                        "text": c.text,
                        "logprobs": self._logprobs_json(c, chat, 0),
                        "finish_reason": c.finish_reason,
                    }
                )
        return JSONResponse(body)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _logprobs_json(self, choice: _Choice, chat: bool, start: int) -> dict | None:
        """The OpenAI ``logprobs`` object of ``choice.logprobs[start:]`` (``None`` when not requested).

        Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``. Completions (legacy
        format): ``tokens``, ``token_logprobs``, ``top_logprobs`` (per position a dict of the most likely
        tokens and the sampled one) and ``text_offset`` (characters of the completion text before each
        token). A token's text is its own decoding, which is U+FFFD for a piece of a multi-byte character."""
        if choice.request.sampling_params.logprobs is None:
            return None
        items = choice.logprobs[start:]
        if chat:
            content = []
            for lp in items:
                top = [self._chat_entry(t, v) for t, v in lp.top]
                content.append({**self._chat_entry(lp.token_id, lp.logprob), "top_logprobs": top})
            return {"content": content}
        tokens = [self._token_text(lp.token_id) for lp in items]
        offset = sum(len(self._token_text(lp.token_id)) for lp in choice.logprobs[:start])
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        top = []
        for lp, text in zip(items, tokens):
            entry = {self._token_text(t): v for t, v in lp.top}
            entry.setdefault(text, lp.logprob)
            top.append(entry)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in items],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _chat_entry(self, token_id: int, logprob: float) -> dict:
        text = self._token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _chunk(
        self, cid, created, chat: bool, choice: _Choice, text: str, finish: str | None, usage: bool
    ) -> dict:
        logprobs = self._logprobs_json(choice, chat, choice.sent_logprobs)
        choice.sent_logprobs = len(choice.logprobs)
        if chat:
            delta = {"content": text} if text or finish is None else {}
            if not choice.started:
                delta = {"role": "assistant", "content": text}
                choice.started = True
            entry = {"index": choice.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            entry = {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        payload = {
            "id": cid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": self.config.model_name,
            "choices": [entry],
        }
        if usage:
            payload["usage"] = None
        return payload

    async def _stream(self, call: _Call, req, first, cid, created, chat: bool) -> AsyncIterator[str]:
        usage = req.include_usage
        try:
            event = first
            while True:
                choice, text = event
                fresh = len(choice.logprobs) > choice.sent_logprobs  # a token whose text is held back
                if text is not None and (
                    text or fresh or choice.finish_reason or (chat and not choice.started)
                ):
                    yield _sse(self._chunk(cid, created, chat, choice, text, choice.finish_reason, usage))
                if call.done:
                    break
                try:
                    event = await self._next(call, None)
                except APIError as e:
                    yield _sse(e.body())
                    break
            if usage and call.done:
                yield _sse(
                    {
                        "id": cid,
                        "object": "chat.completion.chunk" if chat else "text_completion",
                        "created": created,
                        "model": self.config.model_name,
                        "choices": [],
                        "usage": call.usage(),
                    }
                )
            yield _sse("[DONE]")
        finally:
            self._abort(call)
