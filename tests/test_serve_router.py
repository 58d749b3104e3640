"""The router's parts without processes: consistent hashing (a new worker takes only its share), the
routing decision (session, prefix, primary/secondary, fallback), prompt blocks, the config's errors, and
the router app against fake workers (all down: 503 + Retry-After; a worker answering garbage is taken out
and the request served by another; streams passed through byte for byte). The fleet of real
``openk3 serve`` processes is ``tests/test_serve_fleet.py``."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time

import httpx
import pytest

from openk3.serve.router import HashRing, RouterConfig, RoutingPolicy
from openk3.serve.router.app import Router, build_router_app
from openk3.serve.router.prefix_index import prompt_blocks
from openk3.serve.server import BackgroundServer

W = ("http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003")


def test_a_new_worker_takes_only_its_share_and_a_removed_one_gives_only_its_own():
    keys = [f"session-{i}".encode() for i in range(4000)]
    three, four = HashRing(W), HashRing(W + ("http://127.0.0.1:9004",))
    before = {k: three.preference(k)[0] for k in keys}
    after = {k: four.preference(k)[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "http://127.0.0.1:9004" for k in moved)
    assert 0.17 < len(moved) / len(keys) < 0.33  # 1/4 expected, 64 points per worker
    assert HashRing(reversed(W)).preference(keys[0]) == three.preference(keys[0])  # the set decides
    two = HashRing(W)
    two.remove(W[0])
    for k in keys:
        owner = two.preference(k)[0]
        assert owner == (three.preference(k)[1] if before[k] == W[0] else before[k])


def policy(**kw) -> RoutingPolicy:
    p = RoutingPolicy(RouterConfig(workers=W, **kw))
    for w in p.workers.values():
        w.healthy = True
    return p


def test_routing_decisions():
    p = policy(max_inflight=2, cache_threshold=0.5, chunk_tokens=4)
    blocks = prompt_blocks({"prompt": list(range(40))}, p.config)  # 10 blocks of 4 ids
    d = p.choose(None, blocks)
    assert d.route == "primary" and d.worker.url == p.ring.preference(b"".join(blocks[:4]))[0]
    p.record_success(d, "s1")
    holder = d.worker
    longer = prompt_blocks({"prompt": list(range(60))}, p.config)  # 10 of its 15 blocks held: 0.67
    d2 = p.choose(None, longer)
    assert (d2.route, d2.worker, d2.matched_blocks) == ("prefix", holder, 10)
    other = prompt_blocks({"prompt": list(range(100, 160))}, p.config)
    assert p.choose("s1", other).route == "session" and p.choose("s1", other).worker is holder
    holder.inflight = 2  # saturated: the session and the prefix spill along the ring
    d3 = p.choose("s1", other)
    assert d3.route in ("primary", "secondary") and d3.worker is not holder
    assert p.choose(None, longer).worker is not holder
    for w in p.workers.values():
        w.inflight = 2
    p.workers[W[1]].inflight = 3
    d4 = p.choose(None, longer)
    assert d4.route == "fallback" and d4.worker.inflight == 2
    assert p.choose(None, longer, exclude=set(W)) is None
    for w in p.workers.values():
        w.healthy = False
    assert p.choose("s1", longer) is None


def test_secondary_is_the_same_for_every_request_of_a_key():
    p = policy()
    first, second = p.ring.preference(b"session\x00abc")[:2]
    p.workers[first].healthy = False
    for _ in range(3):
        d = p.choose("abc", [])
        assert (d.route, d.worker.url) == ("secondary", second)


def test_prompt_blocks_share_prefixes():
    c = RouterConfig(workers=W, chunk_chars=8, chunk_tokens=4)
    a = prompt_blocks({"prompt": "x" * 20}, c)
    b = prompt_blocks({"prompt": "x" * 20 + "y" * 7}, c)
    assert len(a) == 2 and b[:2] == a and len(b) == 3
    assert prompt_blocks({"prompt": ["x" * 16, "z"]}, c) == a
    chat = [{"role": "system", "content": "be brief " * 3}, {"role": "user", "content": "hello there"}]
    more = chat + [{"role": "assistant", "content": [{"type": "text", "text": "hi"}]}]
    one, two = prompt_blocks({"messages": chat}, c), prompt_blocks({"messages": more}, c)
    assert one and two[: len(one)] == one
    assert prompt_blocks({"prompt": [1, 2, 3, 4, 5]}, c) != prompt_blocks({"prompt": [1, 2, 3, 5]}, c)
    assert prompt_blocks({"prompt": [True, 2, 3, 4]}, c) == [] and prompt_blocks({"prompt": 3}, c) == []
    for text in (7, None, {"a": 1}, ["a"]):  # malformed parts count as empty: the worker answers the 400
        bad = [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "text", "text": "ok"}]}]
        assert prompt_blocks({"messages": bad}, c) == prompt_blocks(
            {"messages": [{"role": "user", "content": "ok"}]}, c
        )


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"workers": ()}, "workers is empty"),
        ({"workers": "http://a:1"}, "not one string"),
        ({"workers": ("http://a:1", "http://a:1/")}, "twice"),
        ({"workers": ("ftp://a:1",)}, "http://host:port"),
        ({"workers": ("http://a",)}, "explicit port"),
        ({"workers": ("http://a:1/v1",)}, "server root"),
        ({"workers": W, "cache_threshold": 1.5}, "cache_threshold"),
        ({"workers": W, "max_inflight": 0}, "max_inflight"),
        ({"workers": W, "health_interval_s": float("nan")}, "health_interval_s"),
    ],
)
def test_config_errors_name_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(**kw)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_all_workers_down_is_503_with_retry_after():
    config = RouterConfig(workers=(f"http://127.0.0.1:{closed_port()}",), health_interval_s=2.5)
    with BackgroundServer(build_router_app(config)) as srv:
        r = httpx.post(srv.base_url + "/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "3"
        assert r.json()["error"]["code"] == "no_worker_available"
        assert httpx.get(srv.base_url + "/health").status_code == 503
        assert "openk3:router_unavailable_total 1.0" in httpx.get(srv.base_url + "/metrics").text
        for raw in (b"{nope", b"[1, 2]"):  # answered by the router, with the server's code
            bad = httpx.post(srv.base_url + "/v1/completions", content=raw, timeout=10)
            err = bad.json()["error"]
            assert bad.status_code == 400 and "JSON" in err["message"] and err["code"] == "invalid_json", err


def test_a_body_over_the_limit_is_413_before_the_router_reads_it():
    """``max_request_bytes``: 413 ``request_too_large`` from the Content-Length (or, streamed, at the chunk
    that passes the limit), never forwarded: the only worker here is down, so reading it on would be 503."""
    config = RouterConfig(workers=(f"http://127.0.0.1:{closed_port()}",), max_request_bytes=1000)
    with BackgroundServer(build_router_app(config)) as srv:
        url = srv.base_url + "/v1/completions"
        for content in (b"x" * 1001, iter([b"x" * 600, b"x" * 600])):
            r = httpx.post(url, content=content, timeout=10)
            err = r.json()["error"]
            assert (
                r.status_code == 413
                and err["code"] == "request_too_large"
                and "1,000 bytes" in err["message"]
            )
        assert (
            httpx.post(url, content=b"{}" + b" " * 998, timeout=10).status_code == 503
        )  # at the limit: read


COMPLETION = {
    "id": "cmpl-1",
    "object": "text_completion",
    "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
    "usage": {
        "prompt_tokens": 10,
        "completion_tokens": 1,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 8},
    },
}
STREAM = (
    b'data: {"object": "text_completion", "choices": [{"index": 0, "text": "o"}]}\n\n'
    b'data: {"object": "text_completion", "choices": [], "usage": {"prompt_tokens": 10, '
    b'"completion_tokens": 1, "total_tokens": 11, "prompt_tokens_details": {"cached_tokens": 8}}}\n\n'
    b"data: [DONE]\n\n"
)


def fake_transport(garbage: set[str]):
    """Workers on 127.0.0.1:9001..9003; those in ``garbage`` answer 200 with nonsense to completions."""

    async def chunks(data: bytes):
        for i in range(0, len(data), 50):  # a stream arrives in pieces that cut events
            yield data[i : i + 50]

    async def handle(request: httpx.Request) -> httpx.Response:
        root = f"http://{request.url.host}:{request.url.port}"
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if root in garbage:
            return httpx.Response(200, content=chunks(b"<html>surprise</html>\n\n"))
        if json.loads(request.content).get("stream"):
            return httpx.Response(200, content=chunks(STREAM), headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=COMPLETION)

    return httpx.MockTransport(handle)


@pytest.mark.parametrize("stream", [False, True])
def test_a_worker_answering_garbage_is_taken_out_and_the_request_served_elsewhere(stream):
    config = RouterConfig(workers=W, quarantine_s=60, health_interval_s=0.1)
    body = {"model": "m", "prompt": "hello", "user": "sess", "stream": stream}
    bad = RoutingPolicy(config).ring.preference(b"session\x00sess")[0]
    with BackgroundServer(build_router_app(config, fake_transport({bad}))) as srv:
        r = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=10)
        assert r.status_code == 200 and r.headers["x-openk3-worker"] != bad
        if stream:
            assert r.content == STREAM and r.headers["content-type"].startswith("text/event-stream")
        else:
            assert r.json() == COMPLETION
        workers = {w["url"]: w for w in httpx.get(srv.base_url + "/workers").json()["workers"]}
        assert not workers[bad]["up"] and workers[bad]["quarantined_s"] > 50
        assert sum(w["up"] for w in workers.values()) == 2
        # its health probes answer ok meanwhile (clearing last_error); the quarantine and its reason stay
        deadline = time.monotonic() + 10
        while (w := httpx.get(srv.base_url + "/workers").json()["workers"])[W.index(bad)]["last_error"]:
            assert time.monotonic() < deadline, w
            time.sleep(0.05)
        reason = w[W.index(bad)]["quarantine_reason"]
        assert not w[W.index(bad)]["up"] and ("streamed " if stream else "answered 200 ") in reason, reason
        metrics = httpx.get(srv.base_url + "/metrics").text
        assert f'openk3:router_retries_total{{reason="garbage",worker="{bad}"}} 1.0' in metrics
        good = r.headers["x-openk3-worker"]
        assert f'openk3:router_cached_tokens_total{{worker="{good}"}} 8.0' in metrics
        assert f'openk3:router_prefix_cache_hit_rate{{worker="{good}"}} 0.8' in metrics


def test_the_workers_own_body_limit_is_answered_by_the_router():
    """Workers report their ``max_request_bytes`` in ``GET /health``: a body every worker would refuse is
    the router's 413 from its Content-Length, never uploaded (uploading it, concurrent 60 MB bodies got a
    healthy worker marked down while the worker closed each connection early); a body within it is routed."""
    posted = []

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok", "max_request_bytes": 2000})
        posted.append(len(request.content))
        return httpx.Response(200, json=COMPLETION)

    with BackgroundServer(build_router_app(RouterConfig(workers=W), httpx.MockTransport(handle))) as srv:
        url = srv.base_url + "/v1/completions"
        r = httpx.post(url, json={"model": "m", "prompt": "x" * 5000}, timeout=10)
        err = r.json()["error"]
        assert r.status_code == 413 and err["code"] == "request_too_large" and "2,000 bytes" in err["message"]
        assert posted == [] and all(w["up"] for w in httpx.get(srv.base_url + "/workers").json()["workers"])
        assert httpx.post(url, json={"model": "m", "prompt": "x" * 1000}, timeout=10).json() == COMPLETION
        assert len(posted) == 1


def test_a_body_too_long_for_one_worker_goes_to_one_that_takes_it():
    """Workers of different limits: a body over one worker's is sent to another whose limit it fits (the
    first one's 413 only when none does); the body is read up to the largest limit."""
    limits = {9001: 2000, 9002: 100_000, 9003: 2000}
    served = []

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok", "max_request_bytes": limits[request.url.port]})
        served.append(request.url.port)
        return httpx.Response(200, json=COMPLETION)

    with BackgroundServer(build_router_app(RouterConfig(workers=W), httpx.MockTransport(handle))) as srv:
        url = srv.base_url + "/v1/completions"
        for i in range(6):
            body = {"model": "m", "prompt": f"{i}" + "x" * 5000, "user": f"s{i}"}
            assert httpx.post(url, json=body, timeout=10).json() == COMPLETION
        assert served == [9002] * 6
        r = httpx.post(url, json={"model": "m", "prompt": "x" * 200_000}, timeout=10)
        assert r.status_code == 413 and "100,000 bytes" in r.json()["error"]["message"]


