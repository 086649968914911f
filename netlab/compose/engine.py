"""The container engine the compose lab runs on: the machine's own dockerd, or one the lab starts.

``ensure_engine()`` returns an ``Engine`` to run ``docker`` and ``docker-compose`` against. Where a
dockerd already answers on the standard socket the lab uses it and changes nothing else. Otherwise
it starts its own dockerd, as root, on a socket, data root and exec root of its own (no systemd
needed; no ``docker0`` bridge; no IP forwarding or masquerading, since every lab network is internal
and the relay container forwards between them in its own namespace), after recording the host's
firewall tables and forwarding sysctls (``hostnet``). ``stop_engine()`` stops that dockerd and its
containerd, puts the recorded settings back and removes the exec root: nothing of it is left but
the data root, which keeps the image cache for the next build.

Files: ``/run/pddlink-compose/engine/`` (socket, pid file, log, host snapshot, exec root) and
``/var/lib/pddlink-compose/docker`` (data root).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from netlab.compose import hostnet
from pddlink.errors import DeadlineExceeded, LocalError, Unavailable

STATE_ROOT = Path("/run/pddlink-compose")
ENGINE_DIR = STATE_ROOT / "engine"
DATA_ROOT = Path("/var/lib/pddlink-compose")
SYSTEM_SOCKET = "/var/run/docker.sock"
# Real-time CPU time for the engine's containers (cgroup v1 with RT group scheduling): the relay
# container gets RELAY_RT_RUNTIME_US of it, so that it releases delayed packets on time (as the
# namespaced lab's relay does with SCHED_FIFO) even on a busy machine.
RT_RUNTIME_FILE = Path("/sys/fs/cgroup/cpu/cpu.rt_runtime_us")
ENGINE_RT_RUNTIME_US = 900_000
RELAY_RT_RUNTIME_US = 400_000
# cgroup v1 weighs all of the engine's containers together (its ``docker`` group) like one thread of
# the host, so on a busy machine the lab's roles would get far less CPU than the same processes in
# the namespaced lab, where every thread weighs 1024. The own engine's group weighs as many threads
# as the lab's roles busy at once (router, P, RLD, MD and their I/O and engine threads).
CPU_GROUP = Path("/sys/fs/cgroup/cpu/docker")
CPU_GROUP_SHARES = 10 * 1024
INSTALL_HINT = "apt-get install docker.io docker-compose debootstrap"


@dataclass(frozen=True, slots=True)
class Tools:
    docker: str
    dockerd: str
    compose: str


@dataclass(frozen=True, slots=True)
class Engine:
    """A dockerd that answers on ``socket``; ``own`` when the lab started it."""

    socket: str
    own: bool
    tools: Tools

    @property
    def relay_rt_runtime_us(self) -> int:
        """Real-time runtime a relay container may ask for (0: none; the machine's own engine)."""
        return RELAY_RT_RUNTIME_US if self.own and RT_RUNTIME_FILE.exists() else 0

    @property
    def env(self) -> dict[str, str]:
        """The environment for docker clients: this engine, no BuildKit, no caller's PYTHONPATH."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DOCKER_CONTEXT")}
        return {**env, "DOCKER_HOST": f"unix://{self.socket}", "DOCKER_BUILDKIT": "0"}

    def docker(
        self, args: Sequence[str], *, timeout_s: float = 60.0, stdin: bytes | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[bytes]:
        return _run([self.tools.docker, *args], self.env, timeout_s, stdin, check)

    def compose(
        self,
        project: str,
        file: Path,
        args: Sequence[str],
        *,
        env: Mapping[str, str],
        timeout_s: float = 120.0,
        check: bool = True,
    ) -> subprocess.CompletedProcess[bytes]:
        argv = [self.tools.compose, "--no-ansi", "-p", project, "-f", str(file), *args]
        return _run(argv, {**self.env, **env}, timeout_s, None, check)


def _run(
    argv: list[str], env: dict[str, str], timeout_s: float, stdin: bytes | None, check: bool
) -> subprocess.CompletedProcess[bytes]:
    try:
        proc = subprocess.run(argv, env=env, input=stdin, capture_output=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise DeadlineExceeded(f"{' '.join(argv[:4])}... took longer than {timeout_s:.0f} s") from None
    if check and proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip().splitlines()
        raise LocalError(f"{' '.join(argv[:4])}...: {err[-1] if err else proc.returncode}")
    return proc


def find_tools() -> Tools:
    """docker, dockerd and docker-compose, the engine's client next to its daemon where both exist."""
    dockerd = shutil.which("dockerd") or shutil.which("dockerd", path="/usr/sbin:/usr/bin")
    compose = shutil.which("docker-compose")
    if not dockerd or not compose:
        raise Unavailable(f"no container engine here (dockerd, docker-compose): {INSTALL_HINT}")
    beside = Path(dockerd).parent.parent / "bin" / "docker"
    docker = str(beside) if beside.is_file() else shutil.which("docker")
    if not docker:
        raise Unavailable(f"no docker client: {INSTALL_HINT}")
    return Tools(docker, dockerd, compose)


@contextlib.contextmanager
def engine_lock() -> Iterator[None]:
    ENGINE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_ROOT / "engine.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _answers(tools: Tools, sock: str) -> bool:
    if not os.path.exists(sock):
        return False
    env = {**os.environ, "DOCKER_HOST": f"unix://{sock}"}
    with contextlib.suppress(subprocess.TimeoutExpired, OSError):
        proc = subprocess.run(
            [tools.docker, "version"], env=env, capture_output=True, timeout=10, check=False
        )
        return proc.returncode == 0
    return False


def own_socket() -> str:
    return str(ENGINE_DIR / "docker.sock")


def own_pid() -> int:
    """The pid of the lab's own dockerd, 0 when none runs."""
    try:
        pid = int((ENGINE_DIR / "docker.pid").read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return 0
    return pid if str(ENGINE_DIR).encode() in cmdline and not _is_zombie(pid) else 0


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def running_engine() -> Engine | None:
    """The engine the lab would use now, without starting one."""
    tools = find_tools()
    if own_pid() and _answers(tools, own_socket()):
        return Engine(own_socket(), True, tools)
    if _answers(tools, SYSTEM_SOCKET):
        return Engine(SYSTEM_SOCKET, False, tools)
    return None


def ensure_engine(timeout_s: float = 30.0) -> Engine:
    """A running engine: the machine's, the lab's own, or a new own one."""
    if os.geteuid() != 0:
        raise Unavailable("the compose lab needs root (it runs dockerd and gives containers a TUN device)")
    with engine_lock():
        found = running_engine()
        if found is not None:
            return found
        return _start(find_tools(), timeout_s)


def _start(tools: Tools, timeout_s: float) -> Engine:
    _cleanup_leftovers()
    snap = ENGINE_DIR / "host.json"
    if not snap.exists():  # a snapshot left by a crashed run is the one taken before any lab
        snap.write_text(hostnet.take_snapshot().to_json())
    (DATA_ROOT / "docker").mkdir(parents=True, exist_ok=True)
    argv = [
        tools.dockerd,
        "-H",
        f"unix://{own_socket()}",
        "--data-root",
        str(DATA_ROOT / "docker"),
        "--exec-root",
        str(ENGINE_DIR / "exec"),
        "--pidfile",
        str(ENGINE_DIR / "docker.pid"),
        "--bridge=none",
        "--ip-forward=false",
        "--ip-masq=false",
        "--userland-proxy=false",
        "--storage-driver=overlay2",
    ]
    if RT_RUNTIME_FILE.exists():
        argv.append(f"--cpu-rt-runtime={ENGINE_RT_RUNTIME_US}")
    cgroups = ENGINE_DIR / "cgroups.before"
    if not cgroups.exists():
        cgroups.write_text("\n".join(str(p) for p in _engine_cgroups()))
    if CPU_GROUP.parent.is_dir() and not CPU_GROUP.exists():  # removed again by _remove_new_cgroups
        CPU_GROUP.mkdir()
        (CPU_GROUP / "cpu.shares").write_text(str(CPU_GROUP_SHARES))
    with open(ENGINE_DIR / "dockerd.log", "ab") as log:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
        )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = (ENGINE_DIR / "dockerd.log").read_text(errors="replace").strip().splitlines()[-1:]
            _stop_own()
            raise LocalError(f"dockerd exited at start ({proc.returncode}): {tail}")
        if _answers(tools, own_socket()):
            return Engine(own_socket(), True, tools)
        time.sleep(0.2)
    _stop_own()
    raise DeadlineExceeded(f"dockerd did not answer within {timeout_s:.0f} s (see {ENGINE_DIR}/dockerd.log)")


def stop_engine(timeout_s: float = 30.0) -> list[str]:
    """Stop the lab's own dockerd (never the machine's) and restore the host; returns what was restored."""
    with engine_lock():
        return _stop_own(timeout_s)


def _stop_own(timeout_s: float = 30.0) -> list[str]:
    pid = own_pid()
    if pid:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        if not _wait_gone(pid, timeout_s):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _wait_gone(pid, 5.0)
    _cleanup_leftovers()
    _remove_new_cgroups()
    restored: list[str] = []
    snap = ENGINE_DIR / "host.json"
    if snap.exists():
        restored = hostnet.restore(hostnet.HostNetSnapshot.from_json(snap.read_text()))
        snap.unlink()
    return restored


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # when this process started it
        if not Path(f"/proc/{pid}").exists() or _is_zombie(pid):
            return True
        time.sleep(0.1)
    return False


def _cleanup_leftovers() -> None:
    """Processes (containerd, shims) and mounts of an own engine that is gone, and its exec root."""
    exec_root = ENGINE_DIR / "exec"
    for pid in _processes_naming(str(ENGINE_DIR)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _wait_gone(pid, 5.0)
    for mount in _mounts_under(str(exec_root)):
        subprocess.run(["umount", "-l", mount], capture_output=True, timeout=10, check=False)
    shutil.rmtree(exec_root, ignore_errors=True)
    for name in ("docker.sock", "docker.pid"):
        with contextlib.suppress(FileNotFoundError):
            (ENGINE_DIR / name).unlink()


def _engine_cgroups() -> list[Path]:
    return sorted(Path("/sys/fs/cgroup").glob("*/docker")) + sorted(Path("/sys/fs/cgroup").glob("docker"))


def _remove_new_cgroups() -> None:
    """The cgroups the own dockerd created (``docker`` under each hierarchy), once they are empty."""
    record = ENGINE_DIR / "cgroups.before"
    if not record.exists():
        return
    before = set(record.read_text().split())
    for group in _engine_cgroups():
        if str(group) not in before:
            for sub in sorted((p for p in group.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    sub.rmdir()
            with contextlib.suppress(OSError):
                group.rmdir()
    record.unlink()


def _processes_naming(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if text.encode() in (entry / "cmdline").read_bytes() and not _is_zombie(int(entry.name)):
                    found.append(int(entry.name))
    return found


def _mounts_under(root: str) -> list[str]:
    with open("/proc/self/mounts") as f:
        points = [line.split()[1] for line in f]
    return sorted((p for p in points if p.startswith(root)), reverse=True)


def leftovers() -> list[str]:
    """What of an own engine is still on the machine (empty after ``stop_engine``)."""
    out = [f"process {pid}" for pid in _processes_naming(str(ENGINE_DIR))]
    out += [f"mount {m}" for m in _mounts_under(str(ENGINE_DIR))]
    if (ENGINE_DIR / "exec").exists():
        out.append(f"directory {ENGINE_DIR / 'exec'}")
    if not own_pid() and (ENGINE_DIR / "cgroups.before").exists():
        before = set((ENGINE_DIR / "cgroups.before").read_text().split())
        out += [f"cgroup {g}" for g in _engine_cgroups() if str(g) not in before]
    return out
