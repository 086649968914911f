"""Misconfiguration is loud (issue 27, item 5).

A router whose ``[vllm] md_kv_events`` names an endpoint where nothing publishes served normally
with an empty mirror: now, once no publisher has been connected for ``PUBLISHER_BOUND_S``, its
/readyz answers 503 naming the endpoint, /status carries the problem, and the metric
``pddlink_router_kv_events_publisher_up{instance="md0"}`` is 0; when a publisher appears there, all three turn
back. A router without a tokenizer refuses a text prompt with a typed 400 (it answered 200 with
empty text). Real router processes and a real ZMQ publisher.
"""

from __future__ import annotations

import http.client
import json
import time
from pathlib import Path
from typing import Any

import pytest

from router.mirror import PUBLISHER_BOUND_S
from tests.router_edge.router_proc import router_process

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]


def _get(port: int, path: str) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        body = r.read()
        return r.status, json.loads(body) if path != "/metrics" else body.decode()
    finally:
        conn.close()


def _until(fn: Any, timeout_s: float) -> Any:
    end = time.monotonic() + timeout_s
    while True:
        got = fn()
        if got or time.monotonic() > end:
            return got
        time.sleep(0.2)


def test_a_kv_event_endpoint_with_no_publisher_makes_readyz_and_status_say_so(tmp_path: Path) -> None:
    zmq = pytest.importorskip("zmq")
    endpoint = f"ipc://{tmp_path}/md-kv-events"  # nothing publishes there (yet)
    vllm = {"p_url": "http://127.0.0.1:9", "md_url": "http://127.0.0.1:11", "model": "tiny"}
    with router_process(tmp_path, vllm={**vllm, "md_kv_events": endpoint}) as router:
        t0 = time.monotonic()  # (the bound runs from the router's start, a little earlier)
        status, ready = _until(lambda: (s := _get(router.port, "/readyz"))[0] == 503 and s, 15.0)
        took = time.monotonic() - t0
        assert status == 503 and endpoint in ready["problems"][0], ready
        assert took < PUBLISHER_BOUND_S + 2.0, took
        mirror = _get(router.port, "/status")[1]["drc_mirror"]
        assert mirror["publisher_connected"] is False and endpoint in mirror["problem"]
        assert 'pddlink_router_kv_events_publisher_up{instance="md0"} 0.0' in _get(router.port, "/metrics")[1]
        print(f"\n/readyz 503 after {took:.1f} s: {ready['problems'][0]}")

        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.bind(endpoint)  # a publisher appears: ready again
        try:
            assert _until(lambda: _get(router.port, "/readyz")[0] == 200, 10.0)
            mirror = _get(router.port, "/status")[1]["drc_mirror"]
            assert mirror["publisher_connected"] is True and mirror["problem"] == ""
            up = 'pddlink_router_kv_events_publisher_up{instance="md0"} 1.0'
            assert up in _get(router.port, "/metrics")[1]
        finally:
            pub.close(0)
            ctx.term()


def test_a_text_prompt_without_a_tokenizer_is_a_typed_400(tmp_path: Path) -> None:
    with router_process(tmp_path) as router:  # no [api] tokenizer
        conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=10)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "hello", "max_tokens": 2}))
        r = conn.getresponse()
        error = json.loads(r.read())["error"]
        conn.close()
        assert r.status == 400 and r.reason == "Bad Request"
        assert error["type"] == "BadRequestError" and error["param"] == "prompt"
        assert "no tokenizer" in error["message"] and "token ids" in error["message"]
