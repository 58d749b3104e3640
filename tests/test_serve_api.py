"""The HTTP server driven by the real ``openai`` SDK on 127.0.0.1: completions, chat, SSE streaming, usage
with cached tokens, stop strings, bad input (400 naming the field: seed range, lone surrogates, NaN, strict
booleans, refused no-op-only fields), client disconnects, a bounded load test, 429 when the queue is full,
metrics, tokenization off the event loop, the default model id, ``--port`` checks, prompt shutdown, and
``openk3 serve`` as a subprocess. Greedy texts are checked against
:func:`openk3.generate.greedy` on the same checkpoint."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import openai
import pytest
import torch

import openk3
from openk3.data import Tokenizer
from openk3.serve import CacheConfig, EngineConfig, SchedulerConfig
from openk3.serve.detokenizer import IncrementalDetokenizer
from openk3.serve.mailbox import LoopMailbox
from openk3.serve.server import BackgroundServer, load_server

VOCAB = 384
MAX_MODEL_LEN = 256
MODEL = "k3-test"
TEXT = [
    "ROMEO. But soft, what light through yonder window breaks? It is the east, and Juliet is the sun.\n",
    "HAMLET. To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer\n",
    "MACBETH. Tomorrow, and tomorrow, and tomorrow, Creeps in this petty pace from day to day,\n",
]
PROMPT = TEXT[0] + TEXT[1]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    tok = Tokenizer.train(TEXT * 30, vocab_size=VOCAB)
    openk3.save_pretrained(openk3.build_model(openk3.presets.k3_shaped(4, vocab_size=VOCAB), seed=0), folder)
    tok.save(folder)
    return folder


def engine_config(**sched) -> EngineConfig:
    sched = {
        "max_num_batched_tokens": 128,
        "max_num_seqs": 32,
        "max_waiting": 256,
        "max_model_len": MAX_MODEL_LEN,
        "long_prefill_token_threshold": 64,
        **sched,
    }
    return EngineConfig(
        CacheConfig(block_size=8, num_blocks=6000, checkpoint_interval=2), SchedulerConfig(**sched)
    )


@pytest.fixture(scope="module")
def server(ckpt):
    app, serving = load_server(ckpt, engine_config(), model_name=MODEL)
    with BackgroundServer(app) as srv:
        srv.serving = serving
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(ckpt):
    """Greedy text of the checkpoint for a prompt: ids until a stop id, special tokens not written."""
    model = openk3.from_pretrained(ckpt).eval()
    tok = Tokenizer.load(ckpt)

    def text(ids: list[int], n: int, stop_ids: set[int]) -> str:
        out = openk3.generate.greedy(model, torch.tensor([ids]), n)[0].tolist()
        cut = next((i for i, t in enumerate(out) if t in stop_ids), len(out))
        return tok.decode([t for t in out[:cut] if t not in tok.special_tokens.values()])

    text.tokenizer = tok
    return text


def wait_idle(serving, timeout_s=20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = serving.engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0.0:
            return
        time.sleep(0.02)
    raise AssertionError(f"engine not idle: {serving.engine.stats()}")


def test_detokenizer_holds_back_stop_strings():
    class Chars:  # token id = character code
        def decode(self, ids):
            return "".join(map(chr, ids))

    d = IncrementalDetokenizer(Chars(), stop=["lo w", "xyz"])
    pieces = [d.push([ord(c)]) for c in "hello world"]
    # "l" is held (it may start "lo w"); the next "l" releases the first; "lo", "lo " are held; "w" stops
    assert [p[0] for p in pieces] == ["h", "e", "", "l", "", "", ""] + [""] * 4
    assert [p[1] for p in pieces] == [False] * 6 + [True] * 5 and d.flush() == ""
    d = IncrementalDetokenizer(Chars(), stop=["xyz"])
    assert [d.push([ord(c)])[0] for c in "axyb"] == ["a", "", "", "xyb"] and d.flush() == ""
    d = IncrementalDetokenizer(Chars(), stop=["yy"])
    assert d.push([ord("a"), ord("y")]) == ("a", False) and d.flush() == "y"


def test_detokenizer_decodes_short_windows_and_completes_characters():
    class Bytes:  # token id = one UTF-8 byte; records the longest id list it was asked to decode
        longest = 0

        def decode(self, ids):
            Bytes.longest = max(Bytes.longest, len(ids))
            return bytes(ids).decode("utf-8", errors="replace")

    text = "héllo wörld — 日本語, ok. " * 30
    d = IncrementalDetokenizer(Bytes())
    pieces = [d.push([b])[0] for b in text.encode()]
    assert "".join(pieces) + d.flush() == text
    assert pieces[:3] == ["h", "", "é"]  # the first byte of "é" waits for the second
    assert Bytes.longest <= 6  # two characters of at most 3 bytes, never the whole output


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found" and "no-such-model" in e.value.body["message"]
    health = json.loads(urllib.request.urlopen(server.base_url + "/health").read())
    assert health == {"status": "ok", "max_request_bytes": server.serving.config.max_request_bytes}
    text = urllib.request.urlopen(server.base_url + "/metrics").read().decode()
    for name in (
        "openk3:num_requests_running",
        "openk3:num_requests_waiting",
        "openk3:prefix_cache_hits_total",
        "openk3:prefix_cache_hit_rate",
        "openk3:generation_tokens_per_second",
        "openk3:time_to_first_token_seconds_bucket",
        "openk3:kv_cache_usage_perc",
    ):
        assert name in text


def test_completion_matches_reference_and_reports_cached_tokens(server, client, reference):
    tok = reference.tokenizer
    ids = tok.encode(PROMPT)
    assert len(ids) > 24
    want = reference(ids, 12, {tok.eos_id})
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    second = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert first.choices[0].text == second.choices[0].text == want
    assert first.usage.prompt_tokens == len(ids) and first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // 8 * 8
    assert second.usage.completion_tokens == first.usage.completion_tokens
    text = urllib.request.urlopen(server.base_url + "/metrics").read().decode()
    hits = [ln for ln in text.splitlines() if ln.startswith("openk3:prefix_cache_hits_total")]
    assert float(hits[0].split()[-1]) >= (len(ids) - 1) // 8 * 8
    wait_idle(server.serving)


def test_streaming_completion_with_usage(client):
    plain = client.completions.create(model=MODEL, prompt=TEXT[2], max_tokens=10, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=TEXT[2],
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == plain.choices[0].finish_reason


def test_chat_plain_and_stream(client, reference):
    tok = reference.tokenizer
    messages = [{"role": "system", "content": "Speak verse."}, {"role": "user", "content": TEXT[1]}]
    ids = []
    for m in messages:  # the documented ChatML default over the reserved special tokens
        ids += [1] + tok.encode(f"{m['role']}\n{m['content']}") + [2] + tok.encode("\n")
    ids += [1] + tok.encode("assistant\n")
    want = reference(ids, 9, {tok.eos_id, 2})
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, temperature=0)
    assert plain.choices[0].message.role == "assistant" and plain.choices[0].message.content == want
    assert plain.usage.prompt_tokens == len(ids) and plain.object == "chat.completion"
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=9, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_stop_string_is_held_back(client):
    full = (
        client.completions.create(model=MODEL, prompt=TEXT[0], max_tokens=16, temperature=0).choices[0].text
    )
    assert len(full) >= 6
    stop = full[3:5]
    want = full[: full.find(stop)]
    plain = client.completions.create(
        model=MODEL, prompt=TEXT[0], max_tokens=16, temperature=0, stop=[stop, "@@@"]
    )
    assert plain.choices[0].text == want and plain.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=TEXT[0], max_tokens=16, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == want


def test_n_choices_and_seed(client):
    def sample():
        r = client.completions.create(
            model=MODEL, prompt=["To be", "or not"], max_tokens=6, temperature=1.0, top_p=0.9, n=2, seed=7
        )
        return [(c.index, c.text) for c in r.choices], r.usage

    first, usage = sample()
    second, _ = sample()
    assert [i for i, _ in first] == [0, 1, 2, 3] and first == second
    assert usage.completion_tokens <= 4 * 6


def _post(server, path: str, body: bytes) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    conn.close()
    return resp.status, data


BAD = [
    ("/v1/completions", b"{not json", "invalid_json"),
    ("/v1/completions", b"[1, 2]", "invalid_json"),
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "invalid_json"),  # too deep
    ("/v1/completions", b'{"prompt": "hi", "n": 1' + b"0" * 5000 + b"}", "invalid_json"),  # > 4,300 digits
    ("/v1/completions", json.dumps({"prompt": "hi"}).encode(), "model"),
    ("/v1/completions", json.dumps({"model": MODEL}).encode(), "prompt"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 0}).encode(), "max_tokens"),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": [5] * (MAX_MODEL_LEN + 1)}).encode(), "prompt"),
    (
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": MAX_MODEL_LEN}).encode(),
        "prompt",
    ),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "n": 100}).encode(), "n"),
    (
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": "hi", "temperature": -1}).encode(),
        "temperature",
    ),
    (
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": "hi", "temperature": 5}).encode(),
        "temperature",
    ),
    (
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": "hi", "temperature": "hot"}).encode(),
        "temperature",
    ),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "top_p": 0}).encode(), "top_p"),
    (
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}).encode(),
        "stop",
    ),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode(), "messages"),
    (
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": "hi", "num_speculative_tokens": 17}).encode(),
        "num_speculative_tokens",
    ),
    (
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 9}).encode(),
        "n",
    ),
    (
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": [{"content": "x"}]}).encode(),
        "messages.0.role",
    ),
    *(  # null content: OpenAI allows it only for an assistant turn that calls tools, which this server has not
        (
            "/v1/chat/completions",
            json.dumps({"model": MODEL, "messages": [*before, {"role": role, "content": None}]}).encode(),
            f"messages.{len(before)}.content",
        )
        for role, before in [
            ("user", []),
            ("system", []),
            ("assistant", [{"role": "user", "content": "hi"}]),
        ]
    ),
    (
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": [{"role": "user"}]}).encode(),
        "messages.0.content",
    ),
]


@pytest.mark.parametrize("path,body,param", BAD)
def test_bad_input_is_400(server, path, body, param):
    status, data = _post(server, path, body)
    assert status == 400, data
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["message"] and (err["param"] == param or err["code"] == param)


def test_bad_input_through_sdk_then_still_serving(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=-0.5)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    assert (
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
        .choices[0]
        .finish_reason
    )


def test_client_disconnect_frees_blocks(server, client):
    serving = server.serving
    wait_idle(serving)
    stream = client.completions.create(
        model=MODEL, prompt=TEXT[1], max_tokens=200, temperature=0, stream=True
    )
    next(iter(stream))
    (request,) = serving.engine.engine.scheduler.running
    assert serving.engine.stats().kv_cache_usage > 0
    stream.close()
    wait_idle(serving)
    assert request.status.value == "abort" and len(request.output_token_ids) < 200
    assert not serving.engine.engine.kv.block_tables and serving.engine.num_tracked_requests() == 0


def test_load_loopback(server):
    serving = server.serving
    wait_idle(serving)
    n_requests, concurrency = 200, 40
    aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    peak = [0]

    async def one(i: int, sem: asyncio.Semaphore, active: list[int]):
        prompt = TEXT[i % 3][: 20 + (i * 7) % 60]
        async with sem:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            try:
                if i % 2:
                    chunks = [
                        c
                        async for c in await aclient.completions.create(
                            model=MODEL, prompt=prompt, max_tokens=1 + i % 4, temperature=0, stream=True
                        )
                    ]
                    return chunks[-1].choices[0].finish_reason
                if i % 4 == 2:
                    r = await aclient.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=1 + i % 4
                    )
                else:
                    r = await aclient.completions.create(
                        model=MODEL, prompt=prompt, max_tokens=1 + i % 4, temperature=0
                    )
                return r.choices[0].finish_reason
            finally:
                active[0] -= 1

    async def main():
        sem, active = asyncio.Semaphore(concurrency), [0]
        results = await asyncio.gather(
            *(one(i, sem, active) for i in range(n_requests)), return_exceptions=True
        )
        await aclient.close()
        return results

    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert set(results) <= {"stop", "length"} and peak[0] >= 32
    wait_idle(serving)
    engine = serving.engine.engine
    assert serving.engine.num_step_errors == 0 and not engine.kv.block_tables and not engine.kv.reserved
    assert serving.engine.num_tracked_requests() == 0
    engine.pool.check_invariants()


def test_429_when_queue_full_or_waiting_too_long(ckpt):
    # one running request at a time, one waiting place; the running one prefills 240 tokens one per step
    config = engine_config(
        max_waiting=1,
        max_num_seqs=1,
        max_num_batched_tokens=2,
        long_prefill_token_threshold=1,
        queue_timeout_s=0.3,
    )
    app, serving = load_server(ckpt, config, model_name=MODEL)
    with BackgroundServer(app) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
        results = {}

        def call(name, **kw):
            try:
                results[name] = client.completions.create(model=MODEL, max_tokens=2, temperature=0, **kw)
            except openai.RateLimitError as e:
                results[name] = e

        def wait_for(check):
            deadline = time.monotonic() + 20
            while not check(serving.engine.stats()):
                assert time.monotonic() < deadline
                time.sleep(0.002)

        first = threading.Thread(target=call, args=("first",), kwargs={"prompt": list(range(10, 250))})
        first.start()
        wait_for(lambda s: s.num_running == 1)
        second = threading.Thread(target=call, args=("second",), kwargs={"prompt": "or not"})
        second.start()
        wait_for(lambda s: s.num_waiting == 1)
        call("third", prompt="to be")  # the queue (one place) is full: 429 at once
        e = results["third"]
        assert isinstance(e, openai.RateLimitError) and e.status_code == 429
        assert e.response.headers["Retry-After"] == "1"
        assert e.body["type"] == "rate_limit_exceeded" and e.body["code"] == "queue_full"
        second.join(30)  # it gives up after 0.3 s in the queue while the first still prefills
        assert (
            isinstance(results["second"], openai.RateLimitError)
            and results["second"].body["code"] == "queue_timeout"
        )
        first.join(60)
        assert results["first"].usage.prompt_tokens == 240 and results["first"].choices[0].finish_reason
        wait_idle(serving)
        call("fourth", prompt="or not")
        assert results["fourth"].choices[0].finish_reason in ("stop", "length")
        metrics = urllib.request.urlopen(srv.base_url + "/metrics").read().decode()
        assert "openk3:admission_rejections_total 2.0" in metrics


@pytest.mark.slow  # a subprocess or a trained tokenizer: ~1 min on a loaded 2-core machine
def test_openk3_serve_subprocess(ckpt):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import argparse, sys; from openk3.serve.cli import add_serve_parser; p = argparse.ArgumentParser(); "
        "add_serve_parser(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); sys.exit(a.func(a))"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            "serve",
            "--ckpt",
            str(ckpt),
            "--port",
            str(port),
            "--model-name",
            MODEL,
            "--pool-mib",
            "64",
            "--max-model-len",
            "512",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        r = client.completions.create(model=MODEL, prompt="To be", max_tokens=3, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length") and r.usage.prompt_tokens > 0
    finally:
        proc.terminate()
        proc.wait(30)


def test_non_streaming_client_disconnect_frees_blocks(server):
    """A plain (non-streaming) request is aborted when its client goes away, even while tokens keep coming."""
    serving = server.serving
    wait_idle(serving)
    host, port = server.base_url.split("//")[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"model": MODEL, "prompt": TEXT[1], "max_tokens": 200, "temperature": 0})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    deadline = time.monotonic() + 20
    while not serving.engine.engine.scheduler.running and time.monotonic() < deadline:
        time.sleep(0.01)
    (request,) = serving.engine.engine.scheduler.running
    conn.sock.close()  # the client goes away without reading the answer
    wait_idle(serving)
    assert request.status.value == "abort" and len(request.output_token_ids) < 200
    assert not serving.engine.engine.kv.block_tables and serving.engine.num_tracked_requests() == 0


def _post_json(server, path: str, body: dict) -> tuple[int, dict]:
    return _post(server, path, json.dumps(body).encode())


def _assert_400(status: int, data: dict, param: str, message: str) -> None:
    assert status == 400, data
    err = data["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_value", err
    assert err["param"] == param and message in err["message"], err


def test_seed_range_and_per_choice_seeds(server):
    """``seed`` is int64 (OpenAI's range) for any ``n``: choice ``k`` uses ``(seed + k) mod 2**64``, which
    ``torch.Generator.manual_seed`` accepts; beyond int64 is a 400 naming ``seed`` (it was a 500)."""
    for seed in (2**64, 2**63, -(2**63) - 1):
        status, data = _post_json(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "seed": seed})
        _assert_400(
            status, data, "seed", "seed must be an integer in [-9223372036854775808, 9223372036854775807]"
        )
    body = {"model": MODEL, "prompt": "To be", "max_tokens": 4, "temperature": 1.0}
    for seed, n in ((2**63 - 1, 3), (-(2**63), 2)):
        status, data = _post_json(server, "/v1/completions", {**body, "seed": seed, "n": n})
        assert status == 200 and len(data["choices"]) == n, data
    # choice 1 of seed -1 samples with seed (-1 + 1) mod 2**64 = 0, like choice 0 of seed 0
    _, minus_one = _post_json(server, "/v1/completions", {**body, "seed": -1, "n": 2})
    _, zero = _post_json(server, "/v1/completions", {**body, "seed": 0})
    assert minus_one["choices"][1]["text"] == zero["choices"][0]["text"]


def test_lone_surrogate_is_400_not_500(server, client):
    """``"a\\ud800b"`` is valid JSON but not encodable text: refused before the tokenizer sees it."""
    cases = [
        (
            "/v1/completions",
            {"prompt": "a\ud800b"},
            "prompt",
            "prompt contains text that is not valid Unicode",
        ),
        ("/v1/completions", {"prompt": ["ok", "\udfff"]}, "prompt", "(lone surrogate)"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x\ud800"}]},
            "messages.0.content",
            "message content contains text that is not valid Unicode (lone surrogate)",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            "messages.0.content.0.text",
            "not valid Unicode",
        ),
        ("/v1/completions", {"prompt": "hi", "stop": ["\ud800"]}, "stop", "not valid Unicode"),
    ]
    for path, body, param, message in cases:
        raw = json.dumps({"model": MODEL, **body}).encode()
        assert b"\\ud800" in raw or b"\\udfff" in raw
        status, data = _post(server, path, raw)
        _assert_400(status, data, param, message)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0).choices


def test_tokenization_does_not_block_the_event_loop(server, monkeypatch):
    """While a prompt is being tokenized (a tokenizer that blocks, as ``tokenizers`` does on a 20 MB prompt
    with the GIL released), ``/health`` answers at once."""
    started, release = threading.Event(), threading.Event()
    real = server.serving.tokenizer

    class SlowTokenizer:
        def __getattr__(self, name):
            return getattr(real, name)

        def encode(self, text, allow_special=False):
            started.set()
            release.wait(10)
            return real.encode(text, allow_special)

    monkeypatch.setattr(server.serving, "tokenizer", SlowTokenizer())
    result = {}
    body = {"model": MODEL, "prompt": "To be", "max_tokens": 2, "temperature": 0}
    worker = threading.Thread(target=lambda: result.update(r=_post_json(server, "/v1/completions", body)))
    worker.start()
    try:
        assert started.wait(10)
        t0 = time.monotonic()
        health = urllib.request.urlopen(server.base_url + "/health", timeout=3).read()
        assert json.loads(health)["status"] == "ok" and time.monotonic() - t0 < 1.0
    finally:
        release.set()
        worker.join(30)
    status, data = result["r"]
    assert status == 200 and data["usage"]["prompt_tokens"] == len(real.encode("To be"))


def test_default_model_name_is_the_given_folder(ckpt, tmp_path):
    """``--ckpt runs/k3-tiny`` serves ``k3-tiny`` (stable across resumes), not ``step-000020``."""
    import shutil

    run = tmp_path / "k3-tiny"
    shutil.copytree(ckpt, run / "checkpoints" / "step-000020")
    (run / "checkpoints" / "latest").write_text("step-000020\n")
    _, serving = load_server(run, engine_config())
    assert serving.config.model_name == "k3-tiny"
    _, serving = load_server(str(run) + "/", engine_config(), model_name="mine")
    assert serving.config.model_name == "mine"
    from openk3.serve.server import served_model_name

    assert served_model_name("runs/k3-tiny/") == "k3-tiny"
    assert served_model_name(".") == served_model_name(os.getcwd()) != ""


BAD_VALUES = [
    # (path, extra body fields, param, part of the message)
    ("/v1/completions", {"temperature": float("nan")}, "temperature", "finite number"),
    ("/v1/completions", {"temperature": float("inf")}, "temperature", "finite number"),
    ("/v1/completions", {"top_p": float("nan")}, "top_p", "finite number"),
    ("/v1/completions", {"prompt": 123}, "prompt", "prompt must be a string, a list of strings"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt", "prompt must be a string"),
    ("/v1/completions", {"stop": 5}, "stop", "valid string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, "messages.0.content", "string"),
    ("/v1/completions", {"stream": "yes"}, "stream", "valid boolean"),
    ("/v1/completions", {"stream": 1}, "stream", "valid boolean"),
    ("/v1/chat/completions", {"stream": "true"}, "stream", "valid boolean"),
    ("/v1/completions", {"echo": "no"}, "echo", "valid boolean"),
    (
        "/v1/completions",
        {"stream_options": {"include_usage": True}},
        "stream_options",
        "stream_options is only allowed when stream is true",
    ),
    (
        "/v1/completions",
        {"stream": True, "stream_options": {"include_usage": "yes"}},
        "stream_options.include_usage",
        "valid boolean",
    ),
    ("/v1/completions", {"logit_bias": {"5": 10}}, "logit_bias", "logit_bias is not supported"),
    ("/v1/chat/completions", {"logit_bias": {"5": -100}}, "logit_bias", "logit_bias is not supported"),
    ("/v1/completions", {"best_of": 3}, "best_of", "best_of is not supported"),
    ("/v1/completions", {"top_k": 1}, "top_k", "top_k is not supported"),
    ("/v1/chat/completions", {"top_k": -5}, "top_k", "top_k is not supported"),
    ("/v1/completions", {"min_p": 0.1}, "min_p", "min_p is not supported"),
    ("/v1/chat/completions", {"repetition_penalty": 1.2}, "repetition_penalty", "not supported"),
    ("/v1/completions", {"n": 2, "best_of": 1}, "best_of", "set it equal to n"),
    (
        "/v1/chat/completions",
        {"response_format": {"type": "json_object"}},
        "response_format",
        "response_format is not supported",
    ),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice", "not supported"),
    ("/v1/completions", {"max_tokens": "5"}, "max_tokens", "valid integer"),
    ("/v1/completions", {"max_tokens": True}, "max_tokens", "valid integer"),
    ("/v1/completions", {"n": "2"}, "n", "valid integer"),
    ("/v1/completions", {"seed": "3"}, "seed", "valid integer"),
    ("/v1/chat/completions", {"max_completion_tokens": 4.5}, "max_completion_tokens", "valid integer"),
    ("/v1/completions", {"prompt": [VOCAB + 5]}, "prompt", f"token id {VOCAB + 5} is outside the vocabulary"),
    ("/v1/completions", {"prompt": [[1, 2], [3, -1]]}, "prompt", "token id -1 is outside the vocabulary"),
    *(  # this server has no draft
        (path, {"num_speculative_tokens": 2}, "num_speculative_tokens", "needs a server started with --draft")
        for path in ("/v1/completions", "/v1/chat/completions")
    ),
]


@pytest.mark.parametrize("path,fields,param,message", BAD_VALUES)
def test_bad_values_name_their_field(server, path, fields, param, message):
    base = {"model": MODEL}
    base.update(
        {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    )
    raw = json.dumps({**base, **fields}).encode()  # NaN / Infinity as Python's json writes them
    status, data = _post(server, path, raw)
    _assert_400(status, data, param, message)


def test_no_op_values_of_unsupported_fields_are_accepted(client):
    r = client.completions.create(
        model=MODEL,
        prompt="hi",
        max_tokens=2,
        temperature=0,
        logit_bias={},
        best_of=2,
        n=2,
        extra_body={"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0},
    )
    assert len(r.choices) == 2
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        response_format={"type": "text"},
        logit_bias={},
        stream=False,
    )
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_model_is_404_model_not_found_naming_the_served_model(server, path):
    """OpenAI's answer to a model it does not serve: 404 and ``code: "model_not_found"``."""
    body = {"model": "gpt-nope", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    status, data = _post_json(server, path, body)
    assert status == 404, data
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "'gpt-nope'" in err["message"] and repr(MODEL) in err["message"]


def test_null_content_names_the_field(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": None}]}
    status, data = _post_json(server, "/v1/chat/completions", body)
    assert status == 400 and data["error"]["code"] == "invalid_value", data
    assert data["error"]["message"].startswith("messages.0.content: content must be a string or a list"), data


def test_cli_port_is_validated(capsys):
    import argparse

    from openk3.serve.cli import add_serve_parser

    parser = argparse.ArgumentParser(prog="openk3")
    add_serve_parser(parser.add_subparsers())
    for port in ("99999", "-1", "http"):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["serve", "--ckpt", "x", "--port", port])
        assert e.value.code == 2 and "invalid port" in capsys.readouterr().err
    assert parser.parse_args(["serve", "--ckpt", "x", "--port", "0"]).port == 0
    assert parser.parse_args(["serve", "--ckpt", "x", "--port", "65535"]).port == 65535


def test_cli_refuses_speculative_tokens_without_a_draft(tmp_path, capsys):
    """As ``openk3 generate`` does, and as a request's ``num_speculative_tokens`` is refused: not ignored."""
    from openk3.cli import main

    assert main(["serve", "--ckpt", str(tmp_path / "no-ckpt"), "--speculative-tokens", "3"]) == 2
    assert capsys.readouterr().err == (
        "openk3: error: --speculative-tokens needs --draft (the draft folder that proposes the tokens)\n"
    )


def test_a_body_over_the_limit_is_413_and_the_server_keeps_serving(server):
    """A body over ``max_request_bytes`` (1 MiB + 64 bytes a token of the 256-token context here) is refused
    with 413 before it is read: from its Content-Length (a 60 MB prompt, which took ~50 s of tokenizing and
    6.8 GB before the limit), or for a chunked body at the chunk that passes the limit; a normal request
    right after is served."""
    from openk3.serve.openai_serving import request_bytes_limit

    limit = server.serving.config.max_request_bytes
    assert limit == request_bytes_limit(MAX_MODEL_LEN, vision=False) == (1 << 20) + 64 * MAX_MODEL_LEN
    t0 = time.monotonic()
    status, data = _post(server, "/v1/completions", b'{"prompt": "' + b"a" * 60_000_000 + b'"}')
    assert status == 413 and data["error"]["code"] == "request_too_large", data
    assert "60,000,014 bytes" in data["error"]["message"] and time.monotonic() - t0 < 5.0

    def chunks():
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        yield from (b"a" * 100_000 for _ in range(20))
        yield b'"}'

    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=chunks(), encode_chunked=True)
    resp = conn.getresponse()
    assert resp.status == 413 and f"over {limit:,} bytes" in json.loads(resp.read())["error"]["message"]
    conn.close()
    status, data = _post_json(server, "/v1/completions", {"model": MODEL, "prompt": "To be", "max_tokens": 2})
    assert status == 200 and data["usage"]["completion_tokens"] == 2


def test_a_body_that_arrives_too_slowly_is_408():
    """``read_body``: a body still arriving after its deadline is refused with 408 ``request_timeout``
    (naming the bytes that came), so a client trickling a few bytes a minute cannot hold its connection for
    ever; one that arrives in time is read whole."""
    from openk3.serve.protocol import APIError, read_body

    class Trickle:  # a Starlette request whose body comes in pieces, ``pause`` seconds apart
        def __init__(self, pause: float):
            self.pause, self.headers = pause, {}

        async def stream(self):
            for piece in (b'{"prompt": ', b'"slow"', b"}"):
                await asyncio.sleep(self.pause)
                yield piece

    assert asyncio.run(read_body(Trickle(0.01), 1 << 20, timeout_s=5.0)) == b'{"prompt": "slow"}'
    with pytest.raises(APIError) as e:
        asyncio.run(read_body(Trickle(0.3), 1 << 20, timeout_s=0.5))
    assert e.value.status == 408 and e.value.code == "request_timeout"
    assert "within 0.5 s (11 bytes came)" in e.value.message  # the first piece only


def test_a_text_that_cannot_fit_the_context_is_refused_without_tokenizing(server, monkeypatch):
    """Within the body limit, a prompt whose bytes alone need ``max_model_len`` tokens or more (at most
    ``Tokenizer.max_token_bytes`` bytes a token) is a 400 ``context_length_exceeded`` before the tokenizer
    runs; one byte less is tokenized (and then refused by its real token count, or served)."""
    per_token = server.serving.tokenizer.max_token_bytes
    edge = per_token * (MAX_MODEL_LEN - 1)
    calls = []
    real = server.serving.tokenizer

    class CountingTokenizer:
        def __getattr__(self, name):
            return getattr(real, name)

        def encode(self, text, allow_special=False):
            calls.append(len(text))
            return real.encode(text, allow_special)

    monkeypatch.setattr(server.serving, "tokenizer", CountingTokenizer())
    for body, param in (
        ({"prompt": ["hi", "a" * (edge + 1)]}, "prompt"),
        ({"messages": [{"role": "user", "content": "é" * (edge // 2 + 1)}]}, "messages"),
    ):
        path = "/v1/completions" if param == "prompt" else "/v1/chat/completions"
        status, data = _post_json(server, path, {"model": MODEL, "max_tokens": 1, **body})
        err = data["error"]
        assert status == 400 and err["code"] == "context_length_exceeded" and err["param"] == param, data
        assert f"{MAX_MODEL_LEN} tokens" in err["message"]
    assert calls == []
    status, data = _post_json(
        server, "/v1/completions", {"model": MODEL, "prompt": "a" * edge, "max_tokens": 1}
    )
    assert calls == [edge] and status == 400 and data["error"]["code"] == "context_length_exceeded"


def test_a_client_leaving_during_its_body_logs_no_error(server, caplog):
    """A client that declares 100,000 bytes, sends 1,000 and closes: no "unhandled error" traceback (it was
    one per such client), and the server answers the next request."""
    with caplog.at_level(logging.ERROR):
        with socket.create_connection((server.host, server.port)) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100000\r\n\r\n" + b'{"prompt": "' + b"a" * 988
            )
        status, _ = _post_json(
            server, "/v1/completions", {"model": MODEL, "prompt": "To be", "max_tokens": 2}
        )
        time.sleep(0.2)
    assert status == 200 and not [r for r in caplog.records if r.levelno >= logging.ERROR]


MSGS = [{"role": "user", "content": "hi"}]


def test_more_choices_than_the_queue_holds_is_400_not_429(server):
    """Prompts × ``n`` over the scheduler's ``max_waiting`` (256 here) can never be queued at once: a 400
    naming the limit (a 429 told the client to retry it), before tokenizing, also for 200,000 prompts."""
    limit = server.serving.config.max_choices
    assert limit == 256
    for prompt, n in ((["To be"] * 129, 2), ([[1]] * 200_000, 1)):
        t0 = time.monotonic()
        status, data = _post_json(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "n": n})
        err = data["error"]
        assert status == 400 and err["param"] == "prompt" and f"at most {limit}" in err["message"], data
        assert time.monotonic() - t0 < 5.0
    status, data = _post_json(server, "/v1/completions", {"model": MODEL, "prompt": ["To be"] * 128, "n": 2})
    assert status == 200 and len(data["choices"]) == 256
    # an n over its own limit is told that limit, not the queue's (which read as if n up to 256 would do)
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": MSGS})):
        status, data = _post_json(server, path, {"model": MODEL, **body, "n": 100_000})
        max_n = server.serving.config.max_n
        assert status == 400 and data["error"]["message"] == f"n must be at most {max_n}, got 100000", data


def test_max_request_mib_flag():
    """``--max-request-mib`` sets the body limit of ``serve`` (default: derived, None) and ``route``; a size
    that is not a positive number is a usage error."""
    import argparse

    from openk3.serve.cli import add_route_parser, add_serve_parser

    parser = argparse.ArgumentParser(prog="openk3")
    sub = parser.add_subparsers()
    add_serve_parser(sub)
    add_route_parser(sub)
    assert parser.parse_args(["serve", "--ckpt", "x"]).max_request_mib is None
    assert parser.parse_args(["serve", "--ckpt", "x", "--max-request-mib", "0.5"]).max_request_mib == 0.5
    assert parser.parse_args(["route", "--workers", "http://a:1"]).max_request_mib == 64.0
    for bad in ("0", "-1", "nan", "big", "1e-9", "1e300"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--ckpt", "x", "--max-request-mib", bad])


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--cache-threshold", "2", "--cache-threshold must be in [0, 1], got 2.0"),
        ("--max-inflight", "0", "--max-inflight must be >= 1, got 0"),
        ("--health-interval", "0", "--health-interval must be a positive number of seconds, got 0.0"),
        ("--quarantine", "-1", "--quarantine must be >= 0 seconds, got -1.0"),
        ("--chunk-chars", "0", "--chunk-chars must be >= 1, got 0"),
    ],
)
def test_route_config_errors_name_the_flag(flag, value, message):
    """A value ``RouterConfig`` refuses is reported under the flag the user typed, not the field's name."""
    import argparse

    from openk3.serve.cli import add_route_parser, router_config

    parser = argparse.ArgumentParser(prog="openk3")
    add_route_parser(parser.add_subparsers())
    args = parser.parse_args(["route", "--workers", "http://a:1", flag, value])
    with pytest.raises(ValueError) as e:
        router_config(args)
    assert str(e.value) == message


def test_serving_doc_states_the_default_max_model_len():
    """``docs/serving.md`` gives ``--max-model-len``'s default, the one the flag and the config have."""
    import argparse
    from pathlib import Path

    from openk3.serve.cli import add_serve_parser
    from openk3.serve.config import SchedulerConfig

    default = SchedulerConfig().max_model_len
    parser = argparse.ArgumentParser(prog="openk3")
    add_serve_parser(parser.add_subparsers())
    assert parser.parse_args(["serve", "--ckpt", "x"]).max_model_len == default
    doc = " ".join((Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text().split())
    assert f"at most `--max-model-len` tokens (default {default:,}" in doc


def test_shutdown_ends_open_streams_at_once(ckpt, monkeypatch):
    """Exiting the server (Ctrl-C) aborts in-flight requests instead of waiting for their ``max_tokens``:
    with a 0.05 s engine step a 200-token stream would last 10 s, the exit takes well under 3 s."""
    app, serving = load_server(ckpt, engine_config(), model_name=MODEL)
    runner = serving.engine.engine.runner
    execute = runner.execute

    def slow_execute(scheduled):
        time.sleep(0.05)
        return execute(scheduled)

    monkeypatch.setattr(runner, "execute", slow_execute)
    with BackgroundServer(app) as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=30)
        stream = client.completions.create(
            model=MODEL, prompt="To be", max_tokens=200, temperature=0, stream=True
        )
        chunks = []
        reader = threading.Thread(target=lambda: chunks.extend(stream))
        reader.start()
        deadline = time.monotonic() + 20
        while not serving.engine.engine.scheduler.running and time.monotonic() < deadline:
            time.sleep(0.01)
        (request,) = serving.engine.engine.scheduler.running
        t0 = time.monotonic()
        srv.__exit__(None, None, None)  # what Ctrl-C does; the `with` exit is then a no-op
        reader.join(10)
        assert time.monotonic() - t0 < 2.5 and not srv.thread.is_alive() and not reader.is_alive()
        assert request.status.value == "abort" and len(request.output_token_ids) < 100
    assert chunks and chunks[-1].choices[0].finish_reason == "abort"


def test_a_busy_port_is_one_line_before_loading(ckpt, capsys):
    """``openk3 serve`` on a port another socket listens on: one ``openk3: error`` line, exit 2, and the
    model is not loaded first."""
    import socket

    from openk3.cli import main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--ckpt", str(ckpt), "--port", str(port)]) == 2
    captured = capsys.readouterr()
    assert f"cannot listen on 127.0.0.1:{port}" in captured.err
    assert "openk3 serve: model" not in captured.out


def _reference_logprobs(ckpt, prompt_ids: list[int], n: int, vocab: int):
    """Greedy ids and the log-probabilities (float64 log_softmax of the fp32 logits of one whole-sequence
    forward, over the tokenizer's ids) at each generated position."""
    model = openk3.from_pretrained(ckpt).eval()
    out = openk3.generate.greedy(model, torch.tensor([prompt_ids]), n)[0].tolist()
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + out])).logits[0, len(prompt_ids) - 1 : -1, :vocab]
    return out, torch.log_softmax(logits.double(), dim=-1)


