"""Token generation with the model caches (KDA states + MLA latents).

:func:`stream` prefills the prompt through the cache in pieces of at most ``prefill_chunk`` tokens (so the
activations and logits held at once stay bounded for long prompts; equal to one pass over the whole prompt,
tested), then feeds one token at a time (equal to re-running the whole sequence; tested) and yields each new
token as soon as it is chosen.
With ``media`` (:class:`openk3.data.images.MediaInputs`, a K3 model with a vision tower) the prompt's
embeddings are built once with the images at their placeholder tokens, then prefilled in the same pieces.
Sampling: temperature 0 is greedy (argmax); otherwise softmax(logits / T), optionally restricted to the
smallest set of tokens whose probability reaches ``top_p`` (nucleus sampling, Holtzman et al. 2019).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


def check_sampling(temperature: float, top_p: float, max_new_tokens: int, seed: int | None = None) -> None:
    """Raise ``ValueError`` (naming the argument and its value) unless ``temperature`` is a finite number
    >= 0, ``top_p`` a number in (0, 1], ``max_new_tokens`` an int >= 1 (NaN and inf are rejected) and
    ``seed`` None or an int in ``[0, 2^63)``."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise ValueError(f"seed must be None or an int in [0, 2^63), got {seed!r}")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not (math.isfinite(temperature) and temperature >= 0)
    ):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not (0 < top_p <= 1):
        raise ValueError(f"top_p must be a number in (0, 1], got {top_p!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")


def sampling_probs(logits_BV: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution sampling draws from: ``softmax(logits / T)`` restricted to the nucleus ``top_p``,
    fp32 (fp64 stays) ``[B, V]``; temperature must be > 0."""
    logits_BV = logits_BV if logits_BV.dtype == torch.float64 else logits_BV.float()
    # shifted to a maximum of 0 first, so a tiny temperature gives -inf, not inf − inf = NaN; one below fp32's
    # smallest normal number acts as that number (else it would round to 0 and divide 0 by 0)
    temperature = max(temperature, torch.finfo(torch.float32).tiny)
    probs_BV = torch.softmax((logits_BV - logits_BV.amax(-1, keepdim=True)) / temperature, dim=-1)
    if top_p < 1:
        sorted_BV, order_BV = probs_BV.sort(dim=-1, descending=True)
        outside_BV = sorted_BV.cumsum(-1) - sorted_BV >= top_p  # keep tokens until the mass reaches top_p
        # the most likely token always stays (a top_p below fp32's range rounds to 0 and would drop it)
        outside_BV[:, 0] = False
        sorted_BV = sorted_BV.masked_fill(outside_BV, 0.0)
        probs_BV = torch.zeros_like(probs_BV).scatter_(-1, order_BV, sorted_BV)
    return probs_BV


def sample_next(logits_BV: torch.Tensor, temperature: float, top_p: float, generator) -> torch.Tensor:
    """Next tokens ``[B, 1]`` (int64) from last-position logits ``[B, V]``."""
    if temperature == 0:
        return logits_BV.argmax(-1, keepdim=True)
    return torch.multinomial(sampling_probs(logits_BV.float(), temperature, top_p), 1, generator=generator)


PREFILL_CHUNK = 2048
"""Prompt tokens per prefill forward in :func:`stream`: bounds the prefill's activations and its ``[B, chunk,
vocab]`` logits. k3-tiny, 8192-token prompt: peak RSS 3.3 GB in one pass, 1.4 GB in 2048-token pieces, the same
tokens (``python benchmarks/prefill_memory.py``; 16384 tokens: 11.4 vs 2.1 GB)."""


@torch.no_grad()
def stream(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_ids: set[int] | None = None,
    vocab_size: int | None = None,
    prefill_chunk: int = PREFILL_CHUNK,
    media=None,
) -> Iterator[torch.Tensor]:
    """Yield new tokens ``[B, 1]`` one step at a time (stops early when every row hit ``stop_ids``).

    ``vocab_size``: only ids below it are chosen (a tokenizer smaller than the model's vocabulary has no
    text for the others); ``None``: every id of the model. ``prefill_chunk``: most prompt tokens per forward
    (default :data:`PREFILL_CHUNK`). ``media``: the prompt's images (:class:`~openk3.data.images.MediaInputs`)
    for its placeholder tokens. Raises ``ValueError`` for a ``prefill_chunk`` below 1, or media a model
    without a vision tower cannot take / whose token count differs from the prompt's placeholders."""
    check_sampling(temperature, top_p, max_new_tokens, seed)
    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be an int >= 1, got {prefill_chunk!r}")
    if vocab_size is not None and (
        isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1
    ):
        raise ValueError(f"vocab_size must be None or an int >= 1, got {vocab_size!r}")
    generator = None
    if seed is not None:
        generator = torch.Generator(device=input_ids.device).manual_seed(seed)
    cache = model.new_cache()
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[1] > 0:
        pieces = input_ids.split(prefill_chunk, dim=1)
    else:
        pieces = (input_ids,)  # the model's input check names what is wrong
    if media is None:
        for piece in pieces:
            logits = _logits(model(piece, cache))[:, -1]
    else:
        if not hasattr(model, "embed_inputs"):
            raise ValueError(
                "this model has no vision tower (its config has no vision_config): pass text only"
            )
        model.language_model.model.check_inputs(input_ids, None, None)
        pixels = media.pixel_values.to(input_ids.device)
        embeds_BTD = model.embed_inputs(input_ids, pixels, media.grid_thws)
        for piece, embeds in zip(pieces, embeds_BTD.split(prefill_chunk, dim=1)):
            logits = _logits(model(piece, cache, inputs_embeds=embeds))[:, -1]
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for step in range(max_new_tokens):
        nxt = sample_next(
            logits if vocab_size is None else logits[:, :vocab_size], temperature, top_p, generator
        )
        yield nxt
        if stop_ids:
            done |= torch.isin(nxt[:, 0], torch.tensor(sorted(stop_ids), device=nxt.device))
            if bool(done.all()):
                return
        if step + 1 < max_new_tokens:
            logits = _logits(model(nxt, cache))[:, -1]


def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    vocab_size: int | None = None,
    prefill_chunk: int = PREFILL_CHUNK,
    media=None,
) -> torch.Tensor:
    """New tokens ``[B, max_new_tokens]`` (int64, prompt excluded). See :func:`stream`; pass the tokenizer's
    ``vocab_size`` when it is smaller than the model's vocabulary (a model trained on a small corpus), and
    ``media`` for the images of a prompt with placeholder tokens."""
    tokens = stream(
        model, input_ids, max_new_tokens, temperature, top_p, seed, vocab_size=vocab_size,
        prefill_chunk=prefill_chunk, media=media,
    )  # fmt: skip
    return torch.cat(list(tokens), dim=1)


def greedy(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy continuation ``[B, max_new_tokens]`` (temperature 0)."""
    return generate(model, input_ids, max_new_tokens)
