"""Where TTFT goes (``harness.ttft_stages``): from recorded readings to the stage table the vLLM
demo reports. In memory: vLLM's /metrics texts before and after, connector hook records, request
traces and P's transfer records as the demo reads them; then a real ``Router`` on the vLLM backend
against a loopback HTTP server standing in for P's and MD's vLLM, for the trace's own stamps."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from engines_adapter import SamplingParams
from harness.ttft_stages import (
    LATENCY_BUCKETS_S,
    PREFILL,
    QUEUE,
    EngineSide,
    Histogram,
    RequestTimes,
    hook_median,
    stage_rows,
    stage_table,
)
from harness.vllm_demo_report import table
from router import Router, RouterConfig, VllmEngineConfig
from router.answer import RequestEnd

pytestmark = [pytest.mark.timeout(60)]


def metrics_text(name: str, counts: dict[str, list[float]]) -> str:
    """A /metrics text with histogram ``name``: cumulative counts per engine label set."""
    lines = [f"# TYPE {name} histogram"]
    for engine, cum in counts.items():
        bounds = ["0.01", "0.02", "0.05", "+Inf"]
        for le, c in zip(bounds, cum, strict=True):
            lines.append(f'{name}_bucket{{engine="{engine}",le="{le}",model_name="m"}} {c}')
        lines.append(f'{name}_count{{engine="{engine}",model_name="m"}} {cum[-1]}')
    return "\n".join(lines) + "\n"


def test_histogram_median_over_a_window_sums_label_sets() -> None:
    before = metrics_text(QUEUE, {"0": [1, 1, 1, 1], "1": [0, 0, 0, 0]})
    # since then: engine 0 saw 2 in (0.01, 0.02] and 1 in (0.02, 0.05]; engine 1 one in (0, 0.01]
    after = metrics_text(QUEUE, {"0": [1, 3, 4, 4], "1": [1, 1, 1, 1]})
    h = Histogram.parse(after, QUEUE).minus(Histogram.parse(before, QUEUE))
    assert h.counts == (1, 3, 4, 4)
    # rank 2 of 4 falls in (0.01, 0.02], which holds ranks 1..3: a third of the way in
    assert h.quantile(0.5) == pytest.approx(0.01 + 0.01 * (2 - 1) / 2)
    assert Histogram.parse(after, PREFILL).quantile(0.5) is None  # another metric: nothing seen
    assert Histogram.parse(before, QUEUE).minus(Histogram.parse(before, QUEUE)).quantile(0.5) is None


def test_histogram_rank_in_the_open_bucket_is_the_last_bound() -> None:
    h = Histogram((0.01, float("inf")), (0.0, 3.0))
    assert h.quantile(0.5) == 0.01


def test_hook_median_counts_only_the_marked_steps() -> None:
    lines = [
        json.dumps({"op": "save", "seconds": 0.004}),
        json.dumps({"op": "sched", "seconds": 9.0}),  # the scheduler's: not a worker step
        json.dumps({"op": "save+load", "seconds": 0.006}),
        json.dumps({"op": "load", "seconds": 0.5}),
        '{"op": "save", "sec',  # a line the connector was still writing
        "",
    ]
    assert hook_median(lines, "save") == pytest.approx(0.005)
    assert hook_median(lines, "load") == pytest.approx((0.006 + 0.5) / 2)
    assert hook_median([], "save") is None


def _trace(sent: float, first: float, tokens: dict[str, int]) -> dict[str, Any]:
    return {
        "stamps_s": {"entered": 0.0, "placed": sent / 2, "sent": sent, "first_token": first},
        "tokens": tokens,
    }


SHIPPED = {"legs": {"rld": {"ok": True, "ship_seconds": 0.03}, "md": {"ok": True, "ship_seconds": 0.6}}}


def test_request_times_from_trace_and_transfer_record() -> None:
    t = RequestTimes.of(_trace(0.002, 0.2, {"rld": 40, "md": 88}), 0.201, SHIPPED)
    assert t is not None and t.source == "rld" and t.ship_s == 0.03
    assert t.router_s == pytest.approx(0.002 + 0.001)
    md_first = RequestTimes.of(_trace(0.002, 0.8, {"md": 128}), 0.8, SHIPPED)
    assert md_first is not None and md_first.source == "md" and md_first.ship_s == 0.6
    failed_leg = {"legs": {"rld": {"ok": False, "error": "deadline", "ship_seconds": 5.0}}}
    no_ship = RequestTimes.of(_trace(0.002, 0.2, {"rld": 1}), 0.2, failed_leg)
    assert no_ship is not None and no_ship.ship_s is None  # a failed leg's time is no transfer time
    assert RequestTimes.of({"tokens": {"rld": 1}}, 0.2, SHIPPED) is None  # no stamps: no reading


ENGINE = EngineSide(
    p_queue_s=0.001,
    p_prefill_step_s=0.05,  # the copy-out runs inside P's prefill step
    kv_copy_out_s=0.004,
    load_s={"rld": 0.003, "md": 0.02},
    first_decode_s={"rld": 0.012, "md": 0.015},
)


def test_stage_table_scopes_to_the_main_consumer_and_adds_up() -> None:
    times = [
        RequestTimes(ttft_s=0.100, sent_s=0.002, first_token_s=0.0995, source="rld", ship_s=0.030),
        RequestTimes(ttft_s=0.120, sent_s=0.004, first_token_s=0.1195, source="rld", ship_s=0.040),
        RequestTimes(ttft_s=0.140, sent_s=0.003, first_token_s=0.1390, source="rld", ship_s=0.050),
        RequestTimes(ttft_s=0.900, sent_s=0.020, first_token_s=0.8990, source="md", ship_s=0.700),
    ]
    out = stage_table(times, ENGINE)
    stages = out["ttft_stages"]
    assert list(stages) == [
        "router_admission_placement",
        "p_queue",
        "prefill",
        "kv_copy_out",
        "transfer_fast_path",
        "consumer_load",
        "first_decode",
        "first_byte",
    ]
    assert stages["router_admission_placement"] == pytest.approx(0.003)  # the RLD requests' only
    assert stages["prefill"] == pytest.approx(0.046)  # P's step less the copy-out inside it
    assert stages["transfer_fast_path"] == pytest.approx(0.040)
    assert stages["consumer_load"] == 0.003 and stages["first_decode"] == 0.012  # RLD's, not MD's
    assert stages["first_byte"] == pytest.approx(0.0005)
    d = out["ttft_stages_detail"]
    assert d["first_token_from"] == {"md": 1, "rld": 3}
    assert d["ttft_median_s"] == pytest.approx(0.120)
    assert d["stages_sum_s"] == pytest.approx(sum(stages.values()))
    assert d["residual_s"] == pytest.approx(0.120 - sum(stages.values()))
    assert d["missing"] == []
    assert set(d["method"]) == set(stages) and all(d["method"].values())
    assert d["cross_checks"]["p_round_trip_s"] is None  # no request carried P's round trip
    # the router's own time over every request (the MD one too), against every request's median TTFT
    router = sorted([0.0025, 0.0045, 0.004, 0.021])
    assert out["router_ttft_share"] == pytest.approx(((router[1] + router[2]) / 2) / ((0.12 + 0.14) / 2))


def test_stage_table_wan_path_and_missing_readings() -> None:
    times = [RequestTimes(ttft_s=0.9, sent_s=0.01, first_token_s=0.89, source="md", ship_s=None)]
    out = stage_table(times, EngineSide(p_queue_s=0.001))
    assert set(out["ttft_stages"]) == {"router_admission_placement", "p_queue", "first_byte"}
    assert "transfer_wan" in out["ttft_stages_detail"]["missing"]
    assert "kv_copy_out" in out["ttft_stages_detail"]["missing"]
    assert out["router_ttft_share"] == pytest.approx(0.02 / 0.9)
    assert stage_table([], ENGINE) == {"ttft_stages": {}, "router_ttft_share": None, "ttft_stages_detail": {}}


def test_engine_side_from_metrics_and_hooks() -> None:
    def both(queue: list[float], prefill: list[float]) -> str:
        return metrics_text(QUEUE, {"0": queue}) + metrics_text(PREFILL, {"0": prefill})

    metrics = {
        "p": (both([0, 0, 0, 0], [0, 0, 0, 0]), both([2, 2, 2, 2], [0, 0, 2, 2])),
        "rld": (both([0, 0, 0, 0], [0, 0, 0, 0]), both([0, 0, 0, 2], [2, 2, 2, 2])),
    }
    hooks = {
        "p": [json.dumps({"op": "save", "seconds": 0.004})],
        "rld": [json.dumps({"op": "load", "seconds": 0.002})],
    }
    e = EngineSide.of(metrics, hooks)
    assert e.p_queue_s == pytest.approx(0.005)  # both in (0, 0.01]: rank 1 of 2, half way
    assert e.p_prefill_step_s == pytest.approx(0.02 + 0.03 / 2)
    assert e.kv_copy_out_s == 0.004 and e.load_s == {"rld": 0.002}
    assert e.first_decode_s == {"rld": pytest.approx(0.005)}


def test_the_demo_text_report_prints_the_table() -> None:
    times = [RequestTimes(ttft_s=0.1, sent_s=0.002, first_token_s=0.0995, source="rld", ship_s=0.03)]
    report: dict[str, Any] = stage_table(times, ENGINE)
    rows = dict(stage_rows(report))
    assert rows["TTFT stage: transfer_fast_path"] == "30.0 ms"
    assert rows["router's share of median TTFT"].startswith("2.5%")
    report.update(
        ttft_s={"baseline": {"p50": 0.2, "p90": 0.3, "p99": 0.4}},
        requests=1,
        failed=0,
        token_mismatches=0,
        wan_bytes=0,
        wan_bytes_expected=0,
        drc_hit_rate=0.0,
        vllm_prefix_cache_hit_rate=0.0,
        codec={"name": "raw", "ratio": 1.0, "bytes_saved": 0},
        dtype="float32",
    )
    text = table(report)
    assert "TTFT stage: first_decode" in text and "TTFT stages sum / median TTFT" in text


def test_the_latency_buckets_resolve_milliseconds() -> None:
    assert LATENCY_BUCKETS_S[:3] == [0.001, 0.002, 0.003] and sorted(LATENCY_BUCKETS_S) == LATENCY_BUCKETS_S


# -- the router's own stamps: a real Router (vLLM backend) against a loopback stand-in ----------

MD_FIRST_TOKEN_S = 0.3  # MD's stand-in holds its first token this long


async def _stand_in(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """P answers its prefill at once; MD streams its tokens after ``MD_FIRST_TOKEN_S``."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")
        )
        body = json.loads(await reader.readexactly(length))
        if not body.get("stream"):
            reply = json.dumps({"choices": [{"token_ids": [7], "finish_reason": "length"}]}).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                % len(reply)
            )
            writer.write(reply)
            await writer.drain()
            return
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        await asyncio.sleep(MD_FIRST_TOKEN_S)
        n = int(body["max_tokens"])
        for i in range(n):
            line = {"choices": [{"token_ids": [5 + i], "finish_reason": "length" if i == n - 1 else None}]}
            c = f"data: {json.dumps(line)}\n\n".encode()
            writer.write(f"{len(c):x}\r\n".encode() + c + b"\r\n")
        end = b"data: [DONE]\n\n"
        writer.write(f"{len(end):x}\r\n".encode() + end + b"\r\n0\r\n\r\n")
        await writer.drain()
    finally:
        writer.close()


