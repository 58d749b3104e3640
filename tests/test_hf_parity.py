"""Parity of openk3 against Hugging Face transformers' ``kimi_linear`` (KimiLinearForCausalLM), fp32, CPU.

The reference is a tiny random model built by ``hf_tiny.build_tiny_hf_kimi_linear`` and saved with the
official Kimi-Linear tensor names; openk3 loads the same directory with ``openk3.from_pretrained``.
transformers runs its pure PyTorch KDA / short-conv paths (flash-linear-attention is not installed).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers.models.kimi_linear", reason="transformers without kimi_linear")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import openk3  # noqa: E402
from hf_tiny import (  # noqa: E402
    TINY_CONFIG,
    build_tiny_hf_kimi_linear,
    hf_greedy,
    hf_logits,
    tiny_input_ids,
)
from openk3 import generate as openk3_generate  # noqa: E402

ATOL = 1e-4
GREEDY_TOKENS = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf_tiny_kimi_linear")
    model = build_tiny_hf_kimi_linear(path, seed=0)
    return path, model


@pytest.fixture(scope="module")
def tiny_dir(tiny) -> Path:
    return tiny[0]


@pytest.fixture(scope="module")
def hf_model(tiny):
    return tiny[1]


@pytest.fixture(scope="module")
def ok_model(tiny_dir):
    model = openk3.from_pretrained(tiny_dir)
    if hasattr(model, "eval"):
        model.eval()
    return model


def _as_logits(out) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    assert isinstance(logits, torch.Tensor), f"model(input_ids) returned {type(out)}"
    return logits.detach().to("cpu", torch.float32)


def _new_tokens(out, input_ids: torch.Tensor, n: int) -> torch.Tensor:
    """Normalise a greedy result to the new tokens only, ``[B, <=n]``."""
    if hasattr(out, "sequences"):
        out = out.sequences
    out = torch.as_tensor(out).to("cpu", torch.long)
    if out.dim() == 1:
        out = out.unsqueeze(0)
    T = input_ids.shape[1]
    if out.shape[1] > n or (out.shape[1] >= T and torch.equal(out[:, :T], input_ids)):
        out = out[:, T:]
    return out


@pytest.mark.parametrize("batch,seq", [(2, 37), (1, 3), (1, 70)])
def test_logits_match_hf(hf_model, ok_model, batch, seq):
    ids = tiny_input_ids(batch, seq, seed=1000 + seq)
    ref = hf_logits(hf_model, ids)
    with torch.no_grad():
        got = _as_logits(ok_model(ids))
    assert got.shape == ref.shape == (batch, seq, TINY_CONFIG["vocab_size"])
    assert torch.isfinite(got).all()
    diff = (got - ref).abs().max().item()
    assert diff <= ATOL, f"max |logits - hf| = {diff:.3g} > {ATOL}"
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("batch,seq", [(2, 37), (1, 3)])
def test_greedy_with_cache_matches_hf(hf_model, ok_model, batch, seq):
    ids = tiny_input_ids(batch, seq, seed=2000 + seq)
    ref = hf_greedy(hf_model, ids, GREEDY_TOKENS)
    with torch.no_grad():
        got = _new_tokens(openk3_generate.greedy(ok_model, ids, GREEDY_TOKENS), ids, GREEDY_TOKENS)
    assert got.shape[0] == batch
    # The reference never stops; openk3 may stop (or pad) after eos, so compare each row up to and including
    # its first eos.
    eos = TINY_CONFIG["eos_token_id"]
    for b in range(batch):
        row = ref[b]
        hits = (row == eos).nonzero()
        upto = int(hits[0, 0]) + 1 if len(hits) else GREEDY_TOKENS
        assert got.shape[1] >= upto, f"row {b}: openk3 returned {got.shape[1]} tokens, expected >= {upto}"
        assert got[b, :upto].tolist() == row[:upto].tolist(), f"row {b}: {got[b].tolist()} != {row.tolist()}"
