"""``pddlink demo --engine vllm --lab compose``: the vLLM demo's deployments as containers of the compose lab.

``ComposeVllmPair`` stands where ``harness.vllm.pair.VllmPair`` stands in ``harness.vllm_demo``: it
writes each role's sidecar file (``engine = "vllm"``, mTLS on the KV ports with the lab's PKI) and
its vLLM arguments, and ``ComposeLab.deploy_vllm`` starts P, RLD and MD as a sidecar container with
its vLLM server container beside it (a pod: one network and IPC namespace, the control socket in the
shared /run/pddlink), each vLLM started with vLLM's module entry point and what ``pddlink sidecar
--print-vllm-args`` prints. MD sits in datacenter B: P's sidecar ships to it across the lab's relay
(the WAN profile), the router reaches MD's vLLM across it too and follows MD vLLM's KV events there
(``tcp://md:5557``). The router runs in its own container (``pddlink router --config``, ``engine =
"vllm"``); ``connect_router(cfg)`` writes the phase's router file from the demo's ``RouterConfig``,
(re)starts that container and returns a client of its gRPC service (``GrpcRouter``) that yields
what ``Router.generate`` yields. The demo reads the sidecars over their admin sockets (the mounted run
directory) and each vLLM's /metrics and answers (token exactness against P's vLLM alone) from the host
over the lab's bridges, never through the WAN.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from harness.demo_compose import _toml
from harness.vllm import SEEDED_SAMPLING
from harness.vllm.pair import engine_cores
from netlab.compose.lab import ComposeLab
from netlab.profile import parse_profile
from pddlink.lifecycle import RunOutcome
from pddlink.serving.http import fetch
from router.answer import GenerateEvent, RequestEnd, StreamedToken

ENGINE_PORT = 8100
MD_EVENTS_PORT = 5557
MODEL = "/models/model"  # the name the servers serve (their --model), and the router's [vllm] model
SIDECARS = ("md", "rld", "p")


@dataclass(frozen=True, slots=True)
class EngineServer:
    """What the demo reads of one vLLM server: where it answers from the host."""

    url: str
    port: int = ENGINE_PORT

    @property
    def spec(self) -> EngineServer:  # (``harness.vllm_demo`` reads ``server.spec.port``, as of VllmServer)
        return self


@dataclass(frozen=True, slots=True)
class PairView:
    timing_dir: Path  # (the connectors write no hook timings here: their stage table stays empty)


def sidecar_files(role: str, block_size: int, line_mbit: float, relay: bool) -> str:
    """``role``'s sidecar file in the lab: vLLM beside it, its ports mTLS, its admin on a unix socket."""
    table: dict[str, Any] = {
        "engine": "vllm",
        "role": role,
        "peer_id": f"{role}0",
        "host": "0.0.0.0",
        **({"kv_port": 7450 if role == "md" else 7451} if role != "p" else {}),
        "admin_unix": f"/run/pddlink/{role}.admin.sock",
        "tls_dir": "/pki",
        "vllm": {
            "model_id": "tiny-llama",
            "block_size": block_size,
            "workdir": "/run/pddlink",
            "region_bytes": 256 << 20,
            "orphan_s": 120.0,
            **({"kv_events_endpoint": _events(role)} if role != "p" else {}),
        },
    }
    if role == "p":
        table["data_plane"] = {"wan_line_mbit": line_mbit}
        table["peers"] = {"md_kv": "md:7450", **({"rld_kv": "rld:7451"} if relay else {})}
    return _toml(table)


def _events(role: str) -> str:
    # MD's on TCP: its sidecar and, across the WAN, the router's DRC mirror subscribe to it
    return f"tcp://127.0.0.1:{MD_EVENTS_PORT}" if role == "md" else f"ipc:///run/pddlink/{role}-events.ipc"


def vllm_args(dtype: str, extra: tuple[str, ...]) -> str:
    """A role's vLLM arguments before the sidecar's own (``/config/<role>.vllm-args``); one per line."""
    args = ["--model", MODEL, "--host", "0.0.0.0", "--port", str(ENGINE_PORT), "--dtype", dtype]
    args += ["--enforce-eager", "--disable-uvicorn-access-log", "--enable-prompt-tokens-details"]
    args += [_compact(a) for a in extra]
    if any(not a or any(c.isspace() for c in a) for a in args):
        raise ValueError(f"a vLLM argument with a space cannot pass through the shell's $(cat): {args}")
    return "\n".join(args) + "\n"


def _compact(arg: str) -> str:
    """A JSON argument without spaces (``VLLM_ARGS``' histogram buckets), other arguments as they are."""
    if arg[:1] in "{[":
        return json.dumps(json.loads(arg), separators=(",", ":"))
    return arg


