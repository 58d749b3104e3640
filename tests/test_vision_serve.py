"""Images in generation, the serving engine and the OpenAI chat API: results equal to a full forward that
recomputes everything, the image's tokens cached like any prefix (and only for the same image), clear
errors for images the server does not take."""

from __future__ import annotations

import base64
import io
import os
import threading

import openai
import pytest
import torch
from PIL import Image

import openk3
from openk3.data import Tokenizer
from openk3.data.images import MediaInputs, image_patches, load_image, pack_images, video_chunks
from openk3.generate import generate
from openk3.serve import CacheConfig, EngineConfig, SchedulerConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.request import Request, SamplingParams
from openk3.serve.server import BackgroundServer, build_server
from vision_tiny import tiny_config

VOCAB, PLACEHOLDER = 400, 399
TEXT = ["a red square on the left. ", "a blue circle at the top. ", "two green lines cross. "]


@pytest.fixture(scope="module")
def model():
    return openk3.build_model(tiny_config(vocab_size=VOCAB, placeholder=PLACEHOLDER), seed=0).eval()


def picture(color=(200, 30, 30), size=(70, 42)) -> Image.Image:
    image = Image.new("RGB", size, (255, 255, 255))
    image.paste(color, (5, 5, 30, 30))
    return image


def data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def full_forward_greedy(model, ids, media, n, vocab=None):
    """Greedy tokens (ids below ``vocab``) by re-running the whole sequence (no cache) each step."""
    seq = list(ids)
    for _ in range(n):
        x = torch.tensor([seq])
        logits = model(x, pixel_values=media.pixel_values, grid_thws=media.grid_thws).logits
        seq.append(int(logits[0, -1, :vocab].argmax()))
    return seq[len(ids) :]


# ---- preprocessing -------------------------------------------------------------------------------------
def test_image_patches_are_the_normalised_pixels_in_row_major_patches(model):
    vision = model.config.vision_config
    image = Image.fromarray(torch.randint(0, 256, (56, 84, 3), dtype=torch.uint8).numpy())
    patches, grid = image_patches(image, vision)
    assert grid == (1, 4, 6) and patches.shape == (24, 3, 14, 14)
    pixels = torch.tensor(list(image.get_flattened_data()), dtype=torch.float32).view(56, 84, 3)
    # patch (row 2, column 5), channel 1, pixel (3, 7) of that patch
    assert patches[2 * 6 + 5, 1, 3, 7].item() == pytest.approx((pixels[28 + 3, 70 + 7, 1] / 255 - 0.5) / 0.5)
    resized, grid = image_patches(picture(size=(70, 42)), vision)  # 70×42 → nearest multiples of 28: 56×56
    assert grid == (1, 4, 4)


def test_images_load_from_data_urls_and_files_never_from_the_web(tmp_path):
    image = picture()
    assert list(load_image(data_url(image)).get_flattened_data()) == list(image.get_flattened_data())
    image.save(tmp_path / "a.png")
    assert load_image(str(tmp_path / "a.png")).size == (70, 42)
    assert load_image("file://" + str(tmp_path / "a.png"), allowed_dir=str(tmp_path)).size == (70, 42)
    with pytest.raises(ValueError, match="not downloaded"):
        load_image("https://example.com/a.png")
    with pytest.raises(ValueError, match="outside the allowed media folder"):
        load_image(str(tmp_path / "a.png"), allowed_dir="")
    with pytest.raises(ValueError, match="outside the allowed media folder"):
        load_image(str(tmp_path / "a.png"), allowed_dir=str(tmp_path / "sub"))
    with pytest.raises(ValueError, match="not valid base64"):
        load_image("data:image/png;base64,@@@")
    with pytest.raises(ValueError, match="not an image"):
        load_image("data:image/png;base64," + base64.b64encode(b"not a png").decode())


def test_relative_local_images_resolve_inside_the_allowed_folder(tmp_path):
    """A relative path (or ``file://`` URL) is read inside ``allowed_dir``, whatever the working folder; one
    that leaves it (``..``, a symlink pointing out) is refused."""
    root, outside = tmp_path / "media", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    picture().save(root / "sub" / "a.png")
    picture().save(outside / "b.png")
    (root / "link.png").symlink_to(outside / "b.png")
    (root / "inner.png").symlink_to(root / "sub" / "a.png")
    for source in ("sub/a.png", "file://sub/a.png", "./sub/../sub/a.png", "inner.png"):
        assert load_image(source, allowed_dir=str(root)).size == (70, 42), source
    for source in ("../outside/b.png", "link.png", "sub/../../outside/b.png", str(outside / "b.png")):
        with pytest.raises(ValueError, match="outside the allowed media folder"):
            load_image(source, allowed_dir=str(root))
    with pytest.raises(ValueError, match="cannot read image 'sub/none.png'"):
        load_image("sub/none.png", allowed_dir=str(root))
    with pytest.raises(ValueError, match="outside the allowed media folder"):
        load_image("sub/a.png", allowed_dir="")


