"""An offline image-text set: coloured shapes drawn with Pillow and their one-line descriptions.

Each image is ``size × size`` pixels (default 56: 4 × 4 patches, 4 text tokens in MoonViT-V2) on a
light background with one shape of a random size, shade and offset; its text names the colour, the
shape and the side of the image it sits on: ``"a red circle on the left"``. Three colours × three shapes ×
four sides give 36 descriptions, so guessing gives an exact description 1 time in 36 (2.8%).

``python -m openk3.data.shapes --out data/shapes --n 2000`` writes ``images/NNNNN.png`` and
``pairs.jsonl`` (``{"image", "text"}`` rows, :mod:`openk3.data.image_text`).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

COLORS = {"red": (210, 40, 40), "green": (40, 160, 60), "blue": (40, 70, 210)}
SHAPES = ("circle", "square", "triangle")
SIDES = ("left", "right", "top", "bottom")


def draw(color: str, shape: str, side: str, size: int, rng: random.Random):
    """One image: a ``shape`` of ``color`` on the ``side`` half of a ``size × size`` canvas."""
    from PIL import Image, ImageDraw

    bg = tuple(rng.randint(225, 255) for _ in range(3))
    image = Image.new("RGB", (size, size), bg)
    r = rng.uniform(0.12, 0.2) * size
    lo, hi = r + 1, size - r - 1
    near, far = (lo, size / 2 - r * 0.3), (size / 2 + r * 0.3, hi)
    ranges = {"near": near, "far": far, "any": (lo, hi)}
    cx = rng.uniform(*ranges[{"left": "near", "right": "far"}.get(side, "any")])
    cy = rng.uniform(*ranges[{"top": "near", "bottom": "far"}.get(side, "any")])
    fill = tuple(max(0, min(255, c + rng.randint(-25, 25))) for c in COLORS[color])
    pen = ImageDraw.Draw(image)
    if shape == "circle":
        pen.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        pen.rectangle((cx - r, cy - r, cx + r, cy + r), fill=fill)
    else:
        pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return image


def write_shapes(out: str | Path, n: int, size: int = 56, seed: int = 0) -> Path:
    """Write ``n`` images and ``pairs.jsonl`` into ``out``; returns the JSONL path."""
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        color, shape, side = rng.choice(list(COLORS)), rng.choice(SHAPES), rng.choice(SIDES)
        name = f"images/{i:05d}.png"
        draw(color, shape, side, size, rng).save(out / name)
        rows.append({"image": name, "text": f"a {color} {shape} on the {side}"})
    path = out / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder to write images/ and pairs.jsonl into")
    p.add_argument("--n", type=int, default=2000, help="images to draw (default 2000)")
    p.add_argument("--size", type=int, default=56, help="image side in pixels (default 56)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(write_shapes(args.out, args.n, args.size, args.seed))


if __name__ == "__main__":
    main()
