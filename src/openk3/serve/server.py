"""Load a checkpoint into a server, run it with uvicorn, or run it on a background thread (tests, benchmarks).

A checkpoint folder (or a training run folder: its latest checkpoint) must hold ``config.json``, the
safetensors shards and ``tokenizer.json`` (``openk3 train`` writes all three). The served model id defaults
to the name of the folder given (``runs/k3-tiny`` → ``k3-tiny``, stable across resumes), not the resolved
checkpoint folder (``step-000020``).

On exit (Ctrl-C, SIGTERM) :class:`ServingServer` first aborts every engine request, so open streams end
at once, then lets uvicorn close the connections (at most ``GRACEFUL_SHUTDOWN_S`` seconds).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI

from openk3.serve.api import build_app
from openk3.serve.async_engine import AsyncEngine
from openk3.serve.chat_template import ChatTemplate
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.metrics import ServerMetrics
from openk3.serve.openai_serving import OpenAIServing, ServingConfig, request_bytes_limit

GRACEFUL_SHUTDOWN_S = 3
"""Seconds uvicorn waits for connections to close on exit before cancelling their tasks."""


class ServingServer(uvicorn.Server):
    """``uvicorn.Server`` that aborts the engine's requests as soon as it is asked to exit.

    Without this, uvicorn's graceful shutdown waits for every open stream to reach its ``max_tokens``."""

    def __init__(self, config: uvicorn.Config, serving: OpenAIServing | None) -> None:
        super().__init__(config)
        self.serving = serving

    async def shutdown(self, sockets=None) -> None:
        if self.serving is not None:
            self.serving.engine.shutdown()
        await super().shutdown(sockets=sockets)


def served_model_name(ckpt: str | Path) -> str:
    """Default model id: the name of the folder given (``"."`` and trailing slashes are normalized; a
    symbolic link keeps its own name)."""
    return Path(os.path.abspath(ckpt)).name


def build_server(
    model,
    tokenizer,
    engine_config: EngineConfig | None = None,
    model_name: str = "openk3",
    chat_template: ChatTemplate | None = None,
    max_n: int = 8,
    allowed_local_media_path: str | None = None,
    draft=None,
    num_speculative_tokens: int = 3,
    max_request_bytes: int | None = None,
) -> tuple[FastAPI, OpenAIServing]:
    """An app (and its serving object, for inspection) over an in-memory model and tokenizer.
    ``allowed_local_media_path``: the folder a chat request's ``image_url`` may name local files in
    (``None``: only ``data:`` URLs); ``draft``: a speculative draft of the model
    (:mod:`openk3.serve.speculative`) with ``num_speculative_tokens`` drafted tokens per step by default;
    ``max_request_bytes``: the largest body read (413 beyond it; ``None``: :func:`request_bytes_limit` of
    the context length, and of whether the model has a vision tower)."""
    engine_config = engine_config or EngineConfig()
    tokenizer.check_fits(getattr(model, "language_model", model).config.vocab_size)
    metrics = ServerMetrics()
    llm = LLMEngine(model, engine_config, tokenizer.vocab_size, draft, num_speculative_tokens)
    engine = AsyncEngine(llm, on_step=metrics.on_step)
    max_model_len = engine_config.scheduler.max_model_len
    if max_request_bytes is None:
        vision = getattr(model.config, "vision_config", None) is not None
        max_request_bytes = request_bytes_limit(max_model_len, vision)
    config = ServingConfig(
        model_name,
        max_model_len,
        max_n,
        allowed_local_media_path=allowed_local_media_path,
        max_choices=engine_config.scheduler.max_waiting,
        max_request_bytes=max_request_bytes,
    )
    serving = OpenAIServing(engine, tokenizer, chat_template or ChatTemplate(tokenizer), metrics, config)
    return build_app(serving), serving


def load_server(
    ckpt: str | Path,
    engine_config: EngineConfig | None = None,
    model_name: str | None = None,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    allowed_local_media_path: str | None = None,
    draft: str | Path | None = None,
    num_speculative_tokens: int = 3,
    max_request_bytes: int | None = None,
) -> tuple[FastAPI, OpenAIServing]:
    """Build the server for a checkpoint or run folder (``model_name`` defaults to
    :func:`served_model_name` of ``ckpt``; ``allowed_local_media_path`` and ``max_request_bytes`` as in
    :func:`build_server`);
    ``draft``: a draft folder for that model (a draft of another target raises ``ValueError``)."""
    from openk3.checkpoint import checkpoint_with_tokenizer, from_pretrained
    from openk3.data import Tokenizer
    from openk3.model.draft import load_draft

    folder = checkpoint_with_tokenizer(ckpt)
    model = from_pretrained(folder, device=device, dtype=dtype)
    drafter = load_draft(draft, model) if draft is not None else None
    tokenizer = Tokenizer.load(folder)
    name = model_name or served_model_name(ckpt)
    template = ChatTemplate.from_folder(tokenizer, folder)
    return build_server(
        model,
        tokenizer,
        engine_config,
        name,
        template,
        allowed_local_media_path=allowed_local_media_path,
        draft=drafter,
        num_speculative_tokens=num_speculative_tokens,
        max_request_bytes=max_request_bytes,
    )


class BackgroundServer:
    """Run an app with uvicorn on a thread: ``with BackgroundServer(app) as srv: srv.base_url``.

    ``port=0`` picks a free port. Exiting shuts the server down (and with it the engine thread).
    Raises ``RuntimeError`` when the server does not start within ``start_timeout_s``.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 30.0):
        self.sock = listen_socket(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        self.server = ServingServer(config, getattr(app.state, "serving", None))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.start_timeout_s = start_timeout_s

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (``port=0``: a free port the system picks; read it with
    ``getsockname()``), for uvicorn to serve on. Raises ``ValueError`` naming ``host:port`` when it cannot be
    listened on (in use, not local, no permission), before the model is loaded."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, _, _, _, address = infos[0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def run_server(ckpt: str | Path, host: str = "127.0.0.1", port: int = 8000, **kwargs) -> None:
    """Serve a checkpoint until interrupted (``openk3 serve``); raises ``ValueError`` when ``host:port``
    cannot be listened on (checked before loading the model). The printed address has the bound port (the
    one the system picked for ``port=0``)."""
    with listen_socket(host, port) as sock:
        app, serving = load_server(ckpt, **kwargs)
        bound = sock.getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        print(
            f"openk3 serve: model {serving.config.model_name!r} on http://{shown}:{bound}/v1 "
            f"({serving.engine.engine.pool.num_blocks} pool pages; MLA blocks of "
            f"{serving.engine.engine.storage.layout.block_size} tokens)",
            flush=True,
        )
        config = uvicorn.Config(
            app, host=host, port=bound, log_level="info", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S
        )
        with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises Ctrl-C after its shutdown
            ServingServer(config, serving).run(sockets=[sock])