def test_a_worker_404_for_an_unknown_model_reaches_the_client_and_keeps_the_worker():
    """The server's 404 ``model_not_found`` is the client's mistake: passed through, no retry elsewhere."""
    error = {"error": {"message": "The model 'x' does not exist", "type": "invalid_request_error"}}
    error["error"].update(param="model", code="model_not_found")
    asked = []

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        asked.append(request.url.port)
        return httpx.Response(404, json=error)

    with BackgroundServer(build_router_app(RouterConfig(workers=W), httpx.MockTransport(handle))) as srv:
        r = httpx.post(srv.base_url + "/v1/completions", json={"model": "x", "prompt": "hi"}, timeout=10)
        assert r.status_code == 404 and r.json() == error and len(asked) == 1
        assert all(w["up"] for w in httpx.get(srv.base_url + "/workers").json()["workers"])


def test_workers_can_be_added_and_removed_at_run_time():
    config = RouterConfig(workers=W[:1])
    with BackgroundServer(build_router_app(config, fake_transport(set()))) as srv:
        r = httpx.post(srv.base_url + "/workers", json={"url": W[1] + "/"})
        assert [w["url"] for w in r.json()["workers"]] == list(W[:2]) and r.json()["workers"][1]["up"]
        assert httpx.post(srv.base_url + "/workers", json={"url": "nope"}).status_code == 400
        assert httpx.request("DELETE", srv.base_url + "/workers", json={"url": W[2]}).status_code == 404
        r = httpx.request("DELETE", srv.base_url + "/workers", json={"url": W[0]})
        assert [w["url"] for w in r.json()["workers"]] == [W[1]]