def test_router_trace_stamps_split_its_own_time_from_the_engines() -> None:
    async def main() -> dict[str, Any]:
        server = await asyncio.start_server(_stand_in, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        cfg = RouterConfig(
            engine="vllm", vllm=VllmEngineConfig(p_url=url, md_url=url, model="m"), deadline_s=10
        )
        router = Router(cfg)
        try:
            sent = time.monotonic()
            first = None
            final: dict[str, Any] = {}
            async for ev in router.generate(
                [1, 2, 3], SamplingParams(max_tokens=3), pipeline="p_md", arrived=sent
            ):
                if isinstance(ev, RequestEnd):
                    final = ev.to_dict()
                elif first is None:
                    first = time.monotonic()
            assert first is not None
            return {"trace": final["trace"], "client_ttft": first - sent}
        finally:
            await router.backend.http.aclose()  # type: ignore[attr-defined]
            server.close()

    got = asyncio.run(main())
    trace, client_ttft = got["trace"], got["client_ttft"]
    assert trace["outcome"] == "finished", trace
    s = trace["stamps_s"]
    assert 0.0 <= s["entered"] <= s["placed"] <= s["sent"] <= s["first_token"] <= client_ttft
    assert s["first_token"] - s["sent"] >= MD_FIRST_TOKEN_S  # MD's wait is MD's, not the router's
    t = RequestTimes.of(trace, client_ttft, {})
    assert t is not None and t.source == "md" and t.ship_s is None
    out = stage_table([t], EngineSide())
    assert out["router_ttft_share"] < 1.0 - MD_FIRST_TOKEN_S / client_ttft + 1e-9
