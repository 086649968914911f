"""P, RLD and MD sidecars and the router as real processes on loopback (no WAN emulation here; the
netlab runs are in tests/e2e): every pipeline produces exactly the tokens of one engine generating
alone, the handoff happens, and the admin endpoints answer (``/metrics`` parses with the
Prometheus client's own parser and carries the metrics the issue names)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engines_adapter import SamplingParams, load_engine
from harness.cluster import Cluster, ClusterSpec, NoWan
from harness.demo_load import RequestResult, replay
from harness.demo_workload import DemoRequest
from pddlink.serving.http import fetch
from pddlink.transport import PeerIdentity, load_or_create_pki

pytestmark = [pytest.mark.process, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    spec = ClusterSpec(tmp_path_factory.mktemp("sidecars"), relay=True, slice_tokens=4, rld_capacity=8)
    with Cluster(NoWan(), spec) as c:  # type: ignore[arg-type]
        yield c


def reference(requests: list[DemoRequest]) -> list[list[int]]:
    engine = load_engine("torch_ref", preset="tiny", dtype="float64", block_size=16, num_blocks=1024)
    out = []
    for r in requests:
        first = engine.prefill(f"x{r.index}", list(r.prompt), r.sampling)
        toks = [first.token_id]
        while not engine.is_finished(f"x{r.index}"):  # type: ignore[attr-defined]
            toks.append(engine.decode([f"x{r.index}"])[0].token_id)
        engine.release(f"x{r.index}")
        out.append(toks)
    return out


def make_requests(n: int, seed: int, min_tokens: int = 6) -> list[DemoRequest]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, 2048) for _ in range(64)]
    return [
        DemoRequest(
            i,
            0.05 * i,
            tuple(shared + [rng.randrange(1, 2048) for _ in range(rng.randrange(20, 120))]),
            SamplingParams(
                seed=i,
                temperature=0.9 if i % 2 else 0.0,
                top_k=50,
                max_tokens=rng.randrange(min_tokens, min_tokens + 24),
            ),
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("pipeline", ["p_md", "p_rld_md", "singular"])
def test_pipeline_tokens_equal_one_engine_alone(cluster: Cluster, pipeline: str) -> None:
    # on P->RLD->MD, outputs long enough that RLD is still decoding when MD holds the KV
    reqs = make_requests(4, seed=len(pipeline), min_tokens=200 if pipeline == "p_rld_md" else 6)
    results: list[RequestResult] = asyncio.run(
        replay(cluster.router_target, reqs, deadline_s=30.0, pipeline=pipeline)
    )
    expected = reference(reqs)
    for r in results:
        assert r.outcome == "finished", (r.reason, r.trace)
        assert r.tokens == expected[r.index]
        assert r.trace["pipeline"] == pipeline
    sources = {s for r in results for s in r.sources}
    if pipeline == "p_md":
        assert sources == {"md"} and all(r.trace["wan_bytes"] > 0 for r in results)
    if pipeline == "singular":
        assert sources == {"rld"} and all(r.trace["wan_bytes"] == 0 for r in results)
    if pipeline == "p_rld_md":
        assert all(
            r.trace["handoff_outcome"] in ("handed_off", "finished_on_rld", "not_started") for r in results
        )
        assert any(r.trace["handoff_outcome"] == "handed_off" for r in results)
        assert "rld" in sources


def test_admin_endpoints_and_metrics(cluster: Cluster) -> None:
    asyncio.run(replay(cluster.router_target, make_requests(3, seed=7), deadline_s=30.0, pipeline="p_rld_md"))
    md = "unix:" + cluster.admin_socket("md")
    assert fetch(md, "GET", "/healthz")[0] == 200
    status, body = fetch(md, "GET", "/status")
    assert status == 200 and json.loads(body)["role"] == "md"
    status, body = fetch(md, "GET", "/drc/stats")
    assert status == 200 and json.loads(body)["cached_blocks"] > 0
    prompt = list(make_requests(1, seed=7)[0].prompt)
    status, body = fetch(md, "POST", "/drc/match", json.dumps({"tokens": prompt}).encode())
    assert status == 200 and json.loads(body)["matched_tokens"] >= 64
    assert fetch(md, "POST", "/drc/match", b'{"tokens": "x"}')[0] == 400
    status, snap = fetch(md, "GET", "/drc/snapshot")
    assert status == 200 and len(snap) > 32
    # P's own prefix cache is a DRC too: it holds the prompts it prefilled, and the router mirrors it
    p = "unix:" + cluster.admin_socket("p")
    status, body = fetch(p, "POST", "/drc/match", json.dumps({"tokens": prompt}).encode())
    assert status == 200 and json.loads(body)["matched_tokens"] == len(prompt) // 16 * 16
    assert fetch("unix:" + cluster.admin_socket("rld"), "GET", "/drc/stats")[0] == 404
    status, body = fetch("unix:" + cluster.router_unix, "GET", "/status")
    assert status == 200 and json.loads(body)["p_mirror"]["blocks"] >= len(prompt) // 16

    families: dict[str, set[tuple[tuple[str, str], ...]]] = {}
    for sock in (
        "unix:" + cluster.router_unix,
        md,
        "unix:" + cluster.admin_socket("p"),
        "unix:" + cluster.admin_socket("rld"),
    ):
        status, text = fetch(sock, "GET", "/metrics")
        assert status == 200
        for fam in text_string_to_metric_families(text.decode()):
            for s in fam.samples:
                if s.value:
                    families.setdefault(s.name, set()).add(tuple(sorted(s.labels.items())))
    assert ("pipeline", "p_rld_md") in {
        kv for labels in families["pddlink_ttft_seconds_count"] for kv in labels
    }
    paths = {dict(labels).get("path") for labels in families["pddlink_kv_bytes_total"]}
    assert {"wan", "fast"} <= paths
    assert "pddlink_handoffs_total" in families and "pddlink_drc_hit_blocks_total" in families
    assert "pddlink_fast_path_info" in families


def test_p_status_shows_links(cluster: Cluster) -> None:
    status, body = fetch("unix:" + cluster.admin_socket("p"), "GET", "/status")
    doc = json.loads(body)
    assert status == 200 and doc["role"] == "p" and doc["fast_path"]["kind"] == "tcp"
    assert any(link["connected"] for link in doc["links"])


def test_ping_and_status_commands(cluster: Cluster) -> None:
    from click.testing import CliRunner

    from pddlink.cli.diag import ping, status

    runner = CliRunner()
    md = f"127.0.0.1:{cluster.ports['md_grpc']}"
    diag = cluster.pki_dir / "diag-ping"
    res = runner.invoke(ping, [md, "--count", "3", "--tls-dir", str(diag)])
    assert res.exit_code != 0 and not (diag / "diag-ping.key").exists()  # ping never mints an identity
    load_or_create_pki(cluster.pki_dir, [PeerIdentity("diag", "ping")])  # the operator issues one
    res = runner.invoke(ping, [md, "--count", "3", "--json", "--tls-dir", str(diag)])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["role"] == "md" and doc["wire_version"] >= 1 and doc["hash_scheme"] == 1
    # the cluster runs gRPC and the data plane with mutual TLS 1.3: the identity seen in the handshake
    assert (doc["tls_identity"], doc["tls_version"]) == ("pddlink://md/md0", "TLSv1.3")
    res = runner.invoke(ping, [md, "--tls-dir", str(diag), "--expect", "rld/rld0"])
    assert res.exit_code != 0 and "expected peer pddlink://rld/rld0" in str(res.exception or res.output)
    assert doc["rtt_ms"]["min"] > 0 and doc["bandwidth_mbit_per_s"] > 0
    res = runner.invoke(
        status, ["unix:" + cluster.router_unix, "unix:" + cluster.admin_socket("md"), "--json"]
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert (
        "drc_mirror" in doc["unix:" + cluster.router_unix]
        and "drc" in doc["unix:" + cluster.admin_socket("md")]
    )
    res = runner.invoke(status, ["unix:/nonexistent.sock"])
    assert res.exit_code == 1 and "unreachable" in res.output


def test_every_role_runs_mutual_tls_with_its_own_node_directory(cluster: Cluster) -> None:
    """What the demo brings up (same Cluster): each process gets a node directory without the CA
    key, and the callers each sidecar saw were authenticated by certificate (router, P, RLD)."""
    for role in ("p", "rld", "md", "router"):
        argv = cluster._argv(role)
        tls_dir = argv[argv.index("--tls-dir") + 1]
        assert sorted(p.name for p in Path(tls_dir).iterdir()) == [
            "ca.pem",
            f"{role}-{role}0.key",
            f"{role}-{role}0.pem",
        ]
    callers = {}
    for role in ("p", "rld", "md"):
        _, body = fetch("unix:" + cluster.admin_socket(role), "GET", "/status")
        callers[role] = set(json.loads(body)["grpc_tls"]["callers"])
    assert "pddlink://router/router0" in callers["p"] & callers["rld"] & callers["md"]
    assert {"pddlink://p/p0"} <= callers["md"] and "local" not in callers["md"]
