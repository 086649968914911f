"""Profiles: TOML keys, per-direction overrides, validation naming the bad field, round trips."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netlab.netem import tc_command
from netlab.profile import (
    DirectionSpec,
    GilbertElliott,
    Outage,
    Profile,
    builtin_profiles,
    load_profile,
    parse_profile,
    profile_to_toml,
)
from pddlink.errors import ConfigError


def test_link_table_applies_both_ways_and_direction_tables_override() -> None:
    p = parse_profile(
        """
        [link]
        delay_ms = 15
        loss = 0.01
        rate_mbit = 200
        queue_packets = 1000
        [b_to_a]
        loss = 0.0
        """
    )
    assert p.a_to_b == DirectionSpec(delay_ms=15.0, loss=0.01, rate_mbit=200.0, queue_packets=1000)
    assert p.b_to_a.loss == 0.0 and p.b_to_a.delay_ms == 15.0
    assert p.rtt_ms == 30.0  # delay_ms is one-way


def test_builtin_profiles_load_and_the_1000km_line_is_about_30ms() -> None:
    names = builtin_profiles()
    assert {"metro", "wan-1000km", "lossy-longhaul", "clean"} <= set(names)
    assert 25.0 <= load_profile("wan-1000km").rtt_ms <= 35.0
    lossy = load_profile("lossy-longhaul")
    assert lossy.a_to_b.gilbert_elliott is not None and lossy.a_to_b.loss > 0


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("[link]\nloss = 1.5", "link.loss"),
        ("[link]\nloss = -0.1", "link.loss"),
        ("[link]\ndelay_ms = -1", "link.delay_ms"),
        ("[link]\ndelay_ms = 'far'", "link.delay_ms"),
        ("[link]\nlos = 0.1", "link.los"),
        ("[link]\nrate_mbit = 1e300", "link.rate_mbit"),
        ("[link]\nqueue_packets = 10.5", "link.queue_packets"),
        ("[link]\ndistribution = 'cauchy'\njitter_ms = 1", "link.distribution"),
        ("[link]\nreorder = 0.1", "link.reorder"),
        ("[link]\n[a_to_b]\nduplicate = 2", "a_to_b.duplicate"),
        ("[link]\n[link.gilbert_elliott]\np = 0.1", "link.gilbert_elliott.r"),
        ("[link]\n[link.gilbert_elliott]\np = 0.1\nr = 0", "link.gilbert_elliott.r"),
        ("[link]\n[[outage]]\nstart_s = 1", "outage[0].duration_s"),
        ("[link]\n[[outage]]\nstart_s = 1\nduration_s = 2\ndirection = 'up'", "outage[0].direction"),
        ("[lnk]\ndelay_ms = 1", "lnk"),
        ("seed = 'x'\n[link]", "seed"),
        ("mtu_bytes = 100000\n[link]", "mtu_bytes"),
        ("mtu_bytes = 1500.5\n[link]", "mtu_bytes"),
        ("", "link"),
    ],
)
def test_bad_values_are_refused_naming_the_field(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_profile(text)
    assert f"profile field {field}:" in err.value.message


def test_invalid_toml_and_unknown_names_are_refused() -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse_profile("[link\n")
    with pytest.raises(ConfigError, match="built-in"):
        load_profile("no-such-profile")
    with pytest.raises(ConfigError, match="does not exist"):
        load_profile("/nonexistent/x.toml")


probability = st.floats(0.0, 1.0, allow_nan=False)
direction_specs = st.builds(
    DirectionSpec,
    delay_ms=st.floats(1.0, 100.0),
    jitter_ms=st.floats(0.0, 5.0),
    distribution=st.sampled_from(["normal", "uniform", "pareto"]),
    loss=probability,
    gilbert_elliott=st.none() | st.builds(GilbertElliott, p=probability, r=st.floats(0.01, 1.0)),
    reorder=probability,
    duplicate=probability,
    corrupt=probability,
    rate_mbit=st.floats(0.0, 100_000.0),
    queue_packets=st.integers(0, 100_000),
)


@settings(max_examples=60, deadline=None)
@given(a=direction_specs, b=direction_specs, seed=st.integers(0, 2**31))
def test_any_profile_round_trips_through_toml(a: DirectionSpec, b: DirectionSpec, seed: int) -> None:
    profile = Profile(a, b, (Outage(1.0, 2.5, "a_to_b"),), seed=seed, name="x", mtu_bytes=9000)
    assert parse_profile(profile_to_toml(profile)) == profile


def test_netem_command_carries_the_same_direction() -> None:
    p = parse_profile(
        "[link]\ndelay_ms = 15\nloss = 0.001\nrate_mbit = 1000\nqueue_packets = 2000\n[b_to_a]\nloss = 0"
    )
    a = tc_command(p, "a_to_b", "eth1")
    assert a[:7] == ["tc", "qdisc", "replace", "dev", "eth1", "root", "netem"]
    assert "delay" in a and a[a.index("delay") + 1] == "15ms"
    assert a[a.index("loss") + 1 : a.index("loss") + 3] == ["random", "0.1%"]
    assert a[a.index("rate") + 1] == "1000mbit" and a[a.index("limit") + 1] == "2000"
    assert "loss" not in tc_command(p, "b_to_a", "eth1")
    with pytest.raises(ConfigError, match="outage"):
        tc_command(parse_profile("[link]\n[[outage]]\nstart_s = 0\nduration_s = 1"), "a_to_b", "eth1")
