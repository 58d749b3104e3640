"""Token generation with the model caches (KDA states + MLA latents).

:func:`greedy` prefills the prompt once, then feeds one token at a time through the cache; it equals
re-running the full sequence (tested). Sampling with temperature / top-p comes with the training CLI.
"""

from __future__ import annotations

import torch
from torch import nn


def _logits(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


@torch.no_grad()
def greedy(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Greedy continuation: int64 ``[B, max_new_tokens]`` (prompt not included).

    ``input_ids`` is ``[B, T]``; raises ``ValueError`` if ``max_new_tokens < 1`` or the ids are invalid.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    cache = model.new_cache()
    logits = _logits(model(input_ids, cache))[:, -1]
    tokens = []
    for step in range(max_new_tokens):
        nxt = logits.argmax(-1, keepdim=True)
        tokens.append(nxt)
        if step + 1 < max_new_tokens:
            logits = _logits(model(nxt, cache))[:, -1]
    return torch.cat(tokens, dim=1)
