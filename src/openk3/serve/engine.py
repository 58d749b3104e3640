"""The engine: one step is ``schedule → execute → update`` (vLLM v1 ``EngineCore.step``).

:class:`LLMEngine` is synchronous and single-threaded; :mod:`openk3.serve.async_engine` runs it on a
background thread for the HTTP server. Building it sizes the paged pool from the model config.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from openk3.model.packing import pack_for_inference
from openk3.serve.block_pool import BlockPool
from openk3.serve.cache_storage import CacheStorage, PageLayout
from openk3.serve.config import EngineConfig
from openk3.serve.decode_graph import DecodeGraphs
from openk3.serve.kv_manager import KVCacheManager
from openk3.serve.model_runner import ModelRunner, language_model
from openk3.serve.request import Request, RequestOutput
from openk3.serve.scheduler import Scheduler
from openk3.serve.speculative_graph import SpeculativeGraphs


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory free for a new allocation on ``device`` in bytes: ``torch.cuda.mem_get_info`` on CUDA,
    ``MemAvailable`` of ``/proc/meminfo`` on a CPU; ``None`` where it cannot be read (no check)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def check_request_media(model: nn.Module, request: Request) -> None:
    """Raise ``ValueError`` unless ``request``'s prompt holds exactly as many media placeholder tokens as its
    images take (none without images: a placeholder with no image would embed nothing), and a request with
    images goes to a model with a vision tower."""
    if getattr(model, "vision_tower", None) is None:
        if request.media is None:
            return
        raise ValueError("this model has no vision tower: images cannot be given to it")
    placeholder = model.config.media_placeholder_token_id
    found = request.prompt_token_ids.count(placeholder)
    wanted = 0 if request.media is None else request.media.num_tokens
    if found != wanted:
        raise ValueError(
            f"the prompt holds {found} media placeholder tokens (id {placeholder}) but its images take {wanted}"
        )


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    """Fraction of pool blocks referenced by requests."""
    num_free_blocks: int
    num_blocks: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_checkpoints_stored: int
    num_rejected: int
    host_hit_tokens: int = 0
    """Prompt tokens of hits that used entries of the host-memory tier."""
    host_tier_usage: float = 0.0
    """Fraction of the host tier's pages holding entries (0 without a host tier)."""


