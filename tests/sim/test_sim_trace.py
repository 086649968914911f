"""The shared JSONL trace format, the Mooncake loader and scaling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pddlink.sim.trace import (
    Trace,
    TraceFormatError,
    TraceMeta,
    TraceRequest,
    block_token_ids,
    read_trace,
    scale_trace,
    write_trace,
)

MOONCAKE = Path("/work/shared/traces/mooncake-synthetic.jsonl")


def _trace() -> Trace:
    reqs = (
        TraceRequest(0, 0.0, 0, (1, 2, 3), 40, 5, 64),
        TraceRequest(1, 0.5, 0, (1, 2, 4, 5), 60, 64, 64),
    )
    return Trace(TraceMeta(16, "test"), reqs)


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, _trace())
    back = read_trace(path)
    assert back == _trace()


def test_block_tokens_are_deterministic_and_shared_prefixes_stay_shared() -> None:
    a, b = _trace().requests
    ta, tb = a.prompt_token_ids(16, 1000), b.prompt_token_ids(16, 1000)
    assert len(ta) == 40 and len(tb) == 60
    assert ta[:32] == tb[:32] and ta[32:40] != tb[32:40]
    assert block_token_ids(7, 8, 50) == block_token_ids(7, 8, 50) != block_token_ids(8, 8, 50)


def test_scaling_keeps_shape() -> None:
    s = scale_trace(_trace(), block_tokens=4, max_output_tokens=10, time_scale=2.0)
    assert s.meta.block_tokens == 4
    assert [r.prompt_tokens for r in s.requests] == [10, 15]
    assert [r.max_tokens for r in s.requests] == [10, 10] and s.requests[0].output_tokens == 5
    assert s.requests[1].arrival_s == 1.0 and s.requests[1].block_ids == (1, 2, 4, 5)


_OK = '"id": 0, "session": 0, "prompt_tokens": 4'


_BASE = {
    "id": 0,
    "arrival_s": 0,
    "session": 0,
    "blocks": [1],
    "prompt_tokens": 4,
    "output_tokens": 1,
    "max_tokens": 2,
}


def _without(field: str) -> str:
    return json.dumps({k: v for k, v in _BASE.items() if k != field})


def _with(**kw: object) -> str:
    return json.dumps({**_BASE, **kw})


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        (_without("max_tokens"), "max_tokens"),
        (_with(arrival_s="x"), "arrival_s"),
        (_with(blocks=[]), "blocks"),
        (_with(output_tokens=9), "output_tokens"),
        ("{not json", "not JSON"),
    ],
)
def test_bad_lines_name_file_line_and_field(tmp_path: Path, line: str, needle: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"pddlink_trace": 1, "block_tokens": 4}) + "\n" + line + "\n")
    with pytest.raises(TraceFormatError) as err:
        read_trace(path)
    assert f"{path}:2" in err.value.message and needle in err.value.message


def test_unknown_format_and_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"foo": 1}\n')
    with pytest.raises(TraceFormatError, match="unknown trace format"):
        read_trace(path)
    path.write_text("")
    with pytest.raises(TraceFormatError, match="empty"):
        read_trace(path)


def test_mooncake_loads_as_it_stands(tmp_path: Path) -> None:
    if not MOONCAKE.exists():
        pytest.skip("shared Mooncake trace not present")
    trace = read_trace(MOONCAKE)
    assert trace.meta.block_tokens == 512 and len(trace.requests) == 3993
    first = json.loads(MOONCAKE.read_text().splitlines()[0])
    r = trace.requests[0]
    assert r.prompt_tokens == first["input_length"] and r.block_ids == tuple(first["hash_ids"])
    assert 1000 < trace.duration_s < 1100
    bad = tmp_path / "m.jsonl"
    bad.write_text(MOONCAKE.read_text().splitlines()[0] + "\n" + '{"timestamp": 5, "hash_ids": [1]}\n')
    with pytest.raises(TraceFormatError, match=r"m.jsonl:2: missing field 'output_length'"):
        read_trace(bad)