def test_a_client_leaving_before_the_first_event_cancels_the_worker_request():
    closed = []

    async def slow_stream():
        try:
            await asyncio.sleep(30)  # a long prefill
            yield STREAM
        finally:
            closed.append(True)

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        return httpx.Response(200, content=slow_stream(), headers={"content-type": "text/event-stream"})

    config = RouterConfig(workers=W[:1])
    with BackgroundServer(build_router_app(config, httpx.MockTransport(handle))) as srv:
        body = json.dumps({"model": "m", "prompt": "hi", "stream": True})
        host, port = srv.base_url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        time.sleep(0.3)
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        deadline = time.monotonic() + 5
        while not closed:
            assert time.monotonic() < deadline, "the worker stream was not closed"
            time.sleep(0.05)
        assert "openk3:router_client_disconnects_total 1.0" in httpx.get(srv.base_url + "/metrics").text
        assert httpx.get(srv.base_url + "/workers").json()["workers"][0]["in_flight"] == 0


def test_a_refused_stream_is_counted_out_and_a_body_without_events_is_named():
    """A worker's 4xx to a streamed request reaches the client and leaves nothing in flight (it leaked one
    count per refusal, until the worker looked saturated and sessions fell back); a worker that streams a
    body with no SSE event is quarantined with what it sent."""
    error = {"error": {"message": "max_tokens must be >= 1", "type": "invalid_request_error", "code": None}}

    async def body_without_events():
        yield b"<html>no events</html>"

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if request.url.port == 9002:
            return httpx.Response(200, content=body_without_events())
        return httpx.Response(400, json=error)

    config = RouterConfig(workers=W[:2], quarantine_s=60)
    with BackgroundServer(build_router_app(config, httpx.MockTransport(handle))) as srv:
        session = next(
            s
            for s in map(str, range(100))
            if RoutingPolicy(config).ring.preference(f"session\x00{s}".encode())[0] == W[1]
        )
        for _ in range(3):
            r = httpx.post(
                srv.base_url + "/v1/completions",
                json={"model": "m", "prompt": "hi", "stream": True, "user": session},
                timeout=10,
            )
            assert r.status_code == 400 and r.json() == error
        workers = httpx.get(srv.base_url + "/workers").json()["workers"]
        assert [w["in_flight"] for w in workers] == [0, 0], workers
        assert "streamed b'<html>no events</html>'" in workers[1]["quarantine_reason"], workers


