"""``pddlink demo --lab compose``: the demo's two deployments as containers of the compose lab.

``open_lab`` builds the images (cached: seconds when nothing changed), brings a compose lab up with
the demo's WAN profile and measures that WAN from inside it (ping and iperf3 between the p and md
containers). ``ComposeDeployment`` stands where ``harness.cluster.Cluster`` stands in the demo: on
entry it writes the role configs for the run's ``ClusterSpec`` (mTLS on, the same knobs the
namespaced deployment passes as flags) and starts the router, P, RLD and MD containers with them;
the demo reaches the router and the sidecars' admin HTTP through unix sockets in a directory
mounted into the containers. On exit it removes those containers and keeps their logs in the run
directory. The lab (networks, relay) lives across both runs, as the namespaced lab does.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import asdict
from types import TracebackType
from typing import Any

from harness.cluster import ClusterSpec
from netlab.compose import engine as engines
from netlab.compose import images
from netlab.compose.lab import ComposeLab, list_labs
from netlab.profile import Profile


def _toml(table: dict[str, Any]) -> str:
    lines, sections = [], []
    for key, value in table.items():
        if isinstance(value, dict):
            sections.append((key, value))
        else:
            lines.append(f"{key} = {_value(value)}")
    for name, sub in sections:
        lines += ["", f"[{name}]", *(f"{k} = {_value(v)}" for k, v in sub.items())]
    return "\n".join(lines) + "\n"


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def role_configs(spec: ClusterSpec) -> dict[str, str]:
    """The four roles' TOML files for ``spec`` (what ``Cluster`` passes as flags, as config)."""
    tls = "/pki" if spec.tls else ""
    engine = {"preset": spec.preset, "dtype": spec.dtype, "mode": spec.engine_mode}

    def sidecar(role: str, port: int, blocks: int, **extra: Any) -> dict[str, Any]:
        return {
            "role": role,
            "peer_id": f"{role}0",
            "host": "0.0.0.0",
            "grpc_port": port,
            **({"kv_port": port + 10} if role != "p" else {}),
            "admin_unix": f"/run/pddlink/{role}.admin.sock",
            "tls_dir": tls,
            **extra,
            "engine": {**engine, "num_blocks": blocks},
        }

    router = {
        "p": "p:7442",
        "rld": "rld:7441",
        "md": "md:7440",
        "host": "0.0.0.0",
        "grpc_port": 7443,
        "unix": "/run/pddlink/router.sock",
        "tls_dir": tls,
        "relay_enabled": spec.relay,
        "line_mbit": spec.line_mbit,
        "rtt_ms": spec.rtt_ms,
        "rld_capacity": spec.rld_capacity,
        "rld_tpot_s": spec.rld_tpot_s,
        "relay_min_wan_s": spec.relay_min_wan_s,
        "deadline_s": spec.deadline_s,
        # the run's policy, said explicitly as ``Cluster`` passes --recompute/--no-recompute: the
        # router's defaults (recompute and admission on) would let the P->MD baseline recompute on
        # MD instead of shipping every prompt over the WAN
        "recompute": spec.recompute,
        "admission": spec.admission,
        **({"md_tpot_s": spec.md_tpot_s} if spec.md_tpot_s else {}),
        "slo_ttft_ms": spec.slo_ttft_ms,
        "slo_tpot_ms": spec.slo_tpot_ms,
        **({"rld_token_budget": spec.rld_token_budget} if spec.rld_token_budget < 1 else {}),
    }
    return {
        "md": _toml(sidecar("md", 7440, 4096)),
        "rld": _toml(
            {
                **sidecar("rld", 7441, 2048, peers={"md_grpc": "md:7440"}),
                "decode": {"capacity": spec.rld_capacity, "slice_tokens": spec.slice_tokens},
            }
        ),
        "p": _toml(
            sidecar(
                "p",
                7442,
                4096,
                peers={
                    "md_grpc": "md:7440",
                    "md_kv": "md:7450",
                    "rld_grpc": "rld:7441",
                    "rld_kv": "rld:7451",
                },
                data_plane={"wan_line_mbit": spec.line_mbit},  # as Cluster's --wan-line-mbit
            )
        ),
        "router": _toml(router),
    }


class ComposeDeployment:
    """Router, P, RLD and MD as containers of ``lab``, configured from ``spec``."""

    def __init__(self, lab: ComposeLab, spec: ClusterSpec) -> None:
        self.lab, self.spec = lab, spec
        self.config_dir = spec.run_dir / "config"
        self.sock_dir = spec.run_dir / "sock"
        self.router_target = f"unix:{self.sock_dir / 'router.sock'}.grpc"

    def admin_socket(self, role: str) -> str:
        return str(self.sock_dir / f"{role}.admin.sock")

    def __enter__(self) -> ComposeDeployment:
        self.config_dir.mkdir(parents=True, exist_ok=True)
        for role, text in role_configs(self.spec).items():
            (self.config_dir / f"{role}.toml").write_text(text)
        try:
            self.lab.deploy(self.config_dir, self.sock_dir, timeout_s=self.spec.start_timeout_s)
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop()

    def _stop(self) -> None:
        self.lab.undeploy()
        for log in (self.lab.record.directory / "logs").glob("*.log"):
            shutil.copy2(log, self.spec.run_dir / log.name)


def open_lab(
    profile: Profile, name: str, say: Callable[[str], None]
) -> tuple[ComposeLab, type[ComposeDeployment], dict[str, Any]]:
    """Build (cached), bring the compose lab up and measure its WAN: (lab, deployment, figures)."""
    engine = engines.ensure_engine()
    try:
        result = images.build(engine, say)
    except BaseException:
        if engine.own and not list_labs():  # (another lab may be using this engine)
            engines.stop_engine()
        raise
    say(f"images: {result.image} in {result.seconds:.1f} s (base made: {result.base_made})")
    lab = ComposeLab.up(profile, name=name)
    try:
        wan = lab.measure_wan()
    except BaseException:
        lab.down()
        raise
    say(
        f"compose lab {name}: WAN measured inside it: RTT {wan.rtt_ms:.2f} ms"
        f" (profile {wan.rtt_ms_profile:g}), rate {wan.rate_mbit:.2f} Mbit/s of IP bytes"
        f" (profile {wan.rate_mbit_profile:g})"
    )
    figures = {"wan_measured": {**asdict(wan), "within_5_percent": wan.within(0.05)}}
    return lab, ComposeDeployment, {**figures, "image_build_s": round(result.seconds, 1)}
