"""Ship or recompute end to end: MD prefills the prompt from its token ids (no KV on the WAN), alone
or while RelayDecode streams and then hands over by token ids; every token exactly what one engine
generating alone gives. Router, P, RLD and MD as processes across a netlab WAN, as in
``test_e2e_pipeline``."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.cluster import Cluster, ClusterSpec, allowed_cpus, cpu_set, datacenter_cpus
from harness.demo_load import replay
from netlab.lab import Lab
from netlab.profile import parse_profile
from tests.e2e.test_e2e_pipeline import PROFILE, reference, requests

pytestmark = [pytest.mark.e2e, pytest.mark.netlab, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    lab = Lab.up(parse_profile(PROFILE, name="e2e-rc"), name=f"rc{random.randrange(10**6)}")
    try:
        spec = ClusterSpec(
            tmp_path_factory.mktemp("rc"),
            slice_tokens=4,
            rld_capacity=8,
            recompute=True,
            admission=True,
            cpus=datacenter_cpus(),  # as the demo runs it: MD on CPUs of its own
        )
        with Cluster(lab, spec) as c:
            yield c
    finally:
        lab.down()


def test_each_role_runs_on_the_cpus_its_datacenter_owns(cluster: Cluster) -> None:
    want = dict(cluster.spec.cpus)
    if not want:
        pytest.skip("one CPU: nothing to pin")
    for role in ("md", "p"):
        pids = cluster.pids(role)  # the sidecar and its engine process, if any
        assert pids and {allowed_cpus(pid) for pid in pids} == {cpu_set(want[role])}, role
    assert not cpu_set(want["md"]) & cpu_set(want["p"])


# relay_recompute (1024-token outputs, 37 s here) runs in `make test-fleet`; the chaos and demo checks
# compare every relayed request's tokens too
@pytest.mark.parametrize("option", ["recompute", pytest.param("relay_recompute", marks=pytest.mark.fleet)])
def test_md_recomputes_exactly(cluster: Cluster, option: str) -> None:
    long = option == "relay_recompute"  # long enough that MD is ready before RLD has finished
    reqs = requests(4, max_tokens=1024 if long else 24, seed=7 if long else 8, spacing_s=0.3)
    results = asyncio.run(replay(cluster.router_target, reqs, deadline_s=30.0, pipeline=option))
    expected = reference(reqs)
    for r in results:
        assert r.outcome == "finished", (r.reason, r.trace.get("fallbacks"))
        assert r.tokens == expected[r.index]
        t = r.trace
        assert t["option"] == option and t["md_recompute_s"] > 0 and t["wan_bytes"] == 0
        if long:
            assert r.sources.get("rld", 0) >= 1  # RLD streamed at once
        else:
            assert r.sources.get("md", 0) == len(r.tokens)
    if long:  # and MD took over by token ids once its recompute was done
        assert any(r.trace.get("handoff_outcome") == "handed_off" and r.sources.get("md", 0) for r in results)


def test_a_recompute_while_another_decodes_is_that_ones_stall(cluster: Cluster) -> None:
    """MD prefilling the second prompt stood the first's decode still: the first's trace says so
    (``md_stall_s``, what the router's TPOT book takes out of what it learns); each request's own
    recompute, done before its first token, is not its stall. The second arrives 0.4 s after the
    first, whose 1,000 tokens take over a second to decode alone: the second's recompute falls
    inside the first's decode (checked from the traces' own times; with 200 tokens and 0.3 s, a CI
    run found the first already done, MD decoding ~1.2 ms a token alone)."""
    gap_s = 0.4
    reqs = requests(2, max_tokens=1000, seed=12, spacing_s=gap_s)
    first, second = asyncio.run(replay(cluster.router_target, reqs, deadline_s=60.0, pipeline="recompute"))
    assert first.outcome == second.outcome == "finished"
    assert first.ttft_s is not None and second.ttft_s is not None
    # the second's recompute (between its arrival and its first token) within the first's decode
    assert first.ttft_s < gap_s and gap_s + second.ttft_s < first.e2e_s, (first.ttft_s, second.ttft_s)
    assert first.trace["md_stall_s"] == pytest.approx(second.trace["md_recompute_s"], abs=2e-3)
    assert second.trace["md_stall_s"] == 0.0


def test_md_cache_follows_a_recomputed_prompt(cluster: Cluster) -> None:
    """A second request sharing the first's prompt prefix finds it in MD's cache (DRC commit)."""
    first = requests(1, max_tokens=8, seed=11)
    second = [first[0].__class__(0, 0.0, (*first[0].prompt, 5, 6, 7), first[0].sampling)]
    asyncio.run(replay(cluster.router_target, first, deadline_s=30.0, pipeline="recompute"))
    [again] = asyncio.run(replay(cluster.router_target, second, deadline_s=30.0, pipeline="recompute"))
    assert again.outcome == "finished"
    assert again.trace["md_cached_tokens"] >= (len(first[0].prompt) // 16) * 16 - 16


_ = Path


def test_md_gets_the_last_third_of_the_cpus_and_the_rest_share_the_others() -> None:
    assert datacenter_cpus([0]) == ()
    assert dict(datacenter_cpus([0, 1])) == {"md": "1", "p": "0", "rld": "0", "router": "0"}
    assert dict(datacenter_cpus([2, 3, 4, 5, 6, 7])) == {
        "md": "6,7",
        "p": "2,3,4,5",
        "rld": "2,3,4,5",
        "router": "2,3,4,5",
    }
    assert cpu_set("0,2-4") == {0, 2, 3, 4} and cpu_set("7") == {7}
