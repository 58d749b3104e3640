"""Image-text pairs for training the vision path: a JSONL file of ``{"image": PATH, "text": STR}`` rows.

``PATH`` is a local image file, relative to the JSONL file's folder unless absolute. A training sequence
is the image's placeholder tokens, then the text's tokens, then eos; the loss is taken on the text and the
eos only (the next-token targets of every position before the image's last placeholder are ignored,
``IGNORE_INDEX``). Rows of a batch are padded at the end with eos ids whose targets are ignored.

Legend: ``B`` rows of a batch, ``T`` the batch's longest sequence, ``L`` packed patches.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from openk3.config import KimiK3VisionConfig
from openk3.data.images import MediaInputs, image_patches, load_image
from openk3.model.vision import media_token_count

IGNORE_INDEX = -100
"""Target id whose position ``F.cross_entropy`` skips."""


@dataclass(frozen=True)
class ImageTextPair:
    image: Path
    text: str


def is_image_text_jsonl(path: str | None) -> bool:
    """Whether ``path`` is a ``.jsonl`` file whose first row is an object with ``image`` and ``text``."""
    if path is None or not path.endswith(".jsonl") or not Path(path).is_file():
        return False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    return False
                return isinstance(row, dict) and "image" in row and "text" in row
    return False


def read_image_text(path: str | Path) -> list[ImageTextPair]:
    """The rows of an image-text JSONL file. Raises ``ValueError`` naming the line of a row that is not an
    object with a string ``image`` and a non-empty string ``text``, or ``FileNotFoundError`` for a missing
    image."""
    path = Path(path)
    pairs = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n} is not valid JSON: {e}") from None
        if not (
            isinstance(row, dict) and isinstance(row.get("image"), str) and isinstance(row.get("text"), str)
        ):
            raise ValueError(f'{path}:{n}: expected {{"image": "path", "text": "..."}}, got {line[:80]!r}')
        if not row["text"]:
            raise ValueError(f"{path}:{n}: the text is empty")
        image = path.parent / row["image"]
        if not image.is_file():
            raise FileNotFoundError(f"{path}:{n}: no image file {image}")
        pairs.append(ImageTextPair(image, row["text"]))
    if not pairs:
        raise ValueError(f"{path} holds no image-text rows")
    return pairs


class ImageTextSet:
    """Image-text pairs ready for batching (images decoded once, kept as patches in memory).

    ``batch(indices)`` gives ``(input_ids [B, T], targets [B, T], media)`` where ``targets[b, i]`` is the
    token after position ``i`` or :data:`IGNORE_INDEX`, and ``media`` packs the rows' images in row order.
    """

    def __init__(
        self, pairs: list[ImageTextPair], tokenizer, vision: KimiK3VisionConfig, placeholder_id: int
    ) -> None:
        self.pairs, self.tokenizer, self.placeholder_id = pairs, tokenizer, placeholder_id
        self.patches = [image_patches(load_image(str(p.image)), vision) for p in pairs]
        self.counts = [media_token_count(vision, grid) for _, grid in self.patches]
        self.text_ids = tokenizer.encode_batch([p.text for p in pairs])

    def __len__(self) -> int:
        return len(self.pairs)

    def prompt(self, i: int) -> tuple[list[int], MediaInputs]:
        """Row ``i``'s image placeholders (the prompt that asks for its text) and its media."""
        patches, grid = self.patches[i]
        media = MediaInputs(patches, torch.tensor([grid]), [self.counts[i]])
        return [self.placeholder_id] * self.counts[i], media

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, MediaInputs]:
        eos = self.tokenizer.eos_id
        rows = [[self.placeholder_id] * self.counts[i] + self.text_ids[i] + [eos] for i in indices]
        T = max(len(r) for r in rows) - 1
        ids_BT = torch.full((len(rows), T), eos, dtype=torch.int64)
        targets_BT = torch.full((len(rows), T), IGNORE_INDEX, dtype=torch.int64)
        for b, (i, row) in enumerate(zip(indices, rows)):
            n = len(row) - 1
            ids_BT[b, :n] = torch.tensor(row[:-1])
            first = self.counts[i] - 1  # the last placeholder predicts the text's first token
            targets_BT[b, first:n] = torch.tensor(row[first + 1 :])
        media = MediaInputs(
            torch.cat([self.patches[i][0] for i in indices]),
            torch.tensor([self.patches[i][1] for i in indices], dtype=torch.int64),
            [self.counts[i] for i in indices],
        )
        return ids_BT, targets_BT, media


class RandomPairBatches:
    """``next()`` draws ``batch_size`` of ``rows`` uniformly (seeded) and returns their :meth:`ImageTextSet.batch`."""

    def __init__(self, data: ImageTextSet, rows: list[int], batch_size: int, seed: int) -> None:
        self.data, self.rows, self.batch_size = data, rows, batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor, MediaInputs]:
        picks = torch.randint(len(self.rows), (self.batch_size,), generator=self.generator).tolist()
        return self.data.batch([self.rows[p] for p in picks])
