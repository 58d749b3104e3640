"""Long-context training rows and the needle-in-a-haystack eval.

Training (``openk3 train --long-context``): each row of ``seq_len + 1`` tokens is built from the corpus as::

    passage  EOS  doc₁ EOS doc₂ EOS … doc_d  EOS  passage

``passage`` (``m = min(32, (seq_len + 1) // 4)`` tokens) and the documents ``docᵢ`` are windows at random
places of the token split, so each row is a fresh permutation of corpus pieces, and the document lengths
are random cuts of the room left. The final copy of the passage is a recall sub-task: past its first
tokens it can only be predicted from the row's first tokens, ``seq_len − m`` back. The loss stays the plain
next-token loss over the whole row.

Eval (``openk3 eval --ckpt RUN --needle 256,512,1024``): for each context length and depth, a passage (the
*needle*) of ``m`` val tokens sits at that depth of a haystack of val windows, and the row ends with ``EOS``
and the needle again. The model sees the first ``cue`` tokens of that copy; the score is the teacher-forced
argmax on the rest: ``accuracy`` (every token right) and ``token_accuracy``.

Legend: ``B`` rows, ``T`` tokens per row, ``D`` hidden size, ``M`` scored tokens per row.
"""

from __future__ import annotations

import numpy as np
import torch

from openk3.data.shards import RandomBatches

PASSAGE_TOKENS = 32
MIN_ROW_TOKENS = 8
"""Shortest training length of a recall row (a passage, documents, the copy)."""
DOCUMENTS = 4
"""Documents between the passage and its copy (fewer when the room is short)."""
NEEDLE_CUE = 8
"""Tokens of the needle's copy given before the scored ones."""
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
NEEDLE_MICRO_BATCH = 4
"""Needle rows run through the model at once (bounds the activations at long lengths)."""


def _window(tokens_N: np.ndarray, length: int, rng: np.random.Generator) -> np.ndarray:
    start = int(rng.integers(0, len(tokens_N) - length + 1))
    return np.asarray(tokens_N[start : start + length], dtype=np.int64)


def recall_row(tokens_N: np.ndarray, eos_id: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """One row of ``length`` tokens: passage, documents, passage (module docstring)."""
    m = min(PASSAGE_TOKENS, length // 4)
    passage = _window(tokens_N, m, rng)
    room = length - 2 * m - 2  # between the passage's two EOS
    docs = min(DOCUMENTS, max(1, (room + 1) // 2))
    cuts = np.sort(rng.choice(np.arange(1, room), size=docs - 1, replace=False)) if docs > 1 else []
    pieces, prev = [], 0
    for cut in [*cuts, room + 1]:  # each document of `cut − prev − 1` tokens, then its EOS
        pieces += [_window(tokens_N, int(cut - prev - 1), rng), np.array([eos_id])]
        prev = cut
    middle = np.concatenate(pieces)[:room]
    return np.concatenate([passage, [eos_id], middle, [eos_id], passage])


class LongContextBatches(RandomBatches):
    """Endless training batches of recall rows, in place of :class:`~openk3.data.shards.RandomBatches`'s plain
    windows; the rest is inherited (``seq_len`` settable per step, ``state_dict``/``load_state_dict``), so a
    run resumes exactly: batch ``s`` depends only on ``(seed, s)``."""

    def __init__(self, dataset, batch_size: int, seq_len: int, seed: int = 0):
        if seq_len < MIN_ROW_TOKENS:
            raise ValueError(
                f"long-context rows need seq_len >= {MIN_ROW_TOKENS} (a passage, documents, the copy); got {seq_len}"
            )
        super().__init__(dataset, batch_size, seq_len, seed)

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.step])
        self.step += 1
        rows = [
            recall_row(self.dataset.tokens_N, self.dataset.eos_id, self.seq_len + 1, rng)
            for _ in range(self.batch_size)
        ]
        w_BT1 = torch.from_numpy(np.stack(rows))
        return w_BT1[:, :-1].contiguous(), w_BT1[:, 1:].contiguous()


def needle_rows(
    tokens_N: np.ndarray, eos_id: int, length: int, depth: float, count: int, rng: np.random.Generator
) -> tuple[np.ndarray, int]:
    """``count`` rows of ``length`` tokens with the needle at ``depth`` ∈ [0, 1]; returns ``(rows_BT, m)``:
    the scored tokens are the last ``m − NEEDLE_CUE``."""
    m = min(PASSAGE_TOKENS, (length - 2) // 3)
    if m <= NEEDLE_CUE:
        raise ValueError(f"needle rows need length >= {3 * (NEEDLE_CUE + 1) + 2}; got {length}")
    hay = length - 2 * m - 1
    at = round(depth * hay)
    rows = []
    for _ in range(count):
        needle, haystack = _window(tokens_N, m, rng), _window(tokens_N, hay, rng)
        rows.append(np.concatenate([haystack[:at], needle, haystack[at:], [eos_id], needle]))
    return np.stack(rows), m


@torch.no_grad()
def needle_eval(
    model,
    dataset,
    lengths: list[int],
    samples: int = 16,
    seed: int = 0,
    device: str = "cpu",
    micro_batch: int = NEEDLE_MICRO_BATCH,
) -> list[dict]:
    """Score ``model`` on needle rows of each length × :data:`DEPTHS` (``samples`` rows each, from the val
    split ``dataset``). Returns one dict per cell: ``length``, ``depth``, ``accuracy``, ``token_accuracy``.

    Memory: ``micro_batch`` rows run at a time and the vocabulary projection is applied to the scored
    positions only (``m − NEEDLE_CUE`` per row), so the logits take ``micro_batch × 24 × V`` floats at any
    length. Raises ``ValueError`` when a length is longer than the val split (checked for every length
    before any is scored)."""
    have = len(dataset.tokens_N)
    too_long = [n for n in lengths if n > have]
    if too_long:
        raise ValueError(
            f"--needle {max(too_long)}: the val split {getattr(dataset, 'path', '')} holds {have:,} tokens, "
            f"fewer than one needle row of {max(too_long):,}; pass --needle lengths up to {have:,}"
        )
    lm = getattr(model, "language_model", model)
    model.eval()
    results = []
    for length in lengths:
        for depth in DEPTHS:
            rng = np.random.default_rng([seed, length, round(depth * 100)])
            rows_BT, m = needle_rows(dataset.tokens_N, dataset.eos_id, length, depth, samples, rng)
            scored = slice(length - m + NEEDLE_CUE - 1, length - 1)  # predictions of the needle's last tokens
            hits = []
            for part_BT in torch.from_numpy(rows_BT).split(micro_batch):
                tokens_BT = part_BT.to(device)
                h_BTD = lm.model(tokens_BT[:, :-1])
                predicted_BM = lm.lm_head(h_BTD[:, scored]).argmax(-1)
                hits.append(predicted_BM == tokens_BT[:, scored.start + 1 :])
            hit_BM = torch.cat(hits)
            results.append(
                {
                    "length": length,
                    "depth": depth,
                    "accuracy": float(hit_BM.all(-1).float().mean()),
                    "token_accuracy": float(hit_BM.float().mean()),
                }
            )
    return results
