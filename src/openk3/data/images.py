"""Images → MoonViT-V2 inputs: loading (local files and ``data:`` URLs, never downloads), resizing to the
patch grid, normalising, and the packed ``pixel_values`` / ``grid_thws`` of several media.

An image of ``H × W`` pixels is resized (bicubic, Pillow) to the nearest multiple of ``P·k`` per side
(``P`` = 14-pixel patches, ``k`` = 2 the merge kernel; at least one merged patch), scaled to ``[-1, 1]``
(``(x/255 − 0.5)/0.5``, the Kimi-VL / K2.5 processors' mean and std), and cut into ``h × w`` patches, row
by row: ``pixel_values`` ``[h·w, 3, P, P]`` and grid ``(1, h, w)``. It then takes ``(h/2)·(w/2)`` placeholder
tokens in the text. Images larger than 3584 pixels on a side are refused (:data:`openk3.model.vision.MAX_GRID_SIDE`).
A video is a list of equal-sized frames, cut into chunks of at most ``init_pos_emb_time`` (4) frames; a chunk
is one medium of grid ``(t, h, w)`` whose frames the tower pools into ``(h/2)·(w/2)`` tokens
(:func:`video_chunks`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import stat
from dataclasses import dataclass, field

import torch

from openk3.config import KimiK3VisionConfig
from openk3.model.vision import MAX_GRID_SIDE, media_token_count

IMAGE_MEAN, IMAGE_STD = 0.5, 0.5


def load_image(source: str, allowed_dir: str | None = None):
    """A Pillow RGB image from ``source``: a ``data:image/...;base64,...`` URL, a ``file://`` URL or a local
    path. ``allowed_dir``: when set, a relative path is taken inside it and a local file must lie inside it
    once symlinks and ``..`` are resolved (the server's rule); ``""`` refuses local files; ``None`` reads
    any path (relative to the working folder); ``file://localhost/p`` is ``/p`` (RFC 8089). Raises
    ``ValueError`` naming the problem and the source (a web URL: nothing is downloaded; a missing or
    unreadable file, or one that is not a regular file, such as a FIFO; data that is not an image)."""
    from PIL import Image, UnidentifiedImageError

    if source.startswith("data:"):
        head, _, payload = source.partition(",")
        if not head.endswith(";base64") or not head[5:].startswith("image/"):
            raise ValueError("a data URL image must look like data:image/<type>;base64,<data>")
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("the data URL's image is not valid base64") from None
        what = "the data URL"
    elif source.startswith(("http://", "https://")):
        raise ValueError(f"{source[:60]!r}: images are not downloaded; pass a data: URL or a local file")
    else:
        path = source.removeprefix("file://")
        if source.startswith("file://localhost/"):
            path = source.removeprefix("file://localhost")  # RFC 8089: "localhost" is this machine
        if allowed_dir:
            path = os.path.join(allowed_dir, path)  # an absolute path stays as it is
        path = os.path.realpath(path)
        if allowed_dir is not None:
            root = os.path.realpath(allowed_dir) if allowed_dir else None
            if root is None or os.path.commonpath([root, path]) != root:
                raise ValueError(f"local image {source!r} is outside the allowed media folder")
        raw = _read_regular_file(path, source)
        what = repr(source)
    try:
        image = Image.open(io.BytesIO(raw))
        image.load()
    except UnidentifiedImageError:
        raise ValueError(f"{what} is not an image Pillow can read (unknown format)") from None
    except OSError as e:
        raise ValueError(f"{what} is not an image Pillow can read: {e}") from None
    return image.convert("RGB")


def _read_regular_file(path: str, source: str) -> bytes:
    """The bytes of the regular file ``path`` (``source``: the name the error gives). It is opened without
    blocking and checked with ``fstat`` before it is read, so a FIFO, device or folder is refused at once
    rather than stalling the reader; raises ``ValueError`` naming ``source``."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise ValueError(f"cannot read image {source!r}: {e.strerror or e}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"cannot read image {source!r}: not a regular file")
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read()
        except OSError as e:
            raise ValueError(f"cannot read image {source!r}: {e.strerror or e}") from None


