"""The router in front of a fleet of real ``openk3 serve`` processes on 127.0.0.1 (a 4-layer K3-shaped
model with random weights, 16-token blocks): a session stays on one worker and its next turn's
``cached_tokens`` come back through the router as the block arithmetic says; streams pass through; a
worker killed while requests run costs the clients nothing (they are retried elsewhere) and is brought
back by the health probe once it is up again; a new worker takes only its consistent-hash share; a client
that disconnects through the router has its worker request aborted and its blocks freed; ``openk3 route``
runs as a command."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import re
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

import openk3
from openk3.data import Tokenizer
from openk3.serve.router import RouterConfig, build_router_app
from openk3.serve.router.local_fleet import free_port, start_workers
from openk3.serve.server import BackgroundServer

VOCAB = 384
MODEL = "k3-fleet"
TEXT = ["ROMEO. But soft, what light through yonder window breaks? It is the east, and Juliet is the sun.\n"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fleet")
    openk3.save_pretrained(openk3.build_model(openk3.presets.k3_shaped(4, vocab_size=VOCAB), seed=0), folder)
    Tokenizer.train(TEXT * 30, vocab_size=VOCAB).save(folder)
    return folder


SERVE_ARGS = ["--model-name", MODEL, "--pool-mib", "16", "--max-model-len", "512", "--block-size", "16"]


@pytest.fixture(scope="module")
def fleet(ckpt):
    workers = start_workers(ckpt, 3, SERVE_ARGS)
    try:
        yield workers
    finally:
        for w in workers:
            w.stop()


def router(workers, **kw) -> BackgroundServer:
    config = RouterConfig(workers=tuple(w.url for w in workers), health_interval_s=0.3, **kw)
    return BackgroundServer(build_router_app(config))


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(4, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def complete(base: str, prompt, session=None, **kw) -> httpx.Response:
    headers = {"X-Session-ID": session} if session else {}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, **kw}
    return httpx.post(base + "/v1/completions", json=body, headers=headers, timeout=120)


def test_a_session_stays_on_its_worker_and_its_cached_tokens_come_through(fleet):
    with router(fleet) as r:
        for s in range(4):
            turn1 = ids(48, seed=s)  # three full 16-token blocks, the prompt ends on a boundary
            a = complete(r.base_url, turn1, session=f"s{s}")
            b = complete(r.base_url, turn1 + ids(10, seed=100 + s), session=f"s{s}")
            assert a.status_code == b.status_code == 200
            assert a.headers["x-openk3-route"] == "primary" and b.headers["x-openk3-route"] == "session"
            assert a.headers["x-openk3-worker"] == b.headers["x-openk3-worker"]
            assert a.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert b.json()["usage"]["prompt_tokens"] == 58
            assert b.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        # no session id: the longest prefix held decides (the turn-1 prompt of session 0 is 3 blocks of 16)
        c = complete(r.base_url, ids(48, seed=0) + ids(20, seed=7))
        assert c.headers["x-openk3-route"] == "prefix"
        assert c.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        metrics = httpx.get(r.base_url + "/metrics").text
        assert re.search(r'openk3:router_requests_total\{route="session",worker="[^"]+"\} [1-4]\.0', metrics)


def test_streams_pass_through_with_usage(fleet):
    with router(fleet) as r:
        listed = httpx.get(r.base_url + "/v1/models").json()["data"]
        assert httpx.get(r.base_url + f"/v1/models/{MODEL}").json() == listed[0] and listed[0]["id"] == MODEL
        missing = httpx.get(r.base_url + "/v1/models/no%2Fsuch")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        prompt = ids(40, seed=11)
        plain = complete(r.base_url, prompt, max_tokens=6).json()
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": True}
        body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", r.base_url + "/v1/completions", json=body, timeout=60) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == plain["choices"][0]["text"]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 40
        assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # the plain run's blocks


def test_a_new_worker_takes_only_its_hash_share(fleet):
    sessions = [f"share-{i}" for i in range(36)]
    owners = []
    for members in (fleet[:2], fleet):
        with router(members) as r:
            owners.append(
                [
                    complete(r.base_url, [5, 6, 7], session=s, max_tokens=1).headers["x-openk3-worker"]
                    for s in sessions
                ]
            )
    moved = [i for i in range(len(sessions)) if owners[0][i] != owners[1][i]]
    assert all(owners[1][i] == fleet[2].url for i in moved)
    assert 4 <= len(moved) <= 20  # a third expected (12 of 36)


def test_a_worker_killed_mid_run_costs_no_client_error_and_comes_back(fleet, ckpt):
    with router(fleet) as r:
        victim = complete(r.base_url, ids(20, seed=3), session="doomed").headers["x-openk3-worker"]
        worker = next(w for w in fleet if w.url == victim)

        def call(i):
            return complete(r.base_url, ids(30, seed=200 + i), session=f"k{i % 6}", max_tokens=24)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(call, i) for i in range(16)]
            time.sleep(0.3)
            worker.kill()
            answers = [f.result() for f in futures]
        assert [a.status_code for a in answers] == [200] * 16
        after = complete(r.base_url, ids(20, seed=3), session="doomed")
        assert after.status_code == 200 and after.headers["x-openk3-worker"] != victim
        assert after.headers["x-openk3-route"] == "secondary"
        up = {w["url"]: w["up"] for w in httpx.get(r.base_url + "/workers").json()["workers"]}
        assert up[victim] is False
        worker.start().wait_ready()
        deadline = time.monotonic() + 10
        while not {w["url"]: w["up"] for w in httpx.get(r.base_url + "/workers").json()["workers"]}[victim]:
            assert time.monotonic() < deadline, "the health probe did not bring the worker back"
            time.sleep(0.1)
        back = complete(r.base_url, ids(20, seed=4), session="doomed-2")
        assert back.status_code == 200


def test_a_client_disconnect_through_the_router_frees_the_worker_request(fleet):
    with router(fleet) as r:
        host, port = r.base_url.removeprefix("http://").split(":")
        for seed in range(9, 40):  # a prompt whose greedy continuation does not stop early (random weights)
            start = time.monotonic()
            full = complete(r.base_url, ids(30, seed), max_tokens=480).json()  # up to --max-model-len
            if full["choices"][0]["finish_reason"] == "length":
                break
        full_s = time.monotonic() - start
        for stream in (True, False):
            body = {"model": MODEL, "prompt": ids(30, seed=seed), "max_tokens": 480, "temperature": 0}
            body["stream"] = stream
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            if stream:
                resp = conn.getresponse()
                worker = next(w for w in fleet if w.url == resp.getheader("x-openk3-worker"))
                resp.fp.readline()
            else:  # wait for the request to reach a worker (a fixed sleep raced a fast decode)
                deadline = time.monotonic() + 10
                while not any(w.metric("openk3:num_requests_running") for w in fleet):
                    assert time.monotonic() < deadline, "the request never reached a worker"
                    time.sleep(0.02)
                worker = max(fleet, key=lambda w: w.metric("openk3:num_requests_running"))
            assert worker.metric("openk3:num_requests_running") == 1.0
            conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
            deadline = time.monotonic() + max(1.5, full_s / 2)  # well before the request would end by itself
            while worker.metric("openk3:num_requests_running") or worker.metric("openk3:kv_cache_usage_perc"):
                assert time.monotonic() < deadline, "the worker request was not aborted"
                time.sleep(0.1)
        # the router counts a disconnect when its handler unwinds, which can finish after the worker's abort
        deadline = time.monotonic() + 10
        while "openk3:router_client_disconnects_total 2.0" not in httpx.get(r.base_url + "/metrics").text:
            assert time.monotonic() < deadline, "the router did not count both client disconnects"
            time.sleep(0.1)


def test_openk3_route_command(fleet):
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "openk3",
            "route",
            "--workers",
            ",".join(w.url for w in fleet),
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout.readline().startswith(f"openk3 route: http://127.0.0.1:{port}/v1 → 3 workers")
        deadline = time.monotonic() + 30
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json()
                if health.get("workers_up") == 3:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).json()
        assert models["data"][0]["id"] == MODEL
    finally:
        proc.terminate()
        proc.wait(30)
