"""The multimodal K3 model: media placed at the placeholder tokens, the text path unchanged without media,
checkpoints with and without the vision tower under the official names."""

from __future__ import annotations

import json

import pytest
import torch

import openk3
from openk3.checkpoint import CheckpointMismatchError
from openk3.config import KimiK3Config
from openk3.model.modeling import build_model
from openk3.presets import k3_shaped
from openk3.train.optim import partition_parameters
from vision_tiny import PLACEHOLDER, TINY_VISION, tiny_config


@pytest.fixture(scope="module")
def model():
    return build_model(tiny_config(), seed=0).eval()


def media(grids, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(t * h * w for t, h, w in grids), 3, 14, 14, generator=g), torch.tensor(grids)


GRIDS = [(1, 4, 4), (2, 2, 6)]  # 4 and 3 text tokens


def prompt(n_placeholders=(4, 3), seed=0):
    """Token ids: text, an image's placeholders, text, the video's placeholders, text."""
    g = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(0, 4000, (n,), generator=g)  # noqa: E731
    parts = [text(5), torch.full((n_placeholders[0],), PLACEHOLDER), text(3)]
    parts += [torch.full((n_placeholders[1],), PLACEHOLDER), text(2)]
    return torch.cat(parts)[None]


@torch.no_grad()
def test_forward_without_media_is_the_text_forward(model):
    ids = prompt()
    text_only = build_model(tiny_config(vision=False), init=False, device="cpu")
    text_only.load_state_dict(model.state_dict(), strict=False)
    want = text_only(ids).logits
    assert torch.equal(model(ids).logits, want)
    assert torch.equal(model.language_model(ids).logits, want)


@torch.no_grad()
def test_media_fill_the_placeholders_in_order(model):
    ids = prompt()
    pixels, grids = media(GRIDS)
    got = model(ids, pixel_values=pixels, grid_thws=grids).logits
    # the expectation, built position by position
    media_MD = model.embed_media(pixels, grids)
    assert media_MD.shape == (7, 128)
    embeds = model.language_model.model.embed_tokens(ids).clone()
    slots = [i for i in range(ids.shape[1]) if ids[0, i] == PLACEHOLDER]
    for m, i in enumerate(slots):
        embeds[0, i] = media_MD[m]
    want = model.language_model(ids, inputs_embeds=embeds).logits
    assert torch.equal(got, want)
    text = model(ids).logits
    first = slots[0]
    # causal: before the image nothing changes (to fp32 rounding: the chunked kernels see other values)
    torch.testing.assert_close(got[:, :first], text[:, :first], rtol=1e-5, atol=1e-5)
    assert (got[:, first:] - text[:, first:]).abs().amax() > 1e-3


@torch.no_grad()
def test_media_embeddings_are_the_video_pooled_and_merged(model):
    """A video of identical frames gives as many tokens as one frame (frames are pooled), and other values
    (its frames carry time rows)."""
    pixels, _ = media([(1, 2, 2)])
    still = model.embed_media(pixels, torch.tensor([[1, 2, 2]]))
    video = model.embed_media(pixels.repeat(2, 1, 1, 1), torch.tensor([[2, 2, 2]]))
    assert still.shape == video.shape == (1, 128)
    assert (still - video).abs().amax() > 1e-4  # the time rows reach the output


def test_placeholder_count_mismatch_names_the_problem(model):
    pixels, grids = media(GRIDS)
    with pytest.raises(
        ValueError, match=r"input_ids hold 6 media placeholder tokens \(id 8000\) but the media give 7"
    ):
        model(prompt((4, 2)), pixel_values=pixels, grid_thws=grids)
    with pytest.raises(ValueError, match="pass pixel_values and grid_thws together"):
        model(prompt(), pixel_values=pixels)


def test_text_model_refuses_media():
    text_only = build_model(tiny_config(vision=False), seed=0)
    pixels, grids = media(GRIDS)
    with pytest.raises(ValueError, match="no vision tower"):
        text_only(prompt(), pixel_values=pixels, grid_thws=grids)


def test_vision_config_needs_a_placeholder_id():
    data = k3_shaped(4).to_dict()
    data["vision_config"] = TINY_VISION
    with pytest.raises(ValueError, match="media_placeholder_token_id=None"):
        KimiK3Config.from_dict(data)
    data["media_placeholder_token_id"] = PLACEHOLDER
    data["vision_config"] = {**TINY_VISION, "text_hidden_size": 64}
    with pytest.raises(ValueError, match="text_hidden_size=64.*hidden_size=128"):
        KimiK3Config.from_dict(data)


def test_position_table_is_trained_by_adamw(model):
    roles = {r.name: r for r in partition_parameters(model)}
    assert roles["vision_tower.patch_embed.pos_emb.weight"].kind == "adamw"
    assert roles["vision_tower.encoder.blocks.0.wqkv.weight"].kind == "muon"
    assert roles["vision_tower.patch_embed.proj.weight"].kind == "adamw"


# ---- checkpoints ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("vlm") / "ckpt"
    openk3.save_pretrained(model, path, tokenizer=None)
    return path


def test_saved_names_are_official_and_round_trip(model, saved):
    names = set(json.loads((saved / "model.safetensors.index.json").read_text())["weight_map"])
    for name in (
        "vision_tower.patch_embed.proj.weight",
        "vision_tower.patch_embed.pos_emb.weight",
        "vision_tower.encoder.blocks.1.wqkv.weight",
        "vision_tower.encoder.blocks.1.mlp.fc1.weight",
        "vision_tower.encoder.final_layernorm.weight",
        "mm_projector.proj.0.weight",
        "mm_projector.proj.2.weight",
        "mm_projector.post_norm.weight",
        "language_model.model.embed_tokens.weight",
    ):
        assert name in names, name
    assert json.loads((saved / "config.json").read_text())["vision_config"]["vt_num_hidden_layers"] == 2
    loaded = openk3.from_pretrained(saved)
    for (n, a), (m, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n == m and torch.equal(a, b), n
    pixels, grids = media(GRIDS)
    with torch.no_grad():
        assert torch.equal(
            loaded(prompt(), pixel_values=pixels, grid_thws=grids).logits,
            model(prompt(), pixel_values=pixels, grid_thws=grids).logits,
        )


def test_load_without_the_vision_tower(model, saved):
    with pytest.warns(UserWarning, match=r"skipping \d+ vision tensors"):
        text_only = openk3.from_pretrained(saved, vision=False)
    assert not hasattr(text_only, "vision_tower") and text_only.config.vision_config is None
    with torch.no_grad():
        assert torch.equal(text_only(prompt()).logits, model(prompt()).logits)


def test_text_checkpoint_into_a_vision_model_lists_the_missing_tower(tmp_path):
    text_only = build_model(tiny_config(vision=False), seed=0)
    openk3.save_pretrained(text_only, tmp_path / "text", tokenizer=None)
    config = json.loads((tmp_path / "text" / "config.json").read_text())
    config["vision_config"] = TINY_VISION
    (tmp_path / "text" / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointMismatchError, match=r"(?s)missing keys.*mm_projector.post_norm.*vision=False"
    ):
        openk3.from_pretrained(tmp_path / "text")
    assert not hasattr(openk3.from_pretrained(tmp_path / "text", vision=False), "vision_tower")