def image_patches(image, config: KimiK3VisionConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``(pixel_values [h·w, 3, P, P] fp32, (1, h, w))`` of a Pillow image (module docstring).

    Raises ``ValueError`` for an image larger than ``MAX_GRID_SIDE·P`` pixels on a side."""
    from PIL import Image

    P = config.patch_size
    kh, kw = config.merge_kernel_size
    W, H = image.size
    limit = MAX_GRID_SIDE * P
    if max(W, H) > limit:
        raise ValueError(
            f"the image is {W}×{H} pixels; MoonViT-V2 takes at most {limit}×{limit}: resize it first"
        )
    h = max(kh, round(H / (P * kh)) * kh)
    w = max(kw, round(W / (P * kw)) * kw)
    if (w * P, h * P) != (W, H):
        image = image.resize((w * P, h * P), Image.Resampling.BICUBIC)
    x = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(h * P, w * P, 3)
    x = (x.float() / 255 - IMAGE_MEAN) / IMAGE_STD
    patches = x.view(h, P, w, P, 3).permute(0, 2, 4, 1, 3).reshape(h * w, 3, P, P)
    return patches.contiguous(), (1, h, w)


@dataclass
class MediaInputs:
    """The packed media of one prompt: ``pixel_values`` ``[L, 3, P, P]``, ``grid_thws`` int64 ``[N, 3]``,
    ``token_counts`` (placeholders per medium) and ``digest`` (BLAKE2b of the pixels and grids: two prompts
    share cached blocks past an image only when their images are equal)."""

    pixel_values: torch.Tensor
    grid_thws: torch.Tensor
    token_counts: list[int]
    digest: bytes = field(default=b"")

    def __post_init__(self) -> None:
        if not self.digest:
            h = hashlib.blake2b(digest_size=16)
            h.update(self.grid_thws.to(torch.int64).numpy().tobytes())
            h.update(self.pixel_values.float().contiguous().numpy().tobytes())
            self.digest = h.digest()

    @property
    def num_tokens(self) -> int:
        return sum(self.token_counts)


def pack_images(images: list, config: KimiK3VisionConfig) -> MediaInputs:
    """The :class:`MediaInputs` of Pillow images, in order (raises ``ValueError`` as :func:`image_patches`)."""
    if not images:
        raise ValueError("no images to pack")
    pixels, grids = zip(*(image_patches(im, config) for im in images))
    return MediaInputs(
        torch.cat(pixels),
        torch.tensor(grids, dtype=torch.int64),
        [media_token_count(config, g) for g in grids],
    )


def video_chunks(frames: list, config: KimiK3VisionConfig) -> MediaInputs:
    """The :class:`MediaInputs` of a video: ``frames`` (Pillow images of one size) in chunks of at most
    ``config.init_pos_emb_time`` frames, each chunk one medium ``(t, h, w)`` with its frames' patches frame
    after frame. Raises ``ValueError`` for no frames or frames of different sizes."""
    if not frames:
        raise ValueError("the video has no frames")
    sizes = {f.size for f in frames}
    if len(sizes) > 1:
        raise ValueError(f"the video's frames differ in size: {sorted(sizes)}")
    per_frame = [image_patches(f, config) for f in frames]
    _, h, w = per_frame[0][1]
    T = config.init_pos_emb_time
    pixels, grids = [], []
    for start in range(0, len(frames), T):
        chunk = per_frame[start : start + T]
        pixels += [p for p, _ in chunk]
        grids.append((len(chunk), h, w))
    return MediaInputs(
        torch.cat(pixels),
        torch.tensor(grids, dtype=torch.int64),
        [media_token_count(config, g) for g in grids],
    )