class LLMEngine:
    """Continuous batching over a paged cache for one model (``eval`` mode, no grad)."""

    def __init__(
        self,
        model: nn.Module,
        config: EngineConfig | None = None,
        sample_vocab_size: int | None = None,
        draft: nn.Module | None = None,
        num_speculative_tokens: int = 3,
    ) -> None:
        """``sample_vocab_size``: sampled ids stay below it (the tokenizer's id space; ``None``: the model's).
        ``draft`` (:func:`~openk3.model.draft.load_draft` for this model): speculative decoding with
        ``num_speculative_tokens`` drafted tokens per step by default (:mod:`openk3.serve.speculative`)."""
        self.config = config or EngineConfig()
        self.model = model.eval()
        lm = pack_for_inference(language_model(model))  # one GEMM per layer input (model/packing.py)
        self.vocab_size = lm.config.vocab_size
        if self.config.scheduler.max_model_len > lm.config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.config.scheduler.max_model_len} exceeds the model's "
                f"max_position_embeddings={lm.config.max_position_embeddings}; lower max_model_len"
            )
        dtype = lm.model.embed_tokens.weight.dtype
        device = lm.model.embed_tokens.weight.device
        cc = self.config.cache
        layout = PageLayout.for_config(lm.config, cc.block_size, dtype)
        num_blocks = cc.num_blocks or max(2, int(cc.pool_mib * 2**20 // layout.page_bytes))
        need, free = num_blocks * layout.page_bytes, free_memory_bytes(device)
        if free is not None and need > free:
            raise ValueError(
                f"the cache pool needs {need / 2**30:.2f} GiB ({num_blocks} pages of {layout.page_bytes} B) but "
                f"only {free / 2**30:.2f} GiB is free on {device}: lower --pool-mib or --num-blocks"
            )
        static = self.config.static_decode
        static = device.type == "cuda" if static is None else static
        self.pool = BlockPool(num_blocks)
        # the static decode step's padding rows keep their KDA state in pages past the pool's
        scratch = tuple(range(num_blocks, num_blocks + layout.state_pages)) if static else ()
        self.storage = CacheStorage(layout, num_blocks + len(scratch), device)
        # a draft's chain runs its full k up to the last token: its positions past max_tokens are reserved
        lookahead = 0 if draft is None else num_speculative_tokens
        self.kv = KVCacheManager(self.pool, self.storage, cc, lookahead)
        self.scheduler = Scheduler(self.config.scheduler, self.kv)
        graphs = spec_graphs = None
        args = (
            self.storage,
            scratch,
            self.config.scheduler.max_num_seqs,
            self.kv.max_table_blocks(self.config.scheduler.max_model_len),
            sample_vocab_size,
            device.type == "cuda",
        )
        if static and draft is None:
            graphs = DecodeGraphs(lm, *args)
        elif static:  # the static speculative step; plain chunks take the paged forward (it returns features)
            spec_graphs = SpeculativeGraphs(lm, draft, *args)
        self.runner = ModelRunner(model, self.storage, sample_vocab_size, graphs)
        if draft is not None:
            from openk3.serve.speculative import SpeculativeDecoder

            self.runner.speculative = SpeculativeDecoder(
                lm, draft, self.runner, self.kv, num_speculative_tokens, spec_graphs
            )

    def add_request(self, request: Request) -> None:
        """Queue ``request``. Raises ``ValueError`` (bad ids, too long, cannot fit, images the model cannot
        take or whose token count differs from the prompt's placeholders) or ``QueueFullError``."""
        bad = [t for t in request.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if self.runner.speculative is None and request.sampling_params.num_speculative_tokens:
            raise ValueError(
                "num_speculative_tokens needs a server started with a draft (openk3 serve --draft)"
            )
        check_request_media(self.model, request)
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @torch.no_grad()
    def step(self, lock=None) -> list[RequestOutput]:
        """``schedule → execute → update``. With ``lock`` (a ``threading.Lock``) held around schedule and
        update only, other threads may add and abort requests while the model runs."""
        lock = lock or contextlib.nullcontext()
        with lock:
            scheduled = self.scheduler.schedule()
        sampled = self.runner.execute(scheduled) if scheduled.chunks else {}
        with lock:
            outputs = self.scheduler.update(scheduled, sampled)
        if self.runner.speculative is not None:
            for out in outputs:
                if out.finished:
                    self.runner.speculative.release(out.request_id)
        return outputs

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every request (after an engine error); each output carries ``message`` in ``error``."""
        outputs = []
        for request in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.abort(request.request_id)
        for out in self.scheduler.schedule_aborts():
            out.error = message
            outputs.append(out)
            if self.runner.speculative is not None:
                self.runner.speculative.release(out.request_id)
        return outputs

    def stats(self) -> EngineStats:
        kv = self.kv
        return EngineStats(
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            self.pool.usage,
            self.pool.num_free_blocks,
            self.pool.num_blocks,
            kv.prefix_query_tokens,
            kv.prefix_hit_tokens,
            kv.num_checkpoints_stored,
            self.scheduler.num_rejected,
            kv.host_hit_tokens,
            kv.host.num_used_pages / kv.host.num_pages if kv.host else 0.0,
        )

    def generate(self, requests: list[Request], max_steps: int = 1_000_000) -> dict[str, list[int]]:
        """Run ``requests`` to completion (offline use and tests); returns request id → output tokens.

        Raises ``RuntimeError`` if they are not done after ``max_steps`` steps."""
        for request in requests:
            self.add_request(request)
        for _ in range(max_steps):
            if not self.has_unfinished_requests():
                return {r.request_id: list(r.output_token_ids) for r in requests}
            self.step()
        raise RuntimeError(f"requests not finished after {max_steps} steps")
