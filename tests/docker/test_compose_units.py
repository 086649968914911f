"""Pieces of the compose lab that need no engine: the relay container's interface lookup, the
lab slots' addresses, and the role configs the demo writes for each deployment."""

from __future__ import annotations

import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from harness.cluster import ClusterSpec
from harness.demo_compose import role_configs
from netlab.compose.lab import LabRecord, check_name
from netlab.compose.relay import interface_in
from pddlink.errors import InvalidInput, LocalError
from pddlink.serving.client_guard import load_key_file
from sidecar.config import load_config

ADDRS = [
    {"ifname": "lo", "addr_info": [{"local": "127.0.0.1", "prefixlen": 8}]},
    {"ifname": "eth0", "addr_info": [{"local": "198.19.241.2", "prefixlen": 24}]},
    {"ifname": "eth1", "addr_info": [{"local": "198.19.240.2", "prefixlen": 24}]},
]


def test_the_relay_finds_each_networks_interface_by_subnet() -> None:
    assert interface_in("198.19.240.0/24", ADDRS) == "eth1"
    assert interface_in("198.19.241.0/24", ADDRS) == "eth0"
    with pytest.raises(LocalError, match=r"198\.19\.250\.0/24"):
        interface_in("198.19.250.0/24", ADDRS)


def test_lab_slots_get_disjoint_subnets_and_bridges() -> None:
    records = [LabRecord(f"l{k}", k) for k in range(8)]
    nets = {r.net(dc) for r in records for dc in ("dc-a", "dc-b")}
    bridges = {r.bridge(dc) for r in records for dc in ("dc-a", "dc-b")}
    assert len(nets) == len(bridges) == 16 and all(len(b) <= 15 for b in bridges)
    assert records[0].addr("md") == "198.19.241.10" and records[1].addr("p") == "198.19.242.10"
    with pytest.raises(InvalidInput):
        check_name("Bad_Name")


def test_demo_role_configs_carry_the_specs_knobs_with_mtls(tmp_path: Path) -> None:
    from pddlink.cli.router import _load

    spec = ClusterSpec(tmp_path, relay=False, line_mbit=16.0, rtt_ms=20.0, rld_capacity=5, slice_tokens=7)
    files = role_configs(spec)
    for role in ("p", "rld", "md"):
        (tmp_path / f"{role}.toml").write_text(files[role])
        cfg = load_config(tmp_path / f"{role}.toml")
        assert cfg.tls_dir == "/pki" and cfg.admin_unix == f"/run/pddlink/{role}.admin.sock"
        assert cfg.engine.dtype == spec.dtype and cfg.engine.mode == spec.engine_mode
    rld = load_config(tmp_path / "rld.toml")
    assert (rld.decode.capacity, rld.decode.slice_tokens) == (5, 7)
    (tmp_path / "router.toml").write_text(files["router"])
    router, serve = _load(str(tmp_path / "router.toml"), {})
    assert router.relay_enabled is False and router.line_mbit == 16.0 and router.rld_capacity == 5
    assert serve["unix"] == "/run/pddlink/router.sock"
    pdd = tomllib.loads(role_configs(replace(spec, relay=True))["router"])
    assert pdd["relay_enabled"] is True
    assert load_config(tmp_path / "p.toml").data_plane.wan_line_mbit == 16.0  # P's codec choice


def test_demo_router_configs_carry_the_runs_policy_not_the_routers_defaults(tmp_path: Path) -> None:
    """The baseline ships every prompt (the issue: the compose router took RouterConfig's defaults,
    recompute and admission on, and its "P->MD baseline" recomputed 122 of 200 prompts on MD)."""
    from pddlink.cli.router import _load

    def router(spec: ClusterSpec) -> Any:
        (tmp_path / "router.toml").write_text(role_configs(spec)["router"])
        return _load(str(tmp_path / "router.toml"), {})[0]

    base = router(ClusterSpec(tmp_path, relay=False))
    assert (base.recompute, base.admission, base.rld_token_budget) == (False, False, 1.0)
    overload = ClusterSpec(
        tmp_path, recompute=True, admission=True, md_tpot_s=0.008, slo_ttft_ms=2000.0,
        slo_tpot_ms=10.0, rld_token_budget=0.08,
    )  # fmt: skip
    pdd = router(overload)
    assert (pdd.recompute, pdd.admission, pdd.rld_token_budget) == (True, True, 0.08)
    assert (pdd.md_tpot_s, pdd.slo_ttft_ms, pdd.slo_tpot_ms) == (0.008, 2000.0, 10.0)


@pytest.mark.root
def test_the_lab_directory_gives_each_role_its_own_random_key_0600(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Like the PKI: each role's key file is made when the lab comes up (never shipped), readable by
    the roles' user only, and mounted alone (keys/<role>/ at /keys)."""
    import os
    import stat

    from netlab.compose import lab as labmod

    if os.geteuid() != 0:
        pytest.skip("needs root (the key files are given to the image's user)")
    monkeypatch.setattr(labmod, "LABS", tmp_path / "labs")
    record = LabRecord("keys", 0)
    labmod._make_directory(record, labmod._profile_source("clean"))
    keys = {}
    for role in labmod.ROLES:
        d = record.directory / "keys" / role
        assert [p.name for p in d.iterdir()] == [labmod.KEY_FILE[role]]
        f = d / labmod.KEY_FILE[role]
        assert stat.S_IMODE(f.stat().st_mode) == 0o600 and stat.S_IMODE(d.stat().st_mode) == 0o700
        assert f.stat().st_uid == labmod.ROLE_UID == d.stat().st_uid
        keys[role] = load_key_file(str(f), role)
    assert len(set(keys.values())) == len(labmod.ROLES)  # one key per role, none shared
    assert labmod.KEY_FILE["router"] == "api-keys" and labmod.KEY_FILE["md"] == "admin-keys"
