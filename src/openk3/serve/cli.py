"""``openk3 serve``: the OpenAI-compatible server for a checkpoint (hooked into ``openk3.cli``)."""

from __future__ import annotations

import argparse
import os

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "float64": "float64"}


def port_number(text: str) -> int:
    """``--port``: an integer in [0, 65535] (0: any free port); raises ``argparse.ArgumentTypeError``."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}: not an integer") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"invalid port {port}: must be in 1..65535 (or 0 for any free port)")
    return port


def media_folder(text: str) -> str:
    """``--allowed-local-media-path``: an existing folder; raises ``argparse.ArgumentTypeError`` (at startup,
    before the model loads) for a missing path or a file."""
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} does not exist: give the folder chat requests may read images from"
        )
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a folder: give the folder holding the image files")
    return text


def positive_mib(text: str) -> float:
    """``--max-request-mib``: a number of MiB from one byte (``2**-20``) to 1 TiB (``2**20``), fractions
    allowed; raises ``argparse.ArgumentTypeError``."""
    try:
        mib = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: not a number of MiB") from None
    if not 2**-20 <= mib <= 2**20:
        raise argparse.ArgumentTypeError(
            f"invalid size {text}: give a number of MiB from 0.000001 (one byte) to 1048576 (1 TiB)"
        )
    return mib


SERVER_MODULES = {
    "fastapi": "fastapi",
    "uvicorn": "uvicorn",
    "prometheus_client": "prometheus-client",
    "httpx": "httpx",
}
"""Modules the server imports, and their PyPI names (base dependencies of openk3, also the ``serve`` extra)."""


def check_server_modules(command: str = "serve") -> None:
    """Raise ``ValueError`` naming the missing PyPI packages and the install command when a module of
    :data:`SERVER_MODULES` cannot be imported (an install older than these dependencies)."""
    import importlib

    missing = []
    for module, package in SERVER_MODULES.items():
        try:
            importlib.import_module(module)
        except ModuleNotFoundError:
            missing.append(package)
    if missing:
        raise ValueError(
            f'openk3 {command} needs {", ".join(missing)}, not installed here: pip install -e ".[serve]" '
            f"(or pip install {' '.join(missing)})"
        )


def speculative_tokens_arg(text: str) -> int:
    """argparse type of ``--speculative-tokens`` (``openk3 serve`` and ``openk3 generate``): an int in
    ``[1, MAX_SPECULATIVE_TOKENS]``."""
    from openk3.speculative import MAX_SPECULATIVE_TOKENS

    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_SPECULATIVE_TOKENS:
        raise argparse.ArgumentTypeError(f"expected an int in [1, {MAX_SPECULATIVE_TOKENS}], got {text!r}")
    return value


DEFAULT_SPECULATIVE_TOKENS = 3
"""Drafted tokens per step with ``--draft`` when ``--speculative-tokens`` is not given (``openk3 serve`` and
``openk3 generate``; the flag has no argparse default, so that without ``--draft`` it can be refused)."""


def speculative_tokens_of(args: argparse.Namespace) -> int:
    """``--speculative-tokens`` of ``openk3 serve`` / ``openk3 generate``, or :data:`DEFAULT_SPECULATIVE_TOKENS`
    when not given; raises ``ValueError`` naming both flags when it is given without ``--draft`` (it would be
    ignored)."""
    if args.speculative_tokens is None:
        return DEFAULT_SPECULATIVE_TOKENS
    if not args.draft:
        raise ValueError("--speculative-tokens needs --draft (the draft folder that proposes the tokens)")
    return args.speculative_tokens


def cmd_serve(args: argparse.Namespace) -> int:
    from openk3.devices import check_device

    num_speculative_tokens = speculative_tokens_of(args)
    check_device(args.device)
    check_server_modules()
    import torch

    from openk3.serve.config import CacheConfig, EngineConfig, SchedulerConfig
    from openk3.serve.server import run_server

    sizes = serve_sizes(args)
    cache = CacheConfig(
        block_size=sizes["block_size"],
        num_blocks=args.num_blocks,
        pool_mib=sizes["pool_mib"],
        checkpoint_interval=sizes["checkpoint_interval"],
        enable_prefix_caching=not args.no_prefix_caching,
        host_pool_mib=args.host_pool_mib,
    )
    scheduler = SchedulerConfig(
        max_num_batched_tokens=sizes["max_num_batched_tokens"],
        max_num_seqs=args.max_num_seqs,
        max_waiting=args.max_waiting,
        long_prefill_token_threshold=sizes["long_prefill_token_threshold"],
        max_model_len=args.max_model_len,
        queue_timeout_s=args.queue_timeout,
    )
    dtype = getattr(torch, args.dtype) if args.dtype else None
    run_server(
        args.ckpt,
        args.host,
        args.port,
        engine_config=EngineConfig(cache, scheduler),
        model_name=args.model_name,
        device=args.device,
        dtype=dtype,
        draft=args.draft,
        num_speculative_tokens=num_speculative_tokens,
        allowed_local_media_path=args.allowed_local_media_path,
        max_request_bytes=None if args.max_request_mib is None else int(args.max_request_mib * 2**20),
    )
    return 0


def serve_sizes(args: argparse.Namespace) -> dict:
    """The engine sizes of ``args`` (:data:`openk3.serve.config.ENGINE_SIZE_NAMES`): those given, the rest
    ``--device``'s defaults."""
    from openk3.serve.config import ENGINE_SIZE_NAMES, engine_defaults

    given = {name: getattr(args, name) for name in ENGINE_SIZE_NAMES}
    return engine_defaults(args.device, given, args.max_num_seqs)