def load_in_a_thread(source, allowed_dir, timeout=10.0):
    """``load_image`` on a daemon thread: ``("ok", image)``, ``("error", ValueError)`` or ``("hung", None)``."""
    out = []

    def run():
        try:
            out.append(("ok", load_image(source, allowed_dir=allowed_dir)))
        except ValueError as e:
            out.append(("error", e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    return out[0] if out else ("hung", None)


def test_a_fifo_or_folder_in_the_media_folder_is_refused_without_blocking(tmp_path):
    """A FIFO is never opened for a blocking read (it would stall the tokenizer thread, and with it every later
    request); it and a folder are named as not regular files."""
    (tmp_path / "cats").mkdir()
    fifo = tmp_path / "cats" / "fifo.png"
    os.mkfifo(fifo)
    try:
        kind, value = load_in_a_thread("cats/fifo.png", str(tmp_path))
    finally:  # release a reader stuck in open() so a failing run does not leave the thread behind
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    assert kind == "error", kind
    assert str(value) == "cannot read image 'cats/fifo.png': not a regular file"
    with pytest.raises(ValueError, match="'cats': not a regular file"):
        load_image("cats", allowed_dir=str(tmp_path))


def test_file_url_with_localhost_is_an_absolute_path(tmp_path):
    """RFC 8089: ``file://localhost/p`` names ``/p`` on this machine, like ``file:///p``."""
    (tmp_path / "cats").mkdir()
    picture().save(tmp_path / "cats" / "1.png")
    for url in (f"file://localhost{tmp_path}/cats/1.png", f"file://{tmp_path}/cats/1.png"):
        assert load_image(url, allowed_dir=str(tmp_path)).size == (70, 42), url
        assert load_image(url).size == (70, 42), url


def test_unreadable_image_errors_name_the_source_not_a_buffer(tmp_path):
    (tmp_path / "junk.png").write_bytes(b"not a png")
    with pytest.raises(ValueError) as e:
        load_image("junk.png", allowed_dir=str(tmp_path))
    assert str(e.value) == "'junk.png' is not an image Pillow can read (unknown format)"
    with pytest.raises(ValueError) as e:
        load_image("data:image/png;base64," + base64.b64encode(b"not a png").decode())
    assert str(e.value) == "the data URL is not an image Pillow can read (unknown format)"


def test_too_large_image_is_refused(model):
    with pytest.raises(ValueError, match=r"3598×20 pixels; MoonViT-V2 takes at most 3584×3584"):
        image_patches(Image.new("RGB", (3598, 20)), model.config.vision_config)


# ---- generate ------------------------------------------------------------------------------------------
@torch.no_grad()
def test_generate_with_an_image_equals_the_full_forward(model):
    media = pack_images([picture()], model.config.vision_config)
    ids = [5, 6, 7] + [PLACEHOLDER] * media.num_tokens + [8, 9]
    want = full_forward_greedy(model, ids, media, 6)
    got = generate(model, torch.tensor([ids]), 6, media=media, prefill_chunk=4)  # pieces split the image
    assert got[0].tolist() == want
    with pytest.raises(ValueError, match="media placeholder tokens"):
        generate(model, torch.tensor([ids[:-3]]), 2, media=media)


# ---- the engine ----------------------------------------------------------------------------------------
def run_engine(engine, request):
    outs = []
    engine.add_request(request)
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == request.request_id]
    return [t for o in outs for t in o.new_token_ids], outs[-1].num_cached_tokens


@torch.no_grad()
def test_engine_serves_images_and_caches_their_tokens(model):
    cfg = EngineConfig(
        CacheConfig(block_size=4, num_blocks=400, checkpoint_interval=1),
        SchedulerConfig(
            max_num_batched_tokens=8, max_num_seqs=4, long_prefill_token_threshold=8, max_model_len=128
        ),
    )
    engine = LLMEngine(model, cfg)
    vision = model.config.vision_config
    red, blue = pack_images([picture()], vision), pack_images([picture((20, 20, 220))], vision)
    ids = [5, 6, 7] + [PLACEHOLDER] * red.num_tokens + [8, 9, 10, 11, 12, 13, 14]
    params = SamplingParams(max_tokens=5)
    want = full_forward_greedy(model, ids, red, 5)
    first, cached = run_engine(engine, Request("a", ids, params, media=red))
    assert first == want and cached == 0
    again, cached = run_engine(engine, Request("b", ids, params, media=red))
    assert again == want and cached == 12  # 3 full blocks of the 14-token prompt, past the image (3..6)
    other, cached = run_engine(engine, Request("c", ids, params, media=blue))
    assert cached == 0 and other == full_forward_greedy(model, ids, blue, 5)
    with pytest.raises(ValueError, match=r"holds 3 media placeholder tokens .* take 4"):
        engine.add_request(Request("d", [5, PLACEHOLDER, PLACEHOLDER, PLACEHOLDER], params, media=red))
    with pytest.raises(
        ValueError, match=r"holds 2 media placeholder tokens .* take 0"
    ):  # ids without an image
        engine.add_request(Request("e", [5, PLACEHOLDER, PLACEHOLDER], params))


# ---- the OpenAI API ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    media_dir = tmp_path_factory.mktemp("media")
    picture().save(media_dir / "red.png")
    tok = Tokenizer.train(TEXT * 30, vocab_size=384)
    cfg = EngineConfig(
        CacheConfig(block_size=8, num_blocks=400, checkpoint_interval=2), SchedulerConfig(max_model_len=256)
    )
    app, serving = build_server(model, tok, cfg, "k3-vision", allowed_local_media_path=str(media_dir))
    with BackgroundServer(app) as srv:
        srv.serving, srv.tok, srv.media_dir = serving, tok, media_dir
        yield srv


def chat(server, content, max_tokens=6):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
    return client.chat.completions.create(
        model="k3-vision",
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
    )


def test_chat_with_an_image_answers_as_the_model_does(model, server):
    image = picture()
    parts = [{"type": "text", "text": "look: "}, {"type": "image_url", "image_url": {"url": data_url(image)}}]
    reply = chat(server, parts + [{"type": "text", "text": " what is it?"}])
    tok = server.tok
    media = pack_images([image], model.config.vision_config)
    ids = server.serving.chat_template.encode(
        [{"role": "user", "content": ["look: ", [PLACEHOLDER] * media.num_tokens, " what is it?"]}]
    )
    want = full_forward_greedy(model, ids, media, 6, vocab=tok.vocab_size)
    stop = server.serving.chat_template.stop_token_ids
    cut = next((i for i, t in enumerate(want) if t in stop), len(want))
    assert reply.choices[0].message.content == tok.decode(
        [t for t in want[:cut] if t not in tok.special_tokens.values()]
    )
    assert reply.usage.prompt_tokens == len(ids)
    # the same image again: its tokens come from the prefix cache
    again = chat(server, parts + [{"type": "text", "text": " what is it?"}])
    assert again.choices[0].message.content == reply.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= 8
    by_file = chat(server, [{"type": "image_url", "image_url": {"url": str(server.media_dir / "red.png")}}])
    assert by_file.choices[0].message.content is not None
    # a relative path is read inside --allowed-local-media-path, not the server's working folder
    relative = chat(server, [{"type": "image_url", "image_url": {"url": "red.png"}}])
    assert relative.choices[0].message.content == by_file.choices[0].message.content


@pytest.mark.parametrize(
    "url, match",
    [
        ("https://example.com/cat.png", "not downloaded"),
        ("/etc/hostname", "outside the allowed media folder"),
        ("../../../../../../etc/hostname", "outside the allowed media folder"),
        ("data:image/png;base64,AAAA", "not an image"),
        (data_url(Image.new("RGB", (3600, 14))), "at most 3584×3584"),
    ],
)
def test_chat_refuses_images_it_cannot_take(server, url, match):
    with pytest.raises(openai.BadRequestError, match=match) as e:
        chat(server, [{"type": "image_url", "image_url": {"url": url}}])
    assert e.value.body["param"] == "messages.0.content.0.image_url"


def test_chat_refuses_a_fifo_and_keeps_serving(server):
    """A FIFO in the media folder is a 400 naming it, and the server still answers the next image request."""
    fifo = server.media_dir / "fifo.png"
    os.mkfifo(fifo)
    try:
        with pytest.raises(openai.BadRequestError, match="'fifo.png': not a regular file"):
            chat(server, [{"type": "image_url", "image_url": {"url": "fifo.png"}}])
    finally:
        fifo.unlink()
    assert chat(server, [{"type": "image_url", "image_url": {"url": "red.png"}}]).choices[0].message.content


@pytest.mark.parametrize("kind, match", [("missing", "does not exist"), ("file", "is not a folder")])
def test_serve_refuses_a_media_folder_that_is_not_one_at_startup(tmp_path, capsys, kind, match):
    """``openk3 serve --allowed-local-media-path`` names a missing path or a file in one line before loading."""
    from openk3.cli import main

    path = tmp_path / "media"
    if kind == "file":
        path.write_text("")
    with pytest.raises(SystemExit) as e:
        main(["serve", "--ckpt", str(tmp_path / "none"), "--allowed-local-media-path", str(path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument --allowed-local-media-path: {str(path)!r} {match}: give the folder" in err


def test_media_inputs_digest_tells_images_apart(model):
    vision = model.config.vision_config
    a, b = pack_images([picture()], vision), pack_images([picture((0, 0, 255))], vision)
    assert a.digest == pack_images([picture()], vision).digest != b.digest
    assert isinstance(a, MediaInputs) and a.token_counts == [4]


def test_generate_cli_takes_images(model, tmp_path, capsys):
    from openk3.cli import main

    tok = Tokenizer.train(TEXT * 30, vocab_size=384)
    openk3.save_pretrained(model, tmp_path / "m", tokenizer=tok)
    picture().save(tmp_path / "red.png")
    args = ["generate", "--ckpt", str(tmp_path / "m"), "--prompt", "a red", "--max-new-tokens", "4"]
    assert main([*args, "--temperature", "0", "--image", str(tmp_path / "red.png")]) == 0
    media = pack_images([picture()], model.config.vision_config)
    ids = [PLACEHOLDER] * media.num_tokens + tok.encode("a red")
    want = full_forward_greedy(model, ids, media, 4, vocab=tok.vocab_size)
    # a trailing incomplete UTF-8 character is written at the end as decode writes it (U+FFFD), not dropped
    assert capsys.readouterr().out == "a red" + tok.decode(want) + "\n"
    text_only = openk3.build_model(tiny_config(vision=False, vocab_size=VOCAB), seed=0)
    openk3.save_pretrained(text_only, tmp_path / "t", tokenizer=tok)
    args[2] = str(tmp_path / "t")
    assert main([*args, "--image", str(tmp_path / "red.png")]) != 0
    assert "--image needs a model with a vision tower" in capsys.readouterr().err


@torch.no_grad()
def test_video_chunks_pool_frames_and_generate(model):
    vision = model.config.vision_config
    frames = [picture((20 * i, 30, 200 - 20 * i)) for i in range(6)]
    media = video_chunks(frames, vision)
    assert media.grid_thws.tolist() == [[4, 4, 4], [2, 4, 4]] and media.token_counts == [4, 4]
    first = torch.cat([image_patches(f, vision)[0] for f in frames[:4]])
    assert torch.equal(media.pixel_values[: 4 * 16], first)
    ids = [5] + [PLACEHOLDER] * 8 + [6]
    assert generate(model, torch.tensor([ids]), 3, media=media)[0].tolist() == full_forward_greedy(
        model, ids, media, 3
    )
    with pytest.raises(ValueError, match="differ in size"):
        video_chunks([picture(), picture(size=(28, 28))], vision)


def test_a_saved_vision_checkpoint_answers_an_image_chat(model, tmp_path):
    """The issue's end-to-end path: a tiny random K3 with a vision tower saved in the official layout,
    loaded by the server, answers a chat request with an image as the in-memory model does."""
    from openk3.serve.server import load_server

    tok = Tokenizer.train(TEXT * 30, vocab_size=384)
    openk3.save_pretrained(model, tmp_path / "ckpt", tokenizer=tok)
    cfg = EngineConfig(CacheConfig(block_size=8, num_blocks=200), SchedulerConfig(max_model_len=128))
    app, serving = load_server(tmp_path / "ckpt", cfg, model_name="k3-vision")
    assert serving.engine.engine.model.vision_tower is not None
    image = picture((30, 160, 40))
    with BackgroundServer(app) as srv:
        reply = chat(srv, [{"type": "image_url", "image_url": {"url": data_url(image)}}], max_tokens=5)
    media = pack_images([image], model.config.vision_config)
    ids = serving.chat_template.encode([{"role": "user", "content": [[PLACEHOLDER] * media.num_tokens]}])
    want = full_forward_greedy(model, ids, media, 5, vocab=tok.vocab_size)
    stop = serving.chat_template.stop_token_ids
    want = want[: next((i for i, t in enumerate(want) if t in stop), len(want))]
    assert reply.choices[0].message.content == tok.decode(
        [t for t in want if t not in tok.special_tokens.values()]
    )


def test_only_prompt_placeholders_take_media(model):
    """A generated token equal to the placeholder id is a token, not a slot for an image."""
    from openk3.serve.model_runner import ModelRunner
    from openk3.serve.scheduler import ScheduledChunk

    media = pack_images([picture()], model.config.vision_config)
    r = Request("x", [5] + [PLACEHOLDER] * 4 + [6], SamplingParams(max_tokens=4), media=media)
    r.output_token_ids = [PLACEHOLDER, 7]
    slots = [
        ModelRunner._media_slots(ScheduledChunk(r, s, n, [], ()), PLACEHOLDER) for s, n in ((0, 3), (3, 4))
    ]
    assert slots == [[1, 2], [0, 1]]
    assert ModelRunner._media_slots(ScheduledChunk(r, 6, 2, [], ()), PLACEHOLDER) == []
