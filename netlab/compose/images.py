"""The compose lab's images, built locally and cached: ``pddlink-base`` and ``pddlink``.

No registry is needed. The base image is a Debian root file system made by ``debootstrap
--variant=minbase`` from the mirror apt already uses, with the few packages the lab runs (Python,
iproute2, iperf3, ping, libxxhash) and imported with ``docker import``; its tag carries a hash of
its recipe, so it is made once. The pddlink image (``docker/Dockerfile``) installs, into a virtual
environment, wheels prepared here on the host: the dependency closure of ``pddlink[engine,
quic-native]`` pinned to the versions this machine's environment runs (so the image runs what the
tests ran, and torch is this machine's CPU build, never a CUDA wheel from an index), and a wheel of
this checkout (C extension compiled here: no compiler in the image). The wheels are cached under
``/var/lib/pddlink-compose/wheels/<hash of the pins>``; the checkout's wheel is rebuilt with a fixed
timestamp, so an unchanged tree gives the same bytes and the build reuses every layer.
"""

from __future__ import annotations

import filecmp
import hashlib
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from netlab.compose.engine import DATA_ROOT, INSTALL_HINT, Engine, ensure_engine, stop_engine
from pddlink.errors import LocalError, Unavailable

REPO = Path(__file__).resolve().parents[2]
BASE_PACKAGES = ("python3", "python3-venv", "iproute2", "iperf3", "iputils-ping", "libxxhash0")
EXTRAS = ("engine", "quic-native")
IMAGE = "pddlink:lab"
SOURCE_DATE_EPOCH = "1700000000"
Log = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class BuildResult:
    base: str
    deps: str
    image: str
    image_id: str
    seconds: float
    base_made: bool
    wheels_made: bool


def debian_source() -> tuple[str, str]:
    """(release codename, mirror URL) of the Debian this machine's apt uses."""
    release = ""
    with open("/etc/os-release") as f:
        for line in f:
            if line.startswith("VERSION_CODENAME="):
                release = line.split("=", 1)[1].strip().strip('"')
    mirror = ""
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        if path.suffix not in ("", ".list", ".sources") or not path.is_file():
            continue
        for line in path.read_text().splitlines():
            words = line.split()
            if path.suffix == ".sources" and line.startswith("URIs:") and not mirror:
                mirror = words[1]
            elif words[:1] == ["deb"] and not mirror:
                mirror = next(w for w in words[1:] if not w.startswith("["))
    if not release or not mirror:
        raise Unavailable("the base image is made from Debian packages: no Debian release/mirror found here")
    if mirror.rstrip("/").endswith("debian-security"):
        raise Unavailable(f"apt's first source {mirror} is the security archive, not a full mirror")
    return release, mirror


def base_tag(extra: tuple[str, ...] = ()) -> str:
    """The base image's tag; ``extra``: Debian packages beyond ``BASE_PACKAGES`` (another image)."""
    release, mirror = debian_source()
    recipe = "\n".join([release, mirror, "minbase", *BASE_PACKAGES, *extra])
    return f"pddlink-base:{release}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"


def image_exists(engine: Engine, ref: str) -> bool:
    return engine.docker(["image", "inspect", ref], check=False).returncode == 0


