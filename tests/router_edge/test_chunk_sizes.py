"""``ChunkSizes``: a chunked body's declared size, followed over the raw bytes whole and byte by
byte (h11 style), against h11's own decoding of the same bytes."""

from __future__ import annotations

import h11
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pddlink.serving.chunked import BodyTooLarge, ChunkSizes


def _body(sizes: list[int], trailer: bytes = b"") -> bytes:
    out = b"".join(b"%x;e=1\r\n%s\r\n" % (n, b"z" * n) for n in sizes)
    return out + b"0\r\n" + trailer + b"\r\n"


def _feed(data: bytes, limit: int, step: int) -> ChunkSizes:
    c = ChunkSizes(limit)
    for i in range(0, len(data), step):
        c.feed(data[i : i + step])
    return c


@given(st.lists(st.integers(1, 300), max_size=8), st.integers(1, 17))
def test_the_declared_size_is_the_sum_of_the_chunks(sizes: list[int], step: int) -> None:
    data = _body(sizes, b"x-t: 1\r\n") + b"GET / HTTP/1.1\r\n"  # the next request's bytes are ignored
    c = _feed(data, 10_000, step)
    assert c.declared == sum(sizes) and c.state.name == "DONE"


@given(st.lists(st.integers(1, 300), min_size=1, max_size=8), st.integers(1, 17))
def test_over_the_limit_raises_at_the_size_line_before_its_data(sizes: list[int], step: int) -> None:
    limit = sum(sizes) - 1
    before = _body(sizes[:-1])[: -len(b"0\r\n\r\n")]
    with pytest.raises(BodyTooLarge):
        _feed(before + b"%x;e=1\r\n" % sizes[-1], limit, step)  # no byte of the last chunk's data
    _feed(before, limit, step)  # (the chunks before it are within the limit)


def test_h11_decodes_the_same_body() -> None:
    sizes = [5, 300, 1]
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n" + _body(sizes))
    got = b""
    while not isinstance(ev := conn.next_event(), h11.EndOfMessage):
        got += ev.data if isinstance(ev, h11.Data) else b""
    assert len(got) == sum(sizes) == _feed(_body(sizes), 10_000, 7).declared


def test_a_malformed_size_line_is_left_to_h11() -> None:
    c = _feed(b"zz\r\n" + b"f" * 100, 10, 3)
    assert c.state.name == "DONE" and c.declared == 0
