"""Serving: an engine with continuous batching and chunked prefill over a paged pool of MLA latent blocks
and KDA state pages, hash-chained prefix caching with KDA checkpoints, admission control, and an
OpenAI-compatible HTTP API.

Files (one concept each)::

    config.py          CacheConfig, SchedulerConfig, EngineConfig
    block_pool.py      pages, ref_cnt, LRU free queue, hash index, null block 0 (written invariants)
    prefix_cache.py    chained block hashes, two-stage longest-hit lookup
    cache_storage.py   the page tensor: MLA latent blocks and KDA state pages, gather/scatter, workspace
    kv_manager.py      block tables, state slots, copy-on-write hits, checkpoints, reservations
    request.py         Request, SamplingParams, RequestOutput
    scheduler.py       budgets, admission, chunked prefill, update
    decode_forward.py  paged batched forward: the model's forward on paged caches (decodes, continuing chunks)
    decode_graph.py    short greedy chunks at static shapes, captured in CUDA graphs (an eager twin elsewhere)
    model_runner.py    execute a step (chunks batched by length; lone first chunks packed), sample
    engine.py          LLMEngine: schedule → execute → update
    async_engine.py    the engine on a background thread
    protocol.py        OpenAI request bodies and error objects
    chat_template.py   messages → prompt ids (tokenizer template or ChatML default)
    detokenizer.py     incremental text with stop strings held back
    openai_serving.py  completions / chat handlers, SSE
    metrics.py         Prometheus metrics
    api.py             FastAPI routes and error handlers
    server.py          load a checkpoint, run uvicorn, BackgroundServer
    cli.py             ``openk3 serve``

The HTTP parts need ``fastapi``, ``uvicorn`` and ``prometheus-client``; the engine needs only torch.
"""

import importlib

_EXPORTS = {
    "CacheConfig": "openk3.serve.config",
    "EngineConfig": "openk3.serve.config",
    "SchedulerConfig": "openk3.serve.config",
    "LLMEngine": "openk3.serve.engine",
    "Request": "openk3.serve.request",
    "RequestOutput": "openk3.serve.request",
    "SamplingParams": "openk3.serve.request",
}
"""Public names and their modules, imported on first use (PEP 562): ``openk3 --help`` reads the serve
flags without importing torch."""


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'openk3.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "CacheConfig",
    "EngineConfig",
    "LLMEngine",
    "Request",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
]