def ensure_base(engine: Engine, log: Log, extra: tuple[str, ...] = ()) -> tuple[str, bool]:
    """The base image's tag, and whether it was made now (with the Debian packages ``extra`` too)."""
    tag = base_tag(extra)
    if image_exists(engine, tag):
        return tag, False
    if shutil.which("debootstrap") is None:
        raise Unavailable(f"debootstrap is missing (the base image comes from it): {INSTALL_HINT}")
    release, mirror = debian_source()
    log(f"base image: debootstrap {release} from {mirror} (once; about a minute)")
    DATA_ROOT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rootfs-", dir=DATA_ROOT) as root:
        argv = [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join((*BASE_PACKAGES, *extra))}",
            release,
            root,
            mirror,
        ]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
        if proc.returncode != 0:
            raise LocalError(f"debootstrap failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (Path(root) / junk).glob("*"):
                if entry.is_file():
                    entry.unlink()
        tar = subprocess.Popen(["tar", "-C", root, "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
        assert tar.stdout is not None
        with tar.stdout:
            engine_import = subprocess.run(
                [engine.tools.docker, "import", "-", tag],
                stdin=tar.stdout,
                env=engine.env,
                capture_output=True,
                timeout=600,
                check=False,
            )
        if tar.wait(60) != 0 or engine_import.returncode != 0:
            raise LocalError(f"docker import failed: {engine_import.stderr.decode(errors='replace').strip()}")
    return tag, True


# ---- wheels -----------------------------------------------------------------------------------


def pinned_requirements(
    repo: Path = REPO, extras: tuple[str, ...] = EXTRAS, leave_out: frozenset[str] = frozenset()
) -> list[str]:
    """``name==version`` for the closure of the checkout's dependencies (with ``extras``), as installed,
    without the packages ``leave_out`` names (nor what only they need).

    torch is pinned to a CPU build (``+cpu``) whatever this environment has."""
    # imported here: the base image (``python3 -m netlab.compose.images``) is made by the system's
    # Python, without the project's environment, while CI's set-up still fills that environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        todo += [Requirement(r) for r in project["optional-dependencies"][extra]]
    todo = [r for r in todo if r.marker is None or r.marker.evaluate({"extra": ""})]
    pins: dict[str, str] = {}
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in pins or name in leave_out:
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            raise Unavailable(f"{req.name} is not installed here: run scripts/setup.sh first") from None
        pins[name] = dist.version
        for sub in dist.requires or []:
            sub_req = Requirement(sub)
            marker = sub_req.marker
            if marker is None or any(marker.evaluate({"extra": e}) for e in (req.extras or {""})):
                todo.append(sub_req)
    if "torch" in pins and "+cpu" not in pins["torch"]:
        pins["torch"] = pins["torch"].split("+")[0] + "+cpu"
    return [f"{name}=={version}" for name, version in sorted(pins.items())]


def ensure_wheels(
    log: Log, extras: tuple[str, ...] = EXTRAS, leave_out: frozenset[str] = frozenset()
) -> tuple[Path, bool]:
    """The cached wheelhouse of the pinned closure, and whether it was filled now."""
    pins = pinned_requirements(extras=extras, leave_out=leave_out)
    key = hashlib.sha256("\n".join(pins).encode()).hexdigest()[:16]
    house = DATA_ROOT / "wheels" / key
    if (house / "requirements.txt").is_file():
        return house, False
    log(f"wheels: {len(pins)} pinned packages into {house} (once)")
    tmp = house.with_name(key + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "pins.txt").write_text("\n".join(pins) + "\n")
    argv = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "-q",
        "-w",
        str(tmp),
        "-r",
        str(tmp / "pins.txt"),
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1200, check=False)
    if proc.returncode != 0:
        raise LocalError(f"pip wheel failed: {proc.stderr.strip().splitlines()[-3:]}")
    torch = [w.name for w in tmp.glob("torch-*.whl")]
    if torch and not all("+cpu" in n for n in torch):
        raise LocalError(f"the image must get a CPU torch, pip found {torch}")
    (tmp / "pins.txt").rename(tmp / "requirements.txt")
    shutil.rmtree(house, ignore_errors=True)
    tmp.rename(house)
    return house, True


def build_checkout_wheel(out: Path, repo: Path = REPO) -> Path:
    """A wheel of the checkout, gRPC stubs and C extension included, with reproducible bytes."""
    env = {**os.environ, "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH, "PYTHONPATH": str(repo)}
    subprocess.run(
        [sys.executable, "-m", "pddlink.serving.rpc"], cwd=repo, env=env, capture_output=True, check=True
    )
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for staged in (repo / "build").glob("*"):  # setuptools stages into build/ and never prunes it:
        if staged.name.startswith(("lib", "bdist")):  # a module deleted from the tree stayed in the wheel
            shutil.rmtree(staged, ignore_errors=True)
    argv = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(out),
        ".",
    ]
    proc = subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, timeout=600, check=False)
    wheels = list(out.glob("pddlink-*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        raise LocalError(f"building the pddlink wheel failed: {proc.stderr.strip().splitlines()[-3:]}")
    return wheels[0]


# ---- the image --------------------------------------------------------------------------------


def _sync(src: Path, dst: Path) -> None:
    """Make ``dst`` hold exactly ``src``'s files, copying only what differs (keeps mtimes stable)."""
    dst.mkdir(parents=True, exist_ok=True)
    names = {p.name for p in src.iterdir()}
    for old in dst.iterdir():
        if old.name not in names:
            old.unlink()
    for path in src.iterdir():
        target = dst / path.name
        if not target.exists() or not filecmp.cmp(path, target):
            shutil.copy2(path, target)


def ensure_deps(
    engine: Engine, base: str, house: Path, log: Log, repo: Path = REPO, no_deps: bool = False, tag: str = ""
) -> str:
    """The dependency image for this wheelhouse (built once per set of pins; ``tag``: another name,
    e.g. one that names the base too); ``no_deps``: pip takes the pins as the whole closure (the
    vLLM image, whose pins leave declared packages out)."""
    tag = tag or f"pddlink-deps:{house.name}"
    if image_exists(engine, tag):
        return tag
    ctx = DATA_ROOT / "context-deps"
    _sync(house, ctx / "wheels")
    shutil.copy2(repo / "docker" / "Dockerfile.deps", ctx / "Dockerfile")
    log(f"dependency image {tag}: docker build on {base} (once per set of pins)")
    args = ["--build-arg", f"BASE={base}", *(["--build-arg", "NO_DEPS=1"] if no_deps else [])]
    engine.docker(["build", *args, "-t", tag, str(ctx)], timeout_s=1800)
    return tag


def build(engine: Engine, log: Log, repo: Path = REPO) -> BuildResult:
    """Build (or find cached) ``pddlink-base``, ``pddlink-deps`` and ``pddlink:lab``."""
    t0 = time.monotonic()
    base, base_made = ensure_base(engine, log)
    house, wheels_made = ensure_wheels(log)
    deps = ensure_deps(engine, base, house, log, repo)
    ctx = DATA_ROOT / "context"
    checkout = build_checkout_wheel(DATA_ROOT / "checkout-wheel", repo)
    _sync(checkout.parent, ctx / "pddlink-wheel")
    for name in ("Dockerfile", "entrypoint.sh"):
        shutil.copy2(repo / "docker" / name, ctx / name)
    log(f"image {IMAGE}: docker build on {deps}")
    engine.docker(["build", "--build-arg", f"DEPS={deps}", "-t", IMAGE, str(ctx)], timeout_s=600)
    image_id = engine.docker(["image", "inspect", "-f", "{{.Id}}", IMAGE]).stdout.decode().strip()
    return BuildResult(base, deps, IMAGE, image_id, time.monotonic() - t0, base_made, wheels_made)


def _main() -> int:
    """``python3 -m netlab.compose.images``: the container engine started and the base image made,
    with the standard library only (CI runs it beside the set-up, before the environment exists)."""
    try:
        engine = ensure_engine()
        try:
            tag, made = ensure_base(engine, lambda line: print(f"images: {line}", flush=True))
        finally:
            if engine.own:  # as ``pddlink lab compose build`` does: nothing of the engine's stays running
                stop_engine()
    except (LocalError, Unavailable) as exc:
        print(f"images: no base image: {exc}", file=sys.stderr)
        return 1
    print(f"images: base image {tag} {'made' if made else 'was there'}")
    return 0


if __name__ == "__main__":
    sys.exit(_main())
