"""Malformed HTTP at the router's edge (issue 27, item 4): each case is answered with a status line
that has a reason phrase, a JSON error body in vLLM's shape and ``Connection: close``, within 1 s,
and the connection is closed; a chunked body that declares more than the body limit is refused
413 as soon as its size line arrives; a partial head gets 408 at the head deadline.

Real sockets against a real router process (``pddlink router``), its sidecars nowhere.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.router_edge.router_proc import (
    RouterProc,
    closed_within,
    connect,
    read_answer,
    read_answers,
    router_process,
)

pytestmark = [pytest.mark.process, pytest.mark.timeout(120)]

H = b"host: x\r\n"
CASES: dict[str, tuple[bytes, int]] = {
    "garbage request line": (b"GARBAGE\r\n\r\n", 400),
    "header without colon": (b"GET /healthz HTTP/1.1\r\n" + H + b"badheader\r\n\r\n", 400),
    "bad content-length": (b"POST /v1/completions HTTP/1.1\r\n" + H + b"content-length: abc\r\n\r\n", 400),
    "conflicting content-length": (
        b"POST /v1/completions HTTP/1.1\r\n" + H + b"content-length: 3\r\ncontent-length: 4\r\n\r\nabc",
        400,
    ),
    "repeated content-length": (
        b"POST /v1/completions HTTP/1.1\r\n" + H + b"content-length: 2\r\ncontent-length: 2\r\n\r\n{}",
        400,
    ),
    "content-length and chunked": (
        b"POST /v1/completions HTTP/1.1\r\n" + H + b"content-length: 5\r\n"
        b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n",
        400,
    ),
    "bad chunk size": (
        b"POST /v1/completions HTTP/1.1\r\n" + H + b"transfer-encoding: chunked\r\n\r\nzz\r\n",
        400,
    ),
    "huge chunk size": (
        b"POST /v1/completions HTTP/1.1\r\n" + H + b"transfer-encoding: chunked\r\n\r\nffffffffff\r\n{",
        413,
    ),
    "chunks over the limit": (
        b"POST /v1/completions HTTP/1.1\r\n"
        + H
        + b"transfer-encoding: chunked\r\n\r\n"
        + b"8000\r\n"
        + b"x" * 0x8000
        + b"\r\n"
        + b"8001\r\n",
        413,
    ),
    "NUL in the path": (b"GET /a\x00b HTTP/1.1\r\n" + H + b"\r\n", 400),
    "oversized head": (b"GET /healthz HTTP/1.1\r\n" + H + b"x-pad: " + b"a" * 70_000, 431),
    "unknown transfer coding": (
        b"POST /v1/completions HTTP/1.1\r\n" + H + b"transfer-encoding: gzip\r\n\r\n",
        501,
    ),
    "no host": (b"GET /healthz HTTP/1.1\r\n\r\n", 400),
    "declared body over the limit": (
        b"POST /v1/completions HTTP/1.1\r\n" + H + b"content-length: 99999999\r\n\r\n{",
        413,
    ),
}
REASONS = {400: b"Bad Request", 408: b"Request Timeout", 413: b"Request Entity Too Large"}
REASONS |= {431: b"Request Header Fields Too Large", 501: b"Not Implemented"}
BODY_LIMIT = 0x10000  # two chunks of 0x8000 are the limit; one byte more is over


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProc]:
    api = {"max_body_bytes": BODY_LIMIT, "header_timeout_s": 1.0, "body_timeout_s": 30.0}
    with router_process(tmp_path_factory.mktemp("malformed"), api) as r:
        yield r


def _check_answer(answer: bytes, status: int) -> dict[str, object]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 %d %s" % (status, REASONS[status]), answer[:300]
    assert b"connection: close" in [ln.lower() for ln in lines[1:]], head
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, error
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_request_is_answered_and_closed_within_a_second(router: RouterProc, case: str) -> None:
    data, status = CASES[case]
    s = connect(router.port)
    t0 = time.monotonic()
    s.sendall(data)
    answer = read_answer(s)
    took = time.monotonic() - t0
    _check_answer(answer, status)
    assert took < 1.0, f"{case}: {status} after {took:.3f} s"
    assert closed_within(s, 2.0), case
    print(f"{case}: {status} in {took * 1000:.1f} ms")
    s.close()


def test_the_same_cases_byte_by_byte(router: RouterProc) -> None:
    """The verdict does not depend on how the bytes are split (h11 style: fed a byte at a time)."""
    for case in ("garbage request line", "header without colon", "huge chunk size", "NUL in the path"):
        data, status = CASES[case]
        s = connect(router.port)
        for i in range(len(data)):
            try:
                s.sendall(data[i : i + 1])
            except OSError:
                break  # answered and closed before the last byte: fine
        _check_answer(read_answer(s), status)
        s.close()


def test_a_partial_head_gets_408_at_the_head_deadline(router: RouterProc) -> None:
    s = connect(router.port)
    t0 = time.monotonic()
    s.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")  # never the blank line
    error = _check_answer(read_answer(s), 408)
    took = time.monotonic() - t0
    assert 0.8 < took < 2.0, took
    assert "head" in str(error["message"])
    s.close()


def test_a_good_request_after_a_chunked_body_on_the_same_connection(router: RouterProc) -> None:
    """The chunk-size guard follows the framing exactly: a chunked body just under the limit is
    read whole (400: not JSON), and the keep-alive connection serves the next request."""
    s = connect(router.port)
    body = b"8000\r\n" + b"x" * 0x8000 + b"\r\n" + b"7fff;ext=1\r\n" + b"y" * 0x7FFF
    body += b"\r\n0\r\nt: 1\r\n\r\n"
    s.sendall(b"POST /v1/completions HTTP/1.1\r\n" + H + b"transfer-encoding: chunked\r\n\r\n" + body)
    assert read_answer(s).startswith(b"HTTP/1.1 400 Bad Request")
    s.sendall(b"GET /healthz HTTP/1.1\r\n" + H + b"\r\n")
    assert read_answer(s).startswith(b"HTTP/1.1 200 OK")
    s.close()


def test_sized_bodies_keep_alive_and_pipelined(router: RouterProc) -> None:
    """Content-Length bodies are read around h11 (``_sized_body``): the keep-alive connection still
    serves the next request, whole or pipelined behind the body in the same packet."""
    s = connect(router.port)
    post = b"POST /v1/completions HTTP/1.1\r\n" + H + b"content-length: 5\r\n\r\n{bad}"
    s.sendall(post)
    assert read_answer(s).startswith(b"HTTP/1.1 400 Bad Request")
    s.sendall(post + b"GET /healthz HTTP/1.1\r\n" + H + b"\r\n" + post)
    got = [a.split(b"\r\n")[0] for a in read_answers(s, 3)]
    assert got == [b"HTTP/1.1 400 Bad Request", b"HTTP/1.1 200 OK", b"HTTP/1.1 400 Bad Request"], got
    big = b"x" * 200_000  # over max_body_bytes: 413 and closed, without reading it whole
    s.sendall(b"POST /v1/completions HTTP/1.1\r\n" + H + b"content-length: %d\r\n\r\n" % len(big))
    assert read_answer(s).startswith(b"HTTP/1.1 413")
    s.close()


def test_answers_keep_their_reason_phrase(router: RouterProc, tmp_path: Path) -> None:
    s = connect(router.port)
    s.sendall(b"GET /nowhere HTTP/1.1\r\n" + H + b"\r\n")
    assert read_answer(s).startswith(b"HTTP/1.1 404 Not Found")
    s.close()
