"""A stopping router's HTTP answers, in memory (``router.api.RouterApi``): from SIGTERM on, every
answer closes its connection (a load balancer's pool drops it) and /readyz says 503; a request that
comes on a connection opened before is still served for the notice period, refused (503, retry
elsewhere) after it; a request being read and admitted counts as running for the stop."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pddlink.cli.router import load_router_config
from pddlink.errors import ConfigError
from pddlink.serving.client_guard import ApiConfig
from pddlink.serving.http import Request
from router.api import RouterApi


def _api() -> RouterApi:
    cfg = SimpleNamespace(vocab_size=100, max_prompt_tokens=64, max_tokens_limit=16, deadline_s=5.0)
    router: Any = SimpleNamespace(cfg=cfg, backend=SimpleNamespace(), status=lambda: {"role": "router"})
    return RouterApi(router)


def _get(api: RouterApi, path: str, method: str = "GET", body: bytes = b"") -> Any:
    return asyncio.run(api.http(Request(method, path, "", body, (), "")))


def test_answers_close_their_connection_once_stopping() -> None:
    api = _api()
    ready = _get(api, "/readyz")
    assert ready.status == 200 and ("connection", "close") not in ready.headers
    api.stopping = True
    ready = _get(api, "/readyz")
    assert ready.status == 503 and ("connection", "close") in ready.headers
    status = _get(api, "/status")
    assert status.status == 200 and ("connection", "close") in status.headers


def test_generation_is_served_in_the_notice_period_and_refused_after() -> None:
    api = _api()
    api.stopping = True
    bad = _get(api, "/v1/completions", "POST", b"{}")  # served: the schema answers (400), not 503
    assert bad.status == 400 and ("connection", "close") in bad.headers
    api.refusing = True
    refused = _get(api, "/v1/completions", "POST", b"{}")
    assert refused.status == 503 and ("retry-after", "1") in refused.headers
    assert api.admitting == 0  # counted while read and admitted, not after


def test_the_notice_period_is_the_api_tables_stop_notice_s(tmp_path: Path) -> None:
    cfg = tmp_path / "router.toml"
    head = 'http_port = 0\np = "127.0.0.1:1"\nrld = "127.0.0.1:2"\nmd = "127.0.0.1:3"\n'
    cfg.write_text(head + "[api]\nstop_notice_s = 1.5\n")
    _, _, api = load_router_config(str(cfg), {})
    assert api.stop_notice_s == 1.5 and RouterApi(_api().router, api=api).api.stop_notice_s == 1.5
    assert ApiConfig().stop_notice_s == 3.0  # HAProxy's checks (inter 1s fall 2) take ~2 s
    for bad in ("-1", "61", '"3"'):
        cfg.write_text(head + f"[api]\nstop_notice_s = {bad}\n")
        with pytest.raises(ConfigError, match="stop_notice_s"):
            load_router_config(str(cfg), {})
