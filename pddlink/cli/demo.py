"""``pddlink demo``: the end-to-end demonstration (see ``harness.demo``)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import click


@click.command(name="demo")
@click.option(
    "--requests", default=200, show_default=True, help="Requests per run (each run replays them all)."
)
@click.option("--rate", "rate_rps", default=4.0, show_default=True, help="Mean arrival rate, requests/s.")
@click.option(
    "--trace", type=click.Path(exists=True, dir_okay=False), help="Replay a Mooncake/pddlink trace."
)
@click.option(
    "--workload", type=click.Path(exists=True, dir_okay=False), help="Workload file (agentic-v1 format)."
)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the figures as JSON here.")
@click.option(
    "--plot",
    "plot_path",
    help="TTFT plot (PNG) [next to --json FILE, else out/pddlink-demo-ttft.png].",
)
@click.option(
    "--scenario",
    type=click.Choice(["default", "wan-overload"]),
    default="default",
    show_default=True,
    help="wan-overload: the line sized to carry half of what the missing suffixes need (PDD with "
    "recompute and admission); any --trace/--workload replays in that regime.",
)
@click.option(
    "--topology",
    "topology_path",
    type=click.Path(exists=True, dir_okay=False),
    help="Pools: run this topology (TOML [topology]) once per placement policy (with --engine vllm: its "
    "shape, each instance a vLLM server).",
)
@click.option(
    "--placement",
    "placements",
    default="prefix_aware,round_robin,prefix_hash",
    show_default=True,
    help="--topology: the placement policies to run, comma-separated.",
)
@click.option(
    "--slo-ttft-ms",
    type=click.FloatRange(min=0, min_open=True),
    default=2000.0,
    show_default=True,
    help="TTFT SLO: goodput counts the requests per second meeting both SLOs; on wan-overload PDD's "
    "router holds it (the bounded run).",
)
@click.option(
    "--slo-tpot-ms",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    show_default=True,
    help="TPOT SLO (mean time per output token after the first; the tiny engine decodes one in 1.4-2.2 "
    "ms here with MD on a CPU of its own); on wan-overload the bounded PDD run's decode-speed bound.",
)
@click.option(
    "--md-prefill-slowdown",
    type=click.FloatRange(1.0, 100.0),
    default=1.0,
    show_default=True,
    help="MD's chips prefill this many times slower than P's (decode-leaning, the deployment PDD is "
    "for; emulated by MD's engine: engine.prefill_slowdown); the simulator's prediction models the same.",
)
@click.option(
    "--routers",
    default=1,
    show_default=True,
    type=click.IntRange(1, 8),
    help="--topology: N > 1 replays the workload through one router, then through N routers behind "
    "HAProxy (routers as replicas; --placement's first policy).",
)
@click.option(
    "--rolling-restart",
    is_flag=True,
    help="--topology: behind HAProxy with etcd membership, restart every process one at a time "
    "(SIGTERM, start again, wait until it serves) under a steady --rate load (harness.demo_rolling).",
)
@click.option(
    "--etcd-outage-s",
    type=click.FloatRange(min=0),
    default=0.0,
    help="--topology: the same load twice behind HAProxy, the second time with etcd stopped this long.",
)
@click.option("--seed", default=1, show_default=True, help="Workload seed.")
@click.option("--line-mbit", default=16.0, show_default=True, help="WAN line rate.")
@click.option("--rtt-ms", default=20.0, show_default=True, help="WAN round-trip time.")
@click.option("--warmup", default=16, show_default=True, help="Requests replayed first to warm the caches.")
@click.option(
    "--rld-token-budget",
    type=click.FloatRange(min=0, max=1, min_open=True),
    default=None,
    help="--topology: no new relay while RLD made this share of the recent output tokens (1: no budget; "
    "default: 0.25, RLD as the small tier the design sizes it).",
)
@click.option(
    "--engine-mode",
    type=click.Choice(["thread", "process"]),
    default="thread",
    show_default=True,
    help="Each sidecar's engine: a worker thread, or a child process over the engine link.",
)
@click.option(
    "--lab",
    "lab_kind",
    type=click.Choice(["auto", "netns", "loopback", "compose"]),
    default="auto",
    show_default=True,
    help="netlab lab: auto (netns as root, else loopback), or compose: every role in a container"
    " (root, docker.io; builds the images first, cached).",
)
@click.option(
    "--engine",
    type=click.Choice(["reference", "vllm"]),
    default="reference",
    show_default=True,
    help="reference: pddlink's own engine, P/RLD/MD/router; vllm: P, RLD and MD as vLLM servers beside "
    "their sidecars (--lab compose: each in containers, with the router).",
)
@click.option("--model", help="vllm: a model directory to serve (default: a tiny random Llama built here).")
@click.option(
    "--dtype",
    type=click.Choice(["float32", "bfloat16", "float16"]),
    default="float32",
    show_default=True,
    help="vllm: the model's dtype.",
)
@click.option("--engine-args", default="", help="vllm: extra vLLM server arguments (e.g. for a GPU).")
@click.option("--sessions", default=10, show_default=True, help="vllm: conversations replayed.")
@click.option("--turns", default=5, show_default=True, help="vllm: turns per conversation.")
@click.option(
    "--concurrent", is_flag=True, help="vllm: run the conversations at once (default: one request at a time)."
)
def command(
    requests: int,
    rate_rps: float,
    trace: str | None,
    workload: str | None,
    json_path: str | None,
    plot_path: str | None,
    scenario: str,
    topology_path: str | None,
    placements: str,
    slo_ttft_ms: float,
    slo_tpot_ms: float,
    md_prefill_slowdown: float,
    routers: int,
    rolling_restart: bool,
    etcd_outage_s: float,
    seed: int,
    line_mbit: float,
    rtt_ms: float,
    warmup: int,
    rld_token_budget: float | None,
    engine_mode: str,
    lab_kind: str,
    engine: str,
    model: str | None,
    dtype: str,
    engine_args: str,
    sessions: int,
    turns: int,
    concurrent: bool,
) -> None:
    """Run P, RLD, MD and the router across an emulated WAN; compare PDD with the P->MD baseline.

    Starts every role as its own process (P and RLD in datacenter A, MD in datacenter B of a
    netlab WAN: network namespaces as root, loopback relays otherwise), replays the workload once
    as cross-datacenter PD (P->MD only) and once with PDD (wan-overload: also PDD recomputing
    without the TPOT bound), checks every token against one engine generating alone, and prints
    the table with TTFT, output speed and goodput (requests/s meeting both SLOs). Progress and
    logs go to stderr.
    """
    if md_prefill_slowdown > 1 and (engine == "vllm" or topology_path is not None or lab_kind == "compose"):
        raise click.BadParameter(
            "the reference engine's pair demo only (not --engine vllm, --topology or --lab compose)",
            param_hint="--md-prefill-slowdown",
        )
    if engine == "vllm" and topology_path is not None:
        if lab_kind not in ("auto", "loopback") or routers > 1 or rolling_restart or etcd_outage_s:
            raise click.BadParameter(
                "with --engine vllm: a loopback WAN, one router, no rolling restart or etcd outage",
                param_hint="--topology",
            )
        _vllm_pools(topology_path, placements, sessions, turns, seed, engine_args, json_path, plot_path)
        return
    if engine == "vllm":
        from pddlink.cli.demo_vllm import run_vllm_demo

        if lab_kind not in ("auto", "loopback", "compose"):
            raise click.BadParameter("vllm: auto (a loopback WAN) or compose", param_hint="--lab")
        run_vllm_demo(
            lab_kind="compose" if lab_kind == "compose" else "loopback",
            json_path=json_path,
            seed=seed,
            line_mbit=line_mbit,
            rtt_ms=rtt_ms,
            sessions=sessions,
            turns=turns,
            dtype=dtype,
            model=model,
            engine_args=engine_args,
            concurrent=concurrent,
        )
        return
    if topology_path is not None and (rolling_restart or etcd_outage_s):
        from harness.demo_rolling import Scenario

        what = Scenario(routers, rolling_restart, etcd_outage_s, rate_rps)
        _rolling(topology_path, placements, what, workload, json_path, plot_path, seed, warmup)
        return
    if topology_path is not None and routers > 1:
        _replicas(topology_path, placements, routers, requests, rate_rps, workload, json_path, seed, warmup)
        return
    if topology_path is not None:
        _pools(
            topology_path, placements, requests, rate_rps, workload, json_path, plot_path, seed, warmup,
            rld_token_budget,
        )  # fmt: skip
        return
    from harness.demo import main
    from harness.demo_report import Slo
    from pddlink.cli.preflight import check_output_file, check_writable

    if requests < 1:
        raise click.BadParameter("must be >= 1", param_hint="--requests")
    if plot_path is None:
        plot = Path(json_path).with_suffix(".png") if json_path else Path("out") / "pddlink-demo-ttft.png"
        plot_path = str(plot)
    # before the lab and four processes come up (minutes): every place the demo writes
    check_output_file(json_path, "demo --json")
    check_output_file(plot_path, "demo --plot")
    check_writable(tempfile.gettempdir(), "demo run directory (TMPDIR)")
    main(
        requests=requests,
        rate_rps=rate_rps,
        trace=trace,
        workload=workload,
        json_path=json_path,
        plot_path=plot_path,
        seed=seed,
        line_mbit=line_mbit,
        rtt_ms=rtt_ms,
        warmup=warmup,
        engine_mode=engine_mode,
        scenario=scenario,
        lab_kind=lab_kind,
        slo=Slo(slo_ttft_ms, slo_tpot_ms),
        md_prefill_slowdown=md_prefill_slowdown,
    )


def _pools(
    topology_path: str,
    placements: str,
    requests: int,
    rate_rps: float,
    workload: str | None,
    json_path: str | None,
    plot_path: str | None,
    seed: int,
    warmup: int,
    rld_token_budget: float | None = None,
) -> None:
    """``--topology``: the pools demo (``harness.demo_pools``)."""
    from harness.demo_pools import main
    from pddlink.cli.preflight import check_output_file
    from pddlink.sim.demo_scale import POOLS_RLD_TOKEN_BUDGET

    topology, policies = _topology_and_policies(topology_path, placements)
    if plot_path is None:
        plot = (
            Path(json_path).with_suffix(".png") if json_path else Path("out") / "pddlink-demo-pools-ttft.png"
        )
        plot_path = str(plot)
    check_output_file(json_path, "demo --json")
    check_output_file(plot_path, "demo --plot")
    main(
        topology=topology,
        topology_path=topology_path,
        requests=requests,
        rate_rps=rate_rps,
        workload=workload,
        json_path=json_path,
        plot_path=plot_path,
        seed=seed,
        warmup=warmup,
        policies=policies,
        rld_token_budget=POOLS_RLD_TOKEN_BUDGET if rld_token_budget is None else rld_token_budget,
    )


def _vllm_pools(
    topology_path: str,
    placements: str,
    sessions: int,
    turns: int,
    seed: int,
    engine_args: str,
    json_path: str | None,
    plot_path: str | None,
) -> None:
    """``--engine vllm --topology``: the pools demo on vLLM servers (``harness.vllm_pools_demo``)."""
    from dataclasses import replace

    from harness.vllm_pools_demo import demo_spec, run
    from pddlink.cli.preflight import check_output_file

    topology, policies = _topology_and_policies(topology_path, placements)
    if plot_path is None:
        default = Path("out") / "pddlink-demo-vllm-pools-ttft.png"
        plot_path = str(Path(json_path).with_suffix(".png") if json_path else default)
    check_output_file(json_path, "demo --json")
    check_output_file(plot_path, "demo --plot")
    spec = replace(demo_spec(sessions, turns, seed, engine_args), policies=tuple(policies))
    run(spec, topology, topology_path, json_path, Path(plot_path))


def _topology_and_policies(topology_path: str, placements: str) -> tuple[Any, list[str]]:
    """``--topology`` loaded and ``--placement`` checked, as click errors naming the option."""
    from pddlink.errors import InvalidInput
    from pddlink.routing import PlacementPolicy
    from pddlink.topology import load_topology

    try:
        topology = load_topology(Path(topology_path))
    except InvalidInput as e:
        raise click.BadParameter(e.message, param_hint="--topology") from None
    policies = [p.strip() for p in placements.split(",") if p.strip()]
    allowed = [p.value for p in PlacementPolicy if p is not PlacementPolicy.ORACLE]
    for p in policies:
        if p not in allowed:
            raise click.BadParameter(f"{p!r}: use {', '.join(allowed)}", param_hint="--placement")
    return topology, policies


def _replicas(
    topology_path: str,
    placements: str,
    routers: int,
    requests: int,
    rate_rps: float,
    workload: str | None,
    json_path: str | None,
    seed: int,
    warmup: int,
) -> None:
    """``--topology F --routers N``: routers as replicas (``harness.demo_replicas``)."""
    from harness.demo_replicas import main
    from harness.lb import LoadBalancerMissing, haproxy_binary
    from pddlink.cli.preflight import check_output_file

    topology, policies = _topology_and_policies(topology_path, placements)
    try:
        haproxy_binary()
    except LoadBalancerMissing as e:
        raise click.ClickException(str(e)) from None
    placement = policies[0] if policies else "prefix_aware"
    check_output_file(json_path, "demo --json")
    main(
        topology=topology,
        topology_path=topology_path,
        routers=routers,
        requests=requests,
        rate_rps=rate_rps,
        workload=workload,
        json_path=json_path,
        seed=seed,
        warmup=warmup,
        placement=placement,
    )


def _rolling(
    topology_path: str,
    placements: str,
    scenario: Any,
    workload: str | None,
    json_path: str | None,
    plot_path: str | None,
    seed: int,
    warmup: int,
) -> None:
    """``--rolling-restart`` / ``--etcd-outage-s``: a fleet that does not stop (``harness.demo_rolling``)."""
    from harness.demo_rolling import default_plot, main
    from harness.etcd_server import etcd_binary
    from harness.lb import haproxy_binary
    from pddlink.cli.preflight import check_output_file
    from pddlink.errors import PddlinkError

    topology, policies = _topology_and_policies(topology_path, placements)
    try:
        haproxy_binary()
        etcd_binary()
    except PddlinkError as e:
        raise click.ClickException(e.message) from None
    check_output_file(json_path, "demo --json")
    check_output_file(plot_path or str(default_plot(json_path)), "demo --plot")
    main(topology=topology, topology_path=topology_path, scenario=scenario, workload=workload,
         json_path=json_path, plot_path=plot_path, seed=seed, warmup=warmup,
         placement=policies[0] if policies else "prefix_aware")  # fmt: skip