def test_completion_logprobs_match_the_model_streamed_or_not(ckpt, client, reference):
    tok = reference.tokenizer
    ids = tok.encode(PROMPT)
    out, logp = _reference_logprobs(ckpt, ids, 6, tok.vocab_size)
    cut = next((i for i, t in enumerate(out) if t == tok.eos_id), len(out))
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.tokens == [tok.decode([t]) for t in out[:cut]]
    assert lp.token_logprobs == pytest.approx([logp[i, t].item() for i, t in enumerate(out[:cut])], abs=1e-4)
    for i, top in enumerate(lp.top_logprobs):
        values, best = logp[i].topk(3)
        want = {tok.decode([t]): v for t, v in zip(best.tolist(), values.tolist())}
        assert top.keys() >= want.keys() and len(top) <= 4  # the 3 most likely (and the sampled one)
        assert [top[k] for k in want] == pytest.approx(list(want.values()), abs=1e-4)
        assert top[lp.tokens[i]] == pytest.approx(lp.token_logprobs[i])  # greedy: the sampled one is the best
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert "".join(lp.tokens) == r.choices[0].text
    chunks = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3, stream=True
    )
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [v for s in streamed for v in s.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-6)
    # logprobs=0: the sampled token's only; without logprobs: null
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=0)
    assert [list(t) for t in r.choices[0].logprobs.top_logprobs] == [[t] for t in lp.tokens[:2]]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.choices[0].logprobs is None


