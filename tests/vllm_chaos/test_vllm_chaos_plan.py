"""``pddlink chaos --engine vllm``'s plan (pure): its schedule kills and restarts each vLLM server
and cuts the WAN shorter and longer than the deadline; its workload is greedy, deterministic, inside
the tiny Llama's vocabulary and model length, mixes the router's own choice with forced pipelines
and shares prefixes; P's legs "moved" only when they shipped more after a restart; the CLI picks
the vLLM defaults the check relies on (>= 200 requests)."""

from __future__ import annotations

from click.testing import CliRunner

from harness.chaos.schedule import FaultKind
from harness.chaos.vllm_faults import legs_moved
from harness.chaos.vllm_run import SYSTEM_TOKENS, VllmChaosSpec, vllm_schedule, workload


def test_schedule_kills_each_vllm_server_and_cuts_the_wan() -> None:
    faults = vllm_schedule(20.0)
    killed = [f.target for f in faults if f.kind is FaultKind.KILL_RESTART]
    assert sorted(killed) == ["md", "p", "rld"]
    outages = sorted(f.duration_s for f in faults if f.kind is FaultKind.WAN_OUTAGE)
    assert outages[0] < 20.0 < outages[-1]
    assert [f.at_share for f in faults] == sorted(f.at_share for f in faults)


def test_workload_is_greedy_deterministic_and_shares_prefixes() -> None:
    a, b = workload(40, 3, 16), workload(40, 3, 16)
    assert a == b and len(a) == 40
    prompts = [r.prompt for r, _ in a]
    assert all(p[:SYSTEM_TOKENS] == prompts[0][:SYSTEM_TOKENS] for p in prompts)
    assert all(max(p) < 1024 and len(p) < 4096 - 16 for p in prompts)
    assert all(r.sampling.temperature == 0.0 and 1 <= r.sampling.max_tokens <= 16 for r, _ in a)
    assert {p for _, p in a} == {"", "p_md", "p_rld_md"}
    assert [r.index for r, _ in a] == list(range(40))


def test_legs_moved_only_when_shipped_grew() -> None:
    at = {"md": {"md": {"shipped": 5}, "rld": {"shipped": 3}}}
    assert legs_moved(at, {"md": {"shipped": 9}, "rld": {"shipped": 3}}) == {"md": {"md": True, "rld": False}}


def test_cli_uses_the_vllm_defaults(monkeypatch) -> None:
    import harness.chaos.vllm_run as vllm_run
    from pddlink.cli.chaos import command

    got: list[VllmChaosSpec] = []
    monkeypatch.setattr(vllm_run, "main", lambda spec, json_path, plot_path: got.append(spec))
    out = CliRunner().invoke(command, ["--engine", "vllm", "--plot", "/tmp/pddlink-vchaos-test.png"])
    assert out.exit_code == 0, out.output
    assert got == [VllmChaosSpec()] and got[0].requests >= 200


def test_cli_keeps_the_reference_defaults(monkeypatch) -> None:
    import harness.chaos.run as run
    from pddlink.cli.chaos import command

    got: list[dict[str, object]] = []
    monkeypatch.setattr(run, "main", lambda **kw: got.append(kw))
    out = CliRunner().invoke(command, ["--plot", "/tmp/pddlink-chaos-test.png", "--requests", "7"])
    assert out.exit_code == 0, out.output
    kw = got[0]
    assert (kw["requests"], kw["concurrency"], kw["deadline_s"], kw["max_output"]) == (7, 50, 10.0, 48)
    assert (kw["line_mbit"], kw["rtt_ms"], kw["engine_mode"]) == (100.0, 20.0, "process")
