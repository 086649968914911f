"""The sidecar's shared-memory KV region file: its owner's lock, the sweep of regions whose owner
was killed (a tmpfs file is RAM until it is unlinked), and its mode whatever the umask. Real
processes: the owner killed with -9 is a child process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pddlink.connector.shm import RegionInUse, ShmRegion, sweep_stale

OWNER = """
import sys, time
from pathlib import Path
from pddlink.connector.shm import ShmRegion
r = ShmRegion(Path(sys.argv[1]), 1 << 20)
print("ready", flush=True)
time.sleep(60)
"""


def _owner(path: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    p = subprocess.Popen([sys.executable, "-c", OWNER, str(path)], stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def test_a_killed_owners_region_is_swept_and_a_living_ones_is_kept(tmp_path: Path) -> None:
    dead, alive = tmp_path / "pddlink-p-dead.kv", tmp_path / "pddlink-md-alive.kv"
    killed, living = _owner(dead), _owner(alive)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        assert dead.exists()  # close() never ran
        (tmp_path / "other.kv").write_bytes(b"x")  # not a region's name: never touched
        assert sweep_stale(tmp_path) == [dead]
        assert not dead.exists() and alive.exists() and (tmp_path / "other.kv").exists()
    finally:
        living.kill()
        living.wait(10)
    time.sleep(0.1)
    assert sweep_stale(tmp_path) == [alive]


def test_a_second_region_on_a_living_ones_file_is_refused_and_leaves_it_whole(tmp_path: Path) -> None:
    path = tmp_path / "pddlink-p-x.kv"
    first = ShmRegion(path, 1 << 16)
    slot = first.alloc(4096)
    first.write(slot, [memoryview(b"\x07" * 4096)])
    with pytest.raises(RegionInUse):
        ShmRegion(path, 1 << 16)
    assert path.stat().st_size == 1 << 16 and path.read_bytes()[:4] == b"\x07" * 4  # not truncated
    first.close()
    assert not path.exists()
    again = ShmRegion(path, 1 << 16)  # the lock went with close()
    again.close()


def test_the_region_file_is_0600_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        r = ShmRegion(tmp_path / "pddlink-p-m.kv", 1 << 16)
    finally:
        os.umask(old)
    try:
        assert (r.path.stat().st_mode & 0o777) == 0o600
    finally:
        r.close()