def router_toml(cfg: Any, urls: dict[str, str]) -> str:
    """The router container's file from the demo's ``RouterConfig``: every setting that differs from
    the default, the [vllm] URLs as the router reaches them (``urls``: the host's URL -> the lab's)."""
    from router import RouterConfig, VllmEngineConfig

    top = {f.name: getattr(cfg, f.name) for f in fields(RouterConfig) if _differs(cfg, f)}
    top = {k: v for k, v in top.items() if isinstance(v, bool | int | float | str)}
    vllm = {f.name: getattr(cfg.vllm, f.name) for f in fields(VllmEngineConfig) if _differs(cfg.vllm, f)}
    vllm = {k: urls.get(v, v) if isinstance(v, str) else v for k, v in vllm.items()}
    serve = {"host": "0.0.0.0", "grpc_port": 7443, "unix": "/run/pddlink/router.sock", "tls_dir": "/pki"}
    return _toml({**top, **serve, "vllm": vllm})


def _differs(obj: Any, f: Any) -> bool:
    default = f.default_factory() if callable(f.default_factory) else f.default
    return bool(getattr(obj, f.name) != default)


class GrpcRouter:
    """The router container's gRPC service, yielding what ``Router.generate`` yields
    (``StreamedToken`` per token, then one ``RequestEnd`` with its outcome, reason and trace)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.channel: Any = None

    async def start(self) -> None:
        import grpc

        from pddlink.serving.rpc import stubs

        self.pb2, grpc_mod = stubs()
        self.channel = grpc.aio.insecure_channel(self.target)
        self.stub = grpc_mod.RouterStub(self.channel)

    async def generate(
        self,
        prompt: list[int],
        sampling: Any,
        *,
        deadline_s: float,
        pipeline: str,
        request_id: str,
        arrived: float = 0.0,
    ) -> AsyncIterator[GenerateEvent]:
        from pddlink.serving.sampling_pb import sampling_to_pb

        msg = self.pb2.GenerateRequest(
            request_id=request_id,
            prompt=list(prompt),
            sampling=sampling_to_pb(sampling),
            deadline_s=deadline_s,
            pipeline=pipeline,
        )
        import grpc

        position = len(prompt)
        try:
            async for ev in self.stub.Generate(msg, timeout=deadline_s + 5.0):
                if ev.done:
                    trace = json.loads(ev.trace_json or "{}")
                    key = str(trace.get("request_key", ""))
                    yield RequestEnd(request_id, key, RunOutcome(ev.outcome), ev.reason, trace)
                    return
                yield StreamedToken(position, ev.token_id, ev.source)
                position += 1
        except grpc.aio.AioRpcError as exc:  # as the in-process router's failed end
            reason = f"grpc {exc.code().name}: {exc.details()}"
            yield RequestEnd(request_id, "", RunOutcome.FAILED, reason, {})

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()


class ComposeVllmPair:
    """P, RLD (``relay``) and MD as vLLM servers beside their sidecars in ``lab``; the router container."""

    def __init__(
        self,
        lab: ComposeLab,
        workdir: Path,
        model: Path,
        dtype: str,
        relay: bool,
        extra: tuple[str, ...],
        line_mbit: float,
        pin_cores: bool,
    ) -> None:
        self.lab, self.workdir, self.model, self.relay = lab, workdir, model, relay
        self.dtype, self.extra, self.line_mbit = dtype, extra, line_mbit
        self.config_dir, self.run_dir = workdir / "config", workdir / "run"
        self.roles = SIDECARS if relay else ("md", "p")
        every = ",".join(map(str, sorted(os.sched_getaffinity(0))))
        cores = engine_cores() if pin_cores else {}
        self.cores = {r: cores[r] for r in self.roles} if cores else {}
        self.cpus = {r: ",".join(map(str, cores[r])) if cores else every for r in SIDECARS}
        self.servers_ = {r: EngineServer(f"http://{lab.addr(r)}:{ENGINE_PORT}") for r in self.roles}
        self.p, self.md = self.servers_["p"], self.servers_["md"]
        self.rld = self.servers_.get("rld")
        self.md_kv_events = f"tcp://md:{MD_EVENTS_PORT}"  # (the router's, in the lab)
        self.model_name = MODEL
        self.spec = PairView(workdir / "timings")

    def start(self, timeout_s: float = 900.0) -> ComposeVllmPair:
        self.config_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        models = self.workdir / "models"
        models.mkdir(parents=True, exist_ok=True)
        if not (models / "model").exists():
            shutil.copytree(self.model, models / "model")
        for role in SIDECARS:
            block = 32
            (self.config_dir / f"{role}.toml").write_text(
                sidecar_files(role, block, self.line_mbit, self.relay)
            )
            (self.config_dir / f"{role}.vllm-args").write_text(vllm_args(self.dtype, self.extra))
        for path in (self.config_dir, models):
            for entry in [path, *path.rglob("*")]:
                os.chmod(entry, 0o755 if entry.is_dir() else 0o644)  # the roles' user reads them
        try:
            self.lab.deploy_vllm(
                self.config_dir, self.run_dir, models, self.cpus, ENGINE_PORT, timeout_s, roles=self.roles
            )
        except BaseException:
            self.close()
            raise
        return self

    def connect_router(self, cfg: Any) -> GrpcRouter:
        """The router container restarted with ``cfg`` (its file), and a client of its gRPC service."""
        inside = {s.url: f"http://{r}:{ENGINE_PORT}" for r, s in self.servers_.items()}
        (self.config_dir / "router.toml").write_text(router_toml(cfg, inside))
        os.chmod(self.config_dir / "router.toml", 0o644)
        self.lab.restart_router()
        return GrpcRouter(f"unix:{self.run_dir / 'router.sock'}.grpc")

    def servers(self) -> dict[str, EngineServer]:
        return dict(self.servers_)

    def _get(self, role: str, path: str) -> Any:
        status, body = fetch(f"unix:{self.run_dir / f'{role}.admin.sock'}", "GET", path, timeout_s=10.0)
        if status != 200:
            raise RuntimeError(f"sidecar {role} {path}: HTTP {status} {body[:200]!r}")
        return json.loads(body)

    def status(self) -> dict[str, Any]:
        return {r: self._get(r, "/status") for r in self.roles}

    def shipped_all(self) -> dict[str, dict[str, Any]]:
        done: dict[str, dict[str, Any]] = self._get("p", "/transfers")["done"]
        return done

    def finished(self, role: str = "md") -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = self._get(role, "/transfers")["finished"]
        return out

    def close(self) -> None:
        self.lab.undeploy()
        logs = self.lab.record.directory / "logs"
        for log in logs.glob("*.log") if logs.exists() else ():
            shutil.copy2(log, self.workdir / log.name)


@contextlib.contextmanager
def compose_lab(
    spec: Any, profile: str, say: Callable[[str], None], figures: dict[str, Any]
) -> Iterator[ComposeLab]:
    """Build the images (cached), bring a compose lab up with the demo's WAN (``profile``) and
    measure it from inside; down on leaving. ``figures`` gets the images' build and the WAN."""
    from netlab.compose import engine as engines
    from netlab.compose import images
    from netlab.compose.lab import list_labs
    from netlab.compose.vllm_image import build_vllm, image_size_bytes

    engine = engines.ensure_engine()
    try:
        built = [build(engine, say) for build in (images.build, build_vllm)]
        size = image_size_bytes(engine)
    except BaseException:
        if engine.own and not list_labs():
            engines.stop_engine()
        raise
    for result in built:
        say(f"images: {result.image} in {result.seconds:.1f} s")
    figures["lab_mode"] = "compose"
    figures["images"] = {r.image: {"build_s": round(r.seconds, 1)} for r in built}
    figures["images"][built[1].image]["size_bytes"] = size
    lab = ComposeLab.up(parse_profile(profile, name="pddlink-vllm-demo"), name=f"vdemo{os.getpid() % 100000}")
    try:
        wan = lab.measure_wan()
        figures["wan_measured"] = {**asdict(wan), "within_5_percent": wan.within(0.05)}
        say(f"compose lab {lab.name}: WAN RTT {wan.rtt_ms:.2f} ms, {wan.rate_mbit:.2f} Mbit/s (measured)")
        yield lab
    finally:
        lab.down()


def compose_start(lab: ComposeLab, spec: Any) -> Callable[[Path, Path, str, bool], ComposeVllmPair]:
    """How ``harness.vllm_demo`` starts a deployment in ``lab``: (workdir, model, dtype, relay) -> pair."""
    from harness.ttft_stages import VLLM_ARGS

    # as harness.vllm_demo._start: five turns of up to 800 new tokens outgrow vLLM's default 4096
    room = ("--max-model-len", "8192", "--max-num-batched-tokens", "8192")
    extra = ("--logits-processors", SEEDED_SAMPLING, *room, *VLLM_ARGS, *spec.extra_args)

    def start(workdir: Path, model: Path, dtype: str, relay: bool) -> ComposeVllmPair:
        t0 = time.monotonic()
        pair = ComposeVllmPair(lab, workdir, model, dtype, relay, extra, spec.line_mbit, spec.pin_cores)
        pair.start()
        say(f"{', '.join(pair.roles)} vLLM containers ({dtype}) up in {time.monotonic() - t0:.1f} s")
        return pair

    return start


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