def test_one_failed_health_probe_does_not_take_a_worker_out():
    statuses = iter([200, 500, 200, 500, 500, 200])

    async def probes() -> list[bool]:
        transport = httpx.MockTransport(lambda request: httpx.Response(next(statuses), json={"status": "ok"}))
        router = Router(RouterConfig(workers=W[:1], health_failures=2), transport)
        router.client = httpx.AsyncClient(transport=transport)
        worker = router.policy.workers[W[0]]
        ups = []
        for _ in range(6):
            await router.probe(worker)
            ups.append(worker.healthy)
        await router.client.aclose()
        return ups

    assert asyncio.run(probes()) == [True, True, True, True, False, True]


def test_a_router_given_its_own_address_keeps_it_down_and_refuses_to_add_it():
    """A worker URL that is the router itself (here under another name, ``localhost``) would forward every
    request back to the router: its health answer carries the router's own id, so it is kept down with that
    reason, and ``POST /workers`` of it is a 400; requests get the plain 503, at once."""
    port = closed_port()
    config = RouterConfig(workers=(f"http://localhost:{port}",), health_interval_s=0.2, health_timeout_s=1.0)
    with BackgroundServer(build_router_app(config), port=port) as srv:
        deadline = time.monotonic() + 10
        while "own id" not in (w := httpx.get(srv.base_url + "/workers").json()["workers"][0])["last_error"]:
            assert time.monotonic() < deadline, w
            time.sleep(0.1)
        assert not w["up"]
        t0 = time.monotonic()
        r = httpx.post(srv.base_url + "/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=10)
        assert r.status_code == 503 and time.monotonic() - t0 < 2
        assert "this router's own id" in r.json()["error"]["message"]  # the 503 says why the worker is down
        added = httpx.post(srv.base_url + "/workers", json={"url": srv.base_url}, timeout=10)
        assert added.status_code == 400 and "is this router itself" in added.json()["error"]["message"]
        urls = [w["url"] for w in httpx.get(srv.base_url + "/workers").json()["workers"]]
        assert urls == [f"http://localhost:{port}"]  # the refused one is not kept


def test_a_request_that_comes_back_to_its_router_is_508():
    """Every forwarded request carries the ids of the routers it passed (``X-OpenK3-Routers``, this
    router's own id appended); one that arrives with this router's id went round a loop of routers: 508
    ``routing_loop``, not forwarded again."""
    seen: list[str] = []

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        seen.append(request.headers.get("x-openk3-routers", ""))
        return httpx.Response(200, json=COMPLETION)

    body = {"model": "m", "prompt": "hi"}
    with BackgroundServer(build_router_app(RouterConfig(workers=W[:1]), httpx.MockTransport(handle))) as srv:
        me = httpx.get(srv.base_url + "/health").headers["x-openk3-router"]
        assert httpx.post(srv.base_url + "/v1/completions", json=body, timeout=10).status_code == 200
        r = httpx.post(
            srv.base_url + "/v1/completions", json=body, headers={"x-openk3-routers": "0123abcd"}, timeout=10
        )
        assert r.status_code == 200 and seen == [me, f"0123abcd,{me}"]
        r = httpx.post(
            srv.base_url + "/v1/completions", json=body, headers={"x-openk3-routers": f"0123abcd,{me}"}
        )
        assert r.status_code == 508 and r.json()["error"]["code"] == "routing_loop" and len(seen) == 2


def test_a_worker_that_leads_back_to_the_router_is_taken_out_and_the_request_served_elsewhere():
    """Router A in front of a worker and of router B, whose only worker is A: a request A sends to B comes
    back to A (508 ``routing_loop``), B passes that back, and A takes B out (quarantined, the reason in
    ``GET /workers``) and serves the request from its real worker."""
    from fastapi import FastAPI

    fake = FastAPI()

    @fake.get("/health")
    async def health():
        return {"status": "ok"}

    @fake.post("/v1/completions")
    async def completions():
        return COMPLETION

    port_a = closed_port()
    url_a = f"http://127.0.0.1:{port_a}"
    fast = dict(health_interval_s=0.2, health_timeout_s=1.0, quarantine_s=60)
    with (
        BackgroundServer(fake) as worker,
        BackgroundServer(build_router_app(RouterConfig(workers=(url_a,), **fast))) as b,
    ):
        config_a = RouterConfig(workers=(worker.base_url, b.base_url), **fast)
        ring = RoutingPolicy(config_a).ring
        session = next(
            s for s in map(str, range(100)) if ring.preference(f"session\x00{s}".encode())[0] == b.base_url
        )
        with BackgroundServer(build_router_app(config_a), port=port_a) as a:
            deadline = time.monotonic() + 10
            while not all(w["up"] for w in httpx.get(a.base_url + "/workers").json()["workers"]):
                assert time.monotonic() < deadline, httpx.get(a.base_url + "/workers").json()
                time.sleep(0.1)
            r = httpx.post(
                a.base_url + "/v1/completions",
                json={"model": "m", "prompt": "hi", "user": session},
                timeout=10,
            )
            assert r.status_code == 200 and r.headers["x-openk3-worker"] == worker.base_url
            workers = {w["url"]: w for w in httpx.get(a.base_url + "/workers").json()["workers"]}
            assert not workers[b.base_url]["up"] and workers[b.base_url]["quarantined_s"] > 50
            # B's health probes go on meanwhile and may answer anything; the quarantine's reason stays
            assert (
                "routing_loop" in workers[b.base_url]["quarantine_reason"] and workers[worker.base_url]["up"]
            )
