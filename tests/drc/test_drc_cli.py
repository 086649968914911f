"""`pddlink drc stats|match|snapshot` against a snapshot file and against a real HTTP admin server.

The server here is a minimal stand-in for the sidecar's admin endpoints, built from the same
``pddlink.drc.inspect`` functions the sidecar serves; it listens on a real loopback socket.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner

from pddlink.cli.main import cli
from pddlink.drc import PrefixIndex, encode_snapshot
from pddlink.drc.inspect import match_json, stats_json
from pddlink.errors import InvalidInput
from pddlink.kv.hashing import BlockHasher

HASHER = BlockHasher("cli-model", block_size=4)
SHARED = list(range(100, 132))  # 8 blocks


def build_index() -> PrefixIndex:
    index = PrefixIndex(capacity_blocks=100, epoch=11)
    for tail in range(3):
        index.insert(HASHER.hash_blocks(SHARED + [tail] * 8), now=0.0)
    index.access(HASHER.hash_blocks(SHARED), now=1.0)
    return index


def run(*args: str) -> dict:  # type: ignore[type-arg]
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)  # type: ignore[no-any-return]


@pytest.fixture
def snapshot_file(tmp_path: Path) -> Path:
    path = tmp_path / "drc.snap"
    path.write_bytes(encode_snapshot(build_index(), block_size=4, root=HASHER.root))
    return path


def test_stats_from_a_snapshot_file(snapshot_file: Path) -> None:
    answer = run("drc", "stats", "--snapshot", str(snapshot_file), "--json")
    assert answer["cached_blocks"] == 14 and answer["epoch"] == 11 and answer["block_size"] == 4
    assert answer["top_prefixes"][0] == {
        "tip": f"{HASHER.hash_blocks(SHARED)[-1]:032x}",
        "blocks": 8,
        "sequences": 3,
    }


def test_match_from_a_snapshot_file_with_and_without_the_model(snapshot_file: Path) -> None:
    prompt = ",".join(map(str, [*SHARED, 1, 1, 1, 1, 9, 9, 9, 9, 9]))
    answer = run("drc", "match", "--snapshot", str(snapshot_file), "--tokens", prompt, "--json")
    assert (answer["matched_blocks"], answer["total_blocks"], answer["matched_tokens"]) == (9, 10, 36)
    again = run(
        "drc", "match", "--snapshot", str(snapshot_file), "--tokens", prompt, "--model", "cli-model", "--json"
    )
    assert again == answer
    with pytest.raises(InvalidInput):
        CliRunner().invoke(
            cli,
            ["drc", "match", "--snapshot", str(snapshot_file), "--tokens", prompt, "--model", "other"],
            catch_exceptions=False,
        )


class AdminHandler(BaseHTTPRequestHandler):
    index = build_index()

    def reply(self, body: bytes, ctype: str = "application/json", status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/drc/stats":
            self.reply(json.dumps(stats_json(self.index, block_size=4)).encode())
        elif self.path == "/drc/snapshot":
            self.reply(
                encode_snapshot(self.index, block_size=4, root=HASHER.root), "application/octet-stream"
            )
        else:
            self.reply(b"{}", status=404)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        try:
            self.reply(json.dumps(match_json(self.index, HASHER, body)).encode())
        except InvalidInput as exc:
            self.reply(json.dumps({"error": exc.message}).encode(), status=400)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def admin_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), AdminHandler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_against_a_running_admin_server(admin_url: str, tmp_path: Path) -> None:
    stats = run("drc", "stats", "--url", admin_url, "--json")
    assert stats["cached_blocks"] == 14 and stats["lookups"] == 1 and stats["hit_rate"] == 1.0
    answer = run("drc", "match", "--url", admin_url, "--tokens", json.dumps(SHARED[:10]), "--json")
    assert answer["matched_blocks"] == 2
    out = tmp_path / "saved.snap"
    result = CliRunner().invoke(
        cli, ["drc", "snapshot", "--url", admin_url, "-o", str(out)], catch_exceptions=False
    )
    assert result.exit_code == 0
    assert run("drc", "stats", "--snapshot", str(out), "--json")["cached_blocks"] == 14


def test_unreachable_sidecar_is_a_clear_error() -> None:
    from pddlink.errors import Unavailable

    with pytest.raises(Unavailable):
        CliRunner().invoke(
            cli, ["drc", "stats", "--url", "http://127.0.0.1:9", "--timeout-s", "2"], catch_exceptions=False
        )


@pytest.mark.parametrize(
    "body",
    [{}, [], {"tokens": "1,2"}, {"tokens": [-1]}, {"tokens": [2**32]}, {"tokens": [True]}, {"tokens": [1.0]}],
)
def test_match_request_refuses_bad_bodies(body: object) -> None:
    from pddlink.drc.inspect import parse_match_request

    with pytest.raises(InvalidInput):
        parse_match_request(body)