def test_chat_logprobs_and_top_logprobs_match_the_model(ckpt, server, client, reference):
    tok = reference.tokenizer
    messages = [{"role": "user", "content": TEXT[0]}]
    ids = server.serving.chat_template.encode(messages)
    out, logp = _reference_logprobs(ckpt, ids, 5, tok.vocab_size)
    stops = set(server.serving.chat_template.stop_token_ids)
    cut = next((i for i, t in enumerate(out) if t in stops), len(out))
    kwargs = dict(model=MODEL, messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert [c.token for c in content] == [tok.decode([t]) for t in out[:cut]]
    assert [c.logprob for c in content] == pytest.approx(
        [logp[i, t].item() for i, t in enumerate(out[:cut])], abs=1e-4
    )
    for i, c in enumerate(content):
        values, best = logp[i].topk(2)
        assert [e.token for e in c.top_logprobs] == [tok.decode([t]) for t in best.tolist()]
        assert [e.logprob for e in c.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
        assert c.bytes == list(c.token.encode("utf-8"))
    streamed = [
        e for chunk in client.chat.completions.create(**kwargs, stream=True) for ch in chunk.choices
        if ch.logprobs for e in ch.logprobs.content
    ]  # fmt: skip
    assert [e.token for e in streamed] == [c.token for c in content]
    assert [e.logprob for e in streamed] == pytest.approx([c.logprob for c in content], abs=1e-6)


@pytest.mark.parametrize(
    "path,fields,message",
    [
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "less than or equal to 20"),
        ("/v1/completions", {"logprobs": 21}, "less than or equal to 20"),
        ("/v1/completions", {"logprobs": -1}, "greater than or equal to 0"),
    ],
)
def test_bad_logprobs_are_400(server, path, fields, message):
    base = {"model": MODEL}
    base.update(
        {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    )
    status, data = _post(server, path, json.dumps({**base, **fields}).encode())
    assert status == 400 and message in data["error"]["message"], data


def test_loop_mailbox_wakes_the_loop_once_per_burst_and_keeps_order():
    """64 outputs posted from the engine thread while the loop is busy reach their queues in order after one
    wake-up (``call_soon_threadsafe``), not 64; a post after the delivery schedules a new one."""
    loop = asyncio.new_event_loop()
    wakeups = []
    real = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda *a: wakeups.append(a) or real(*a)
    try:
        queues = [asyncio.Queue(), asyncio.Queue()]
        mailbox = LoopMailbox(loop)
        poster = threading.Thread(target=lambda: [mailbox.post(queues[i % 2], i) for i in range(64)])
        poster.start()
        poster.join()
        assert len(wakeups) == 1
        loop.run_until_complete(asyncio.sleep(0))
        got = [[q.get_nowait() for _ in range(q.qsize())] for q in queues]
        assert got == [list(range(0, 64, 2)), list(range(1, 64, 2))]
        mailbox.post(queues[0], "later")
        loop.run_until_complete(asyncio.sleep(0))
        assert len(wakeups) == 2 and queues[0].get_nowait() == "later"
    finally:
        loop.close()
    with pytest.raises(RuntimeError):
        mailbox.post(queues[0], "closed")


def test_a_null_max_tokens_is_the_completion_default():
    """``"max_tokens": null`` in a completion means OpenAI's 16, not the rest of the context (a trial's
    request ran to 8,191 tokens); absent is 16 too; a chat request's stays unbounded by default."""
    from openk3.serve.protocol import ChatCompletionRequest, CompletionRequest

    for body in ({"model": "m", "prompt": "a", "max_tokens": None}, {"model": "m", "prompt": "a"}):
        assert CompletionRequest.model_validate(body).max_tokens == 16
    assert CompletionRequest.model_validate({"model": "m", "prompt": "a", "max_tokens": 3}).max_tokens == 3
    chat = {"model": "m", "messages": [{"role": "user", "content": "a"}], "max_tokens": None}
    assert ChatCompletionRequest.model_validate(chat).max_tokens is None


def test_an_image_to_a_text_model_is_refused_with_a_code(server):
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]
    status, data = _post_json(server, "/v1/chat/completions", {"model": MODEL, "messages": messages})
    assert status == 400 and data["error"]["code"] == "images_not_supported", data
    assert "no vision tower" in data["error"]["message"] and data["error"]["param"] == "messages"
