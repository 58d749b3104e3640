"""The HTTP server driven by the real ``openai`` SDK on 127.0.0.1: completions, chat, SSE streaming, usage
with cached tokens, stop strings, bad input (400), client disconnects, a bounded load test, 429 when the
queue is full, metrics, and ``openk3 serve`` as a subprocess. Greedy texts are checked against
:func:`openk3.generate.greedy` on the same checkpoint."""

from __future__ import annotations

import asyncio
import http.client
import json
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


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from a second intra-op thread, and on a shared machine OpenMP spinning
    can slow these tests tenfold; the previous setting is restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
    assert json.loads(urllib.request.urlopen(server.base_url + "/health").read()) == {"status": "ok"}
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
    ("/v1/completions", json.dumps({"prompt": "hi"}).encode(), "model"),
    ("/v1/completions", json.dumps({"model": MODEL}).encode(), "prompt"),
    ("/v1/completions", json.dumps({"model": "gpt-nope", "prompt": "hi"}).encode(), "model"),
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
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": [VOCAB + 5]}).encode(), "prompt"),
    (
        "/v1/completions",
        json.dumps({"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}).encode(),
        "stop",
    ),
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode(), "messages"),
    (
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": [{"role": "user"}], "n": 9}).encode(),
        "n",
    ),
    (
        "/v1/chat/completions",
        json.dumps({"model": MODEL, "messages": [{"content": "x"}]}).encode(),
        "messages.0.role",
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