def add_serve_parser(sub) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to an ``argparse`` subparsers object; returns its parser."""
    from openk3.serve.config import default_by_device as by_device

    d_cache, d_sched = _defaults()
    p = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server for a checkpoint (/v1/completions, chat, SSE)"
    )
    p.add_argument(
        "--ckpt", required=True, help="checkpoint folder or run folder (uses its latest checkpoint)"
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000, help="TCP port, 1..65535 (0: any free port)")
    p.add_argument(
        "--model-name",
        dest="model_name",
        help="model id in the API (default: the name of the --ckpt folder, e.g. k3-tiny for runs/k3-tiny)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model runs")
    p.add_argument("--draft", help="speculative decoding with this draft folder (openk3 train-draft)")
    p.add_argument(
        "--speculative-tokens", dest="speculative_tokens", type=speculative_tokens_arg,
        help=f"drafted tokens per step with --draft, at most 16 (default {DEFAULT_SPECULATIVE_TOKENS}; a "
        "request's num_speculative_tokens overrides it)",
    )  # fmt: skip
    p.add_argument("--dtype", choices=sorted(DTYPES), help="model dtype (default float32)")
    p.add_argument(
        "--allowed-local-media-path",
        dest="allowed_local_media_path",
        type=media_folder,
        help="folder whose image files chat requests may name in image_url (default: only data: URLs)",
    )
    p.add_argument(
        "--max-request-mib",
        dest="max_request_mib",
        type=positive_mib,
        help="largest request body in MiB, refused with 413 before it is read (default: 1 MiB + 64 bytes a "
        "token of --max-model-len, + 4 KiB a token for a model with a vision tower)",
    )
    g = p.add_argument_group("cache")
    g.add_argument(
        "--block-size",
        dest="block_size",
        type=int,
        help=f"tokens per MLA latent block / prefix-hash unit (default {by_device('block_size')})",
    )
    g.add_argument("--num-blocks", dest="num_blocks", type=int, help="pool pages (default: from --pool-mib)")
    g.add_argument(
        "--pool-mib",
        dest="pool_mib",
        type=float,
        help=f"cache pool size in MiB (default {by_device('pool_mib')}); more than the device's free memory "
        "is refused",
    )
    g.add_argument(
        "--checkpoint-interval",
        dest="checkpoint_interval",
        type=int,
        help="KDA state checkpoint every N blocks (0: last only; default one prefill chunk's worth, as closer "
        f"checkpoints would cut the chunks: {by_device('checkpoint_interval')})",
    )
    g.add_argument(
        "--host-pool-mib",
        dest="host_pool_mib",
        type=float,
        default=d_cache.host_pool_mib,
        help="host-memory tier in MiB for cache entries the pool evicts (pinned on CUDA; default 0: none)",
    )
    g.add_argument(
        "--no-prefix-caching",
        dest="no_prefix_caching",
        action="store_true",
        help="do not reuse the cache of a shared prompt prefix across requests",
    )
    g = p.add_argument_group("scheduler")
    g.add_argument(
        "--max-num-batched-tokens",
        dest="max_num_batched_tokens",
        type=int,
        help="tokens one engine step runs at most (prefill chunks and decodes together; must exceed "
        f"--max-num-seqs; default two chunks, at least a chunk plus --max-num-seqs: "
        f"{by_device('max_num_batched_tokens', d_sched.max_num_seqs)})",
    )
    g.add_argument(
        "--max-num-seqs",
        dest="max_num_seqs",
        type=int,
        default=d_sched.max_num_seqs,
        help="requests running at once",
    )
    g.add_argument(
        "--max-waiting",
        dest="max_waiting",
        type=int,
        default=d_sched.max_waiting,
        help="bound of the waiting queue (beyond it: 429)",
    )
    g.add_argument(
        "--long-prefill-token-threshold",
        dest="long_prefill_token_threshold",
        type=int,
        help="prompt tokens per step of one request's prefill (a long prompt is split in chunks; default "
        f"{by_device('long_prefill_token_threshold')})",
    )
    g.add_argument(
        "--max-model-len",
        dest="max_model_len",
        type=int,
        default=d_sched.max_model_len,
        help="prompt + generated tokens of one request at most (beyond it: 400)",
    )
    g.add_argument(
        "--queue-timeout",
        dest="queue_timeout",
        type=float,
        default=d_sched.queue_timeout_s,
        help="seconds a request may wait for admission before 429",
    )
    p.set_defaults(func=cmd_serve)
    return p


def _defaults():
    from openk3.serve.config import CacheConfig, SchedulerConfig

    return CacheConfig(), SchedulerConfig()


def worker_list(text: str) -> tuple[str, ...]:
    """``--workers``: comma-separated ``http://host:port`` roots; raises ``argparse.ArgumentTypeError``
    naming the bad one."""
    from openk3.serve.router.config import normalize_worker_url

    urls = [u for u in text.split(",") if u.strip()]
    if not urls:
        raise argparse.ArgumentTypeError("give at least one worker URL, e.g. http://127.0.0.1:8001")
    try:
        return tuple(normalize_worker_url(u) for u in urls)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cmd_route(args: argparse.Namespace) -> int:
    check_server_modules("route")
    from openk3.serve.router.app import run_router

    config = router_config(args)
    run_router(config, args.host, args.port)
    return 0


ROUTE_FLAGS = {
    "cache_threshold": "--cache-threshold",
    "max_inflight": "--max-inflight",
    "health_interval_s": "--health-interval",
    "quarantine_s": "--quarantine",
    "chunk_chars": "--chunk-chars",
    "chunk_tokens": "--chunk-tokens",
}
"""``RouterConfig`` fields set by ``openk3 route`` flags: its errors name the flag the user typed."""


def router_config(args: argparse.Namespace):
    """The :class:`~openk3.serve.router.config.RouterConfig` of ``openk3 route``'s arguments; a value the
    config refuses raises ``ValueError`` naming the flag (``--cache-threshold must be in [0, 1], got 2.0``)."""
    from openk3.serve.router.config import RouterConfig

    try:
        return RouterConfig(
            workers=args.workers,
            cache_threshold=args.cache_threshold,
            max_inflight=args.max_inflight,
            health_interval_s=args.health_interval,
            quarantine_s=args.quarantine,
            chunk_chars=args.chunk_chars,
            chunk_tokens=args.chunk_tokens,
            max_request_bytes=int(args.max_request_mib * 2**20),
        )
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        if field in ROUTE_FLAGS:
            raise ValueError(ROUTE_FLAGS[field] + str(e)[len(field) :]) from None
        raise


def add_route_parser(sub) -> argparse.ArgumentParser:
    """Add the ``route`` subcommand (the cache-aware router in front of ``openk3 serve`` workers)."""
    from openk3.serve.router.config import RouterConfig

    d = RouterConfig(workers=("http://127.0.0.1:1",))
    p = sub.add_parser(
        "route", help="cache-aware router over several openk3 serve workers (one OpenAI endpoint)"
    )
    p.add_argument(
        "--workers",
        type=worker_list,
        required=True,
        help="worker roots, comma-separated: http://127.0.0.1:8001,http://127.0.0.1:8002",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000, help="TCP port, 1..65535 (0: any free port)")
    p.add_argument(
        "--cache-threshold",
        dest="cache_threshold",
        type=float,
        default=d.cache_threshold,
        help="route by prefix when a worker holds at least this fraction of the prompt's blocks",
    )
    p.add_argument(
        "--max-inflight",
        dest="max_inflight",
        type=int,
        default=d.max_inflight,
        help="requests in flight at which a worker counts as saturated (spill to the next one)",
    )
    p.add_argument(
        "--health-interval",
        dest="health_interval",
        type=float,
        default=d.health_interval_s,
        help="seconds between health probes of every worker",
    )
    p.add_argument(
        "--quarantine",
        type=float,
        default=d.quarantine_s,
        help="seconds a worker that answered garbage stays out",
    )
    p.add_argument(
        "--chunk-chars",
        dest="chunk_chars",
        type=int,
        default=d.chunk_chars,
        help="characters per prefix block of a text prompt",
    )
    p.add_argument(
        "--chunk-tokens",
        dest="chunk_tokens",
        type=int,
        default=d.chunk_tokens,
        help="ids per prefix block of a token-id prompt",
    )
    p.add_argument(
        "--max-request-mib",
        dest="max_request_mib",
        type=positive_mib,
        default=d.max_request_bytes / 2**20,
        help="largest request body in MiB, refused with 413 before it is read or forwarded",
    )
    p.set_defaults(func=cmd_route)
    return p
