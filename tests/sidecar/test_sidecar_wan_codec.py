"""The WAN codec through real sidecar processes: P compresses bf16 KV for a 16 Mbit/s line, MD's
KV server decodes it, and MD's tokens equal one engine generating alone (the codec is lossless all
the way into MD's pool). The counters say which codec carried the bytes and what it saved."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engines_adapter import SamplingParams, load_engine
from harness.cluster import Cluster, ClusterSpec, NoWan
from harness.demo_load import replay
from harness.demo_workload import DemoRequest
from pddlink.serving.http import fetch

pytestmark = pytest.mark.timeout(240)
DTYPE = "bfloat16"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    spec = ClusterSpec(tmp_path_factory.mktemp("codec"), relay=False, dtype=DTYPE, line_mbit=16.0)
    with Cluster(NoWan(), spec) as c:  # type: ignore[arg-type]
        yield c


def _requests() -> list[DemoRequest]:
    rng = random.Random(3)
    return [
        DemoRequest(
            i,
            1.5 * i,  # one at a time: MD decodes each alone, as the reference does
            tuple(rng.randrange(1, 2048) for _ in range(rng.randrange(40, 160))),
            SamplingParams(seed=i, temperature=0.8 if i % 2 else 0.0, top_p=0.95, max_tokens=8),
        )
        for i in range(3)
    ]


def _reference(requests: list[DemoRequest]) -> list[list[int]]:
    engine = load_engine("torch_ref", preset="tiny", dtype=DTYPE, block_size=16, num_blocks=1024)
    out = []
    for r in requests:
        toks = [engine.prefill(f"x{r.index}", list(r.prompt), r.sampling).token_id]
        while not engine.is_finished(f"x{r.index}"):  # type: ignore[attr-defined]
            toks.append(engine.decode([f"x{r.index}"])[0].token_id)
        engine.release(f"x{r.index}")
        out.append(toks)
    return out


def _p_counters(cluster: Cluster) -> dict[tuple[str, str], float]:
    code, text = fetch("unix:" + cluster.admin_socket("p"), "GET", "/metrics")
    assert code == 200
    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            if s.name.startswith("pddlink_kv_") and s.labels.get("path") == "wan":
                out[(s.name, s.labels.get("codec", ""))] = s.value
    return out


def test_bf16_kv_crosses_compressed_and_md_generates_exactly(cluster: Cluster) -> None:
    reqs = _requests()
    results = asyncio.run(replay(cluster.router_target, reqs, deadline_s=30.0, pipeline="p_md"))
    expected = _reference(reqs)
    for r in results:
        assert r.outcome == "finished", (r.reason, r.trace)
        assert r.tokens == expected[r.index]
        assert r.trace["compression_ratio"] > 1.2, r.trace
    c = _p_counters(cluster)
    raw = c[("pddlink_kv_codec_raw_bytes_total", "planes_zstd")]
    wire = c[("pddlink_kv_wire_bytes_total", "planes_zstd")]
    assert raw == c[("pddlink_kv_bytes_total", "")] == sum(r.trace["wan_bytes"] for r in results)
    assert raw / wire > 1.2  # reference-engine bf16 KV
    code, body = fetch("unix:" + cluster.admin_socket("p"), "GET", "/status")
    assert code == 200 and b'"mode": "auto"' in body
