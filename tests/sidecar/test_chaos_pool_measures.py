"""``harness.chaos.pool_measures`` (pure) and the pool schedule: whose requests a killed instance
had in flight, which of them it counts as rescued, what a drain failed, the rejoin figure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.chaos.invariants import FaultRecord
from harness.chaos.load import StreamResult
from harness.chaos.pool_measures import history, pool_measures
from harness.chaos.pools import pool_schedule
from harness.chaos.schedule import FaultKind
from pddlink.topology import load_topology

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "topology" / "three-dc.toml"
ROLES = {"p0": "p", "p1": "p", "md0": "md", "md1": "md", "md2": "md"}


def _r(
    i: int, start: float, end: float, outcome: str, placement: dict[str, Any], pipeline: str = "p_md"
) -> StreamResult:
    trace = {"pipeline": pipeline, "placement": {"replaced_from": [], "moved": [], **placement}}
    return StreamResult(
        i, "", start, end, outcome=outcome, reason="" if outcome == "finished" else "md_lost: x", trace=trace
    )


def test_history_reads_final_moves_and_replacements() -> None:
    trace = {
        "placement": {
            "p": "p1",
            "md": "md2",
            "replaced_from": [{"p": "p0", "md": "md0"}],
            "moved": [{"role": "md", "from": "md1", "to": "md2"}],
        }
    }
    assert history(trace, "md") == ["md0", "md1", "md2"] and history(trace, "p") == ["p0", "p1"]


def test_a_killed_md_counts_only_its_own_md_requests_and_rescues_on_another_md() -> None:
    kill = FaultRecord("kill:md0", "kill_instance", "md0", 10.0, 14.0)
    results = [
        _r(
            0,
            9.0,
            12.0,
            "finished",
            {"p": "p0", "md": "md1", "moved": [{"role": "md", "from": "md0", "to": "md1"}]},
        ),
        _r(1, 9.0, 12.0, "failed", {"p": "p0", "md": "md0"}),
        _r(2, 9.0, 12.0, "finished", {"p": "p0", "md": "md0"}),  # still on md0: not rescued
        _r(3, 9.0, 12.0, "finished", {"p": "p0", "md": "md0"}, pipeline="singular"),  # no MD part
        _r(4, 9.0, 12.0, "failed", {"p": "p0", "md": "md2"}),  # another MD's
        _r(5, 11.0, 12.0, "finished", {"p": "p0", "md": "md0"}),  # began after the kill
        _r(6, 9.0, 10.5, "finished", {"p": "p0", "md": "md0"}, pipeline="p_rld_md"),  # RLD alone
    ]
    results[-1].sources = {"rld": 8}
    doc = pool_measures(results, [kill], {"md0": 1.5}, ROLES)
    assert doc["md_kill"]["in_flight"] == 4 and doc["md_kill"]["moved"] == 1
    assert doc["md_kill"]["rld_alone"] == 1  # the kill took nothing from it: not in the share
    assert doc["md_kill_rescued_share"] == round(1 / 3, 4) and doc["md_kill_strict_share"] == 0.25
    assert doc["md_kill"]["failed_reasons"] == {"md_lost": 1}
    assert doc["rejoin_s"] == 1.5


def test_a_request_the_killed_md_finished_itself_just_before_the_kill_is_counted_apart() -> None:
    """Its last token came from the killed MD (a SIGKILLed process sends nothing after) and reached
    the client 7 ms after the kill was recorded: the kill took nothing from it. The same request
    ending 1 s after the kill, or one with a fallback, stays in the share."""
    kill = FaultRecord("kill:md0", "kill_instance", "md0", 10.0, 14.0)
    moved = {"p": "p0", "md": "md1", "moved": [{"role": "md", "from": "md0", "to": "md1"}]}
    results = [
        _r(0, 9.0, 12.0, "finished", moved),
        _r(1, 9.0, 10.007, "finished", {"p": "p0", "md": "md0"}),  # done before the kill landed
        _r(2, 9.0, 11.0, "finished", {"p": "p0", "md": "md0"}),  # too late to have been done before
        _r(3, 9.0, 10.007, "finished", {"p": "p0", "md": "md0"}),  # a fallback: the kill reached it
    ]
    for r in results[1:]:
        r.sources = {"md": 32}
    results[3].trace["fallbacks"] = ["md_lost_rld"]
    doc = pool_measures(results, [kill], {"md0": 1.5}, ROLES)
    assert doc["md_kill"]["in_flight"] == 4 and doc["md_kill"]["done_before_kill"] == 1
    assert doc["md_kill_rescued_share"] == round(1 / 3, 4) and doc["md_kill_strict_share"] == 0.25


def test_a_killed_p_counts_every_finished_request_and_the_moves_apart() -> None:
    kill = FaultRecord("kill:p0", "kill_instance", "p0", 10.0, 14.0)
    results = [
        _r(
            0,
            9.0,
            12.0,
            "finished",
            {"p": "p1", "md": "md1", "moved": [{"role": "p", "from": "p0", "to": "p1"}]},
        ),
        _r(1, 9.0, 12.0, "finished", {"p": "p0", "md": "md1"}),  # prefilled before the kill
        _r(2, 9.0, 12.0, "failed", {"p": "p0", "md": "md1"}),
        _r(3, 9.0, 12.0, "failed", {"p": "p1", "md": "md1"}),  # the other P's
    ]
    doc = pool_measures(results, [kill], {"p0": None}, ROLES)
    assert doc["p_kill"]["in_flight"] == 3 and doc["p_kill_rescued_share"] == round(2 / 3, 4)
    assert doc["p_kill_moved"] == 1
    assert doc["rejoin_s"] is None  # never placed on again: no figure, the check fails


def test_a_drain_counts_failures_on_it_and_requests_placed_on_it_after() -> None:
    drain = FaultRecord("drain:md2", "drain", "md2", 20.0, 25.0)
    results = [
        _r(0, 19.0, 22.0, "finished", {"p": "p0", "md": "md2"}),
        _r(1, 19.0, 22.0, "failed", {"p": "p0", "md": "md2"}),
        _r(2, 22.0, 23.0, "finished", {"p": "p0", "md": "md2"}),  # placed on it during the drain
        _r(3, 19.0, 22.0, "failed", {"p": "p0", "md": "md1"}),  # not on the drained one
        _r(4, 26.0, 27.0, "finished", {"p": "p0", "md": "md2"}),  # after the undrain
    ]
    doc = pool_measures(results, [drain], {}, ROLES)
    assert (doc["drain_failed"], doc["drain_new_placed"], doc["drain"]["in_flight"]) == (1, 1, 3)


def test_the_pool_schedule_kills_one_md_of_two_one_p_of_two_and_drains_another_md() -> None:
    faults = pool_schedule(load_topology(EXAMPLE), 15.0)
    assert [(f.kind, f.target) for f in faults] == [
        (FaultKind.KILL_INSTANCE, "md-b0"),
        (FaultKind.KILL_INSTANCE, "p-a0"),
        (FaultKind.DRAIN, "md-c0"),
    ]
    assert [f.at_share for f in faults] == sorted(f.at_share for f in faults)


def test_cli_topology_runs_the_pools_with_their_defaults(monkeypatch: Any) -> None:
    from click.testing import CliRunner

    import harness.chaos.pools as pools
    import harness.chaos.run as run
    from pddlink.cli.chaos import command

    got: list[dict[str, object]] = []
    monkeypatch.setattr(pools, "main", lambda **kw: got.append(kw))
    monkeypatch.setattr(run, "main", lambda **kw: got.append({"single": True}))
    argv = ["--topology", str(EXAMPLE), "--plot", "/tmp/pddlink-chaos-pools-test.png"]
    out = CliRunner().invoke(command, argv)
    assert out.exit_code == 0, out.output
    [kw] = got
    assert kw["topology_path"] == str(EXAMPLE)
    assert (kw["requests"], kw["concurrency"], kw["deadline_s"], kw["max_output"]) == (360, 32, 15.0, 32)
    refused = CliRunner().invoke(command, [*argv, "--engine", "vllm"])
    assert refused.exit_code == 2 and "--topology" in refused.output
