"""Link profiles: what the emulated WAN does to packets, per direction, read from TOML.

A profile has a ``[link]`` table that applies to both directions and optional ``[a_to_b]`` /
``[b_to_a]`` tables that override single keys of it; ``[[outage]]`` entries schedule partitions
relative to the moment the lab comes up. ``delay_ms`` is one-way: ``[link] delay_ms = 15`` is a
30 ms RTT. Every value is validated when the profile is built; an error names the bad field
(``a_to_b.loss``) and nothing else happens. Built-in profiles live in ``netlab/profiles/*.toml`` and
are found by name (``metro``, ``wan-1000km``, ``lossy-longhaul``). A top-level ``mtu_bytes``
(default 1500, up to 9000 for a jumbo-frame line) sets the WAN interfaces' MTU.

Keys of a direction (all optional):

=====================  =======================================================================
``delay_ms``           one-way propagation delay
``jitter_ms``          spread of the delay (std-dev for ``normal``, half-width for ``uniform``,
                       scale for ``pareto``)
``distribution``       ``normal`` | ``uniform`` | ``pareto``
``jitter_correlation_ms``  time constant of a ``normal`` jitter (an Ornstein-Uhlenbeck process, as
                       queueing delay drifts); default 10; 0: an independent draw per packet
``jitter_reorders``    false (default): a packet never overtakes an earlier one because of jitter
                       (with uncorrelated jitter this raises the mean delay: a packet waits for
                       the one before it)
``loss``               independent (Bernoulli) loss probability per packet
``gilbert_elliott``    table ``{p, r, loss_good, loss_bad}``: bursty loss; ``p`` good->bad and
                       ``r`` bad->good transition probability per packet
``reorder``            probability that a packet is sent ahead, arriving ``reorder_advance_ms``
                       early (default: its whole delay, as netem does)
``duplicate``          probability that a packet arrives twice
``corrupt``            probability that one bit of a packet flips (the receiver's checksum drops it)
``rate_mbit``          bottleneck rate in Mbit/s of IP packet bytes (0: unlimited)
``queue_packets``      drop-tail queue limit before the bottleneck, in packets
``queue_bytes``        the same in bytes (both may be set; either limit drops)
=====================  =======================================================================
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from pddlink.errors import ConfigError

PROFILE_DIR = Path(__file__).parent / "profiles"
DISTRIBUTIONS = ("normal", "uniform", "pareto")
DIRECTIONS = ("a_to_b", "b_to_a")
MIN_MTU, MAX_MTU = 1280, 9000


def _fail(where: str, why: str) -> ConfigError:
    return ConfigError(f"profile field {where}: {why}")


def _check_probability(where: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise _fail(where, f"{value!r} is not a probability in [0, 1]")


def _check_nonneg(where: str, value: float, upper: float = math.inf) -> None:
    if not (math.isfinite(value) and 0.0 <= value <= upper):
        raise _fail(where, f"{value!r} must be a finite number in [0, {upper:g}]")


@dataclass(frozen=True, slots=True)
class GilbertElliott:
    """Two-state bursty loss: per packet, good->bad with ``p``, bad->good with ``r``."""

    p: float
    r: float
    loss_good: float = 0.0
    loss_bad: float = 1.0

    def validate(self, where: str) -> None:
        for name in ("p", "r", "loss_good", "loss_bad"):
            _check_probability(f"{where}.{name}", getattr(self, name))
        if self.r == 0.0 and self.p > 0.0:
            raise _fail(f"{where}.r", "0 with p > 0 would stay in the bad state forever")

    @property
    def mean_loss(self) -> float:
        if self.p == 0.0:
            return self.loss_good
        bad_share = self.p / (self.p + self.r)
        return (1.0 - bad_share) * self.loss_good + bad_share * self.loss_bad


@dataclass(frozen=True, slots=True)
class DirectionSpec:
    """The impairments of one direction of the link."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    distribution: str = "normal"
    jitter_correlation_ms: float = 10.0
    jitter_reorders: bool = False
    loss: float = 0.0
    gilbert_elliott: GilbertElliott | None = None
    reorder: float = 0.0
    reorder_advance_ms: float | None = None
    duplicate: float = 0.0
    corrupt: float = 0.0
    rate_mbit: float = 0.0
    queue_packets: int = 0
    queue_bytes: int = 0

    def validate(self, where: str) -> None:
        _check_nonneg(f"{where}.delay_ms", self.delay_ms, 60_000.0)
        _check_nonneg(f"{where}.jitter_ms", self.jitter_ms, 60_000.0)
        _check_nonneg(f"{where}.jitter_correlation_ms", self.jitter_correlation_ms, 3_600_000.0)
        if self.distribution not in DISTRIBUTIONS:
            raise _fail(f"{where}.distribution", f"{self.distribution!r} is not one of {DISTRIBUTIONS}")
        for name in ("loss", "reorder", "duplicate", "corrupt"):
            _check_probability(f"{where}.{name}", getattr(self, name))
        if self.gilbert_elliott is not None:
            self.gilbert_elliott.validate(f"{where}.gilbert_elliott")
        if self.reorder_advance_ms is not None:
            _check_nonneg(f"{where}.reorder_advance_ms", self.reorder_advance_ms, self.delay_ms)
        if self.reorder > 0.0 and self.delay_ms == 0.0:
            raise _fail(f"{where}.reorder", "reordering needs a delay_ms > 0 to send packets ahead of")
        _check_nonneg(f"{where}.rate_mbit", self.rate_mbit, 10_000_000.0)
        for name in ("queue_packets", "queue_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise _fail(f"{where}.{name}", f"{value!r} must be a non-negative integer")
        if self.rate_mbit > 0 and 0 < self.queue_bytes < 65_536:
            raise _fail(f"{where}.queue_bytes", "must hold at least one 64 KiB segmentation burst")

    @property
    def is_transparent(self) -> bool:
        """True when the direction changes nothing: the relay may take its fast path."""
        return self == DirectionSpec(
            distribution=self.distribution,
            jitter_reorders=self.jitter_reorders,
            jitter_correlation_ms=self.jitter_correlation_ms,
        )


@dataclass(frozen=True, slots=True)
class Outage:
    """A scheduled partition: no packet passes in ``direction`` during [start_s, start_s+duration_s)."""

    start_s: float
    duration_s: float
    direction: str = "both"

    def validate(self, where: str) -> None:
        _check_nonneg(f"{where}.start_s", self.start_s, 1e9)
        _check_nonneg(f"{where}.duration_s", self.duration_s, 1e9)
        if self.direction not in ("both", *DIRECTIONS):
            raise _fail(f"{where}.direction", f"{self.direction!r} is not 'both', 'a_to_b' or 'b_to_a'")

    def covers(self, direction: str, t_s: float) -> bool:
        return self.direction in ("both", direction) and self.start_s <= t_s < self.start_s + self.duration_s


@dataclass(frozen=True, slots=True)
class Profile:
    """A whole link: both directions, the outage schedule and the seed of every random draw."""

    a_to_b: DirectionSpec
    b_to_a: DirectionSpec
    outages: tuple[Outage, ...] = ()
    seed: int = 1
    name: str = "custom"
    mtu_bytes: int = 1500

    def __post_init__(self) -> None:
        self.a_to_b.validate("a_to_b")
        self.b_to_a.validate("b_to_a")
        for i, outage in enumerate(self.outages):
            outage.validate(f"outage[{i}]")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise _fail("seed", f"{self.seed!r} must be an integer")
        mtu = self.mtu_bytes
        if not isinstance(mtu, int) or isinstance(mtu, bool) or not MIN_MTU <= mtu <= MAX_MTU:
            raise _fail("mtu_bytes", f"{mtu!r} must be an integer in [{MIN_MTU}, {MAX_MTU}]")

    def direction(self, name: str) -> DirectionSpec:
        if name not in DIRECTIONS:
            raise _fail("direction", f"{name!r} is not 'a_to_b' or 'b_to_a'")
        spec: DirectionSpec = getattr(self, name)
        return spec

    @property
    def rtt_ms(self) -> float:
        return self.a_to_b.delay_ms + self.b_to_a.delay_ms


_DIRECTION_KEYS = {f.name for f in fields(DirectionSpec)}
_GE_KEYS = {f.name for f in fields(GilbertElliott)}
_OUTAGE_KEYS = {f.name for f in fields(Outage)}
_TOP_KEYS = {"link", "a_to_b", "b_to_a", "outage", "seed", "name", "description", "mtu_bytes"}
_INT_KEYS = {"queue_packets", "queue_bytes"}
_BOOL_KEYS = {"jitter_reorders"}
_STR_KEYS = {"distribution"}


def _coerce(where: str, key: str, value: Any) -> Any:
    if key in _BOOL_KEYS:
        if not isinstance(value, bool):
            raise _fail(where, f"{value!r} must be true or false")
        return value
    if key in _STR_KEYS:
        if not isinstance(value, str):
            raise _fail(where, f"{value!r} must be a string")
        return value
    if key in _INT_KEYS:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _fail(where, f"{value!r} must be an integer")
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(where, f"{value!r} must be a number")
    return float(value)


def _direction_values(where: str, table: Any) -> dict[str, Any]:
    if not isinstance(table, dict):
        raise _fail(where, "must be a table")
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key not in _DIRECTION_KEYS:
            raise _fail(f"{where}.{key}", f"unknown key (known: {', '.join(sorted(_DIRECTION_KEYS))})")
        if key == "gilbert_elliott":
            values[key] = _gilbert_elliott(f"{where}.{key}", value)
        else:
            values[key] = _coerce(f"{where}.{key}", key, value)
    return values


def _gilbert_elliott(where: str, table: Any) -> GilbertElliott:
    if not isinstance(table, dict):
        raise _fail(where, "must be a table {p, r, loss_good, loss_bad}")
    for key in table:
        if key not in _GE_KEYS:
            raise _fail(f"{where}.{key}", f"unknown key (known: {', '.join(sorted(_GE_KEYS))})")
    for key in ("p", "r"):
        if key not in table:
            raise _fail(f"{where}.{key}", "is required")
    return GilbertElliott(**{k: _coerce(f"{where}.{k}", k, v) for k, v in table.items()})


def _outages(items: Any) -> tuple[Outage, ...]:
    if not isinstance(items, list):
        raise _fail("outage", "must be an array of tables ([[outage]])")
    result = []
    for i, item in enumerate(items):
        where = f"outage[{i}]"
        if not isinstance(item, dict):
            raise _fail(where, "must be a table")
        for key in item:
            if key not in _OUTAGE_KEYS:
                raise _fail(f"{where}.{key}", f"unknown key (known: {', '.join(sorted(_OUTAGE_KEYS))})")
        for key in ("start_s", "duration_s"):
            if key not in item:
                raise _fail(f"{where}.{key}", "is required")
        direction = item.get("direction", "both")
        if not isinstance(direction, str):
            raise _fail(f"{where}.direction", f"{direction!r} must be a string")
        result.append(
            Outage(
                start_s=_coerce(f"{where}.start_s", "start_s", item["start_s"]),
                duration_s=_coerce(f"{where}.duration_s", "duration_s", item["duration_s"]),
                direction=direction,
            )
        )
    return tuple(result)


def profile_from_dict(data: dict[str, Any], name: str = "custom") -> Profile:
    """Build a validated profile from parsed TOML. Raises ConfigError naming the bad field."""
    for key in data:
        if key not in _TOP_KEYS:
            raise _fail(key, f"unknown top-level key (known: {', '.join(sorted(_TOP_KEYS))})")
    if "link" not in data and "a_to_b" not in data and "b_to_a" not in data:
        raise _fail("link", "a profile needs a [link] table (or [a_to_b] and [b_to_a])")
    base = DirectionSpec(**_direction_values("link", data.get("link", {})))
    base.validate("link")
    per_dir = {d: replace(base, **_direction_values(d, data.get(d, {}))) for d in DIRECTIONS}
    seed = data.get("seed", 1)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise _fail("seed", f"{seed!r} must be an integer")
    prof_name = data.get("name", name)
    if not isinstance(prof_name, str):
        raise _fail("name", f"{prof_name!r} must be a string")
    return Profile(
        a_to_b=per_dir["a_to_b"],
        b_to_a=per_dir["b_to_a"],
        outages=_outages(data.get("outage", [])),
        seed=seed,
        mtu_bytes=data.get("mtu_bytes", 1500),
        name=prof_name,
    )


def parse_profile(text: str, name: str = "custom") -> Profile:
    """Parse TOML text into a validated profile."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"profile {name}: not valid TOML: {exc}") from exc
    return profile_from_dict(data, name=name)


def builtin_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def resolve_profile_path(file_or_name: str) -> Path:
    """A path to a TOML file, or the name of a built-in profile."""
    path = Path(file_or_name)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise ConfigError(f"profile file {file_or_name!r} does not exist")
        return path
    builtin = PROFILE_DIR / f"{file_or_name}.toml"
    if not builtin.is_file():
        known = ", ".join(builtin_profiles())
        raise ConfigError(f"no profile file or built-in profile named {file_or_name!r} (built-in: {known})")
    return builtin


def load_profile(file_or_name: str) -> Profile:
    """Read and validate a profile file, or a built-in profile by name."""
    path = resolve_profile_path(file_or_name)
    return parse_profile(path.read_text(), name=path.stem)


@dataclass(frozen=True, slots=True)
class ProfileSource:
    """A profile together with the TOML text it came from (the relay is handed the text)."""

    profile: Profile
    text: str = field(repr=False)

    @classmethod
    def load(cls, file_or_name: str) -> ProfileSource:
        path = resolve_profile_path(file_or_name)
        text = path.read_text()
        return cls(parse_profile(text, name=path.stem), text)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def profile_to_toml(profile: Profile) -> str:
    """TOML text that ``parse_profile`` turns back into an equal profile."""
    lines = [
        f"name = {_toml_value(profile.name)}",
        f"seed = {profile.seed}",
        f"mtu_bytes = {profile.mtu_bytes}",
    ]
    for d in DIRECTIONS:
        spec = profile.direction(d)
        lines.append(f"\n[{d}]")
        ge = None
        for f in fields(DirectionSpec):
            value = getattr(spec, f.name)
            if f.name == "gilbert_elliott":
                ge = value
            elif value is not None:
                lines.append(f"{f.name} = {_toml_value(value)}")
        if ge is not None:
            lines.append(f"\n[{d}.gilbert_elliott]")
            lines += [f"{f.name} = {_toml_value(getattr(ge, f.name))}" for f in fields(GilbertElliott)]
    for o in profile.outages:
        lines.append("\n[[outage]]")
        lines += [f"{f.name} = {_toml_value(getattr(o, f.name))}" for f in fields(Outage)]
    return "\n".join(lines) + "\n"
