"""Side by side: the same calls through the official ``openai`` client against vLLM's own OpenAI
server and against the pddlink router, compared field by field (names and JSON types, recursively).

vLLM serves the tiny random Llama (``harness/vllm/tiny_model.py``, float32: P's server of the
session's shared pair, tests/conftest.py, called without transfer parameters); the router fronts the
loopback hand deployment of ``examples/deploy/loopback`` (reference engines, the tiny model's
tokenizer built with the reference engine's 2048 ids). The two models differ, so texts differ; what
must agree is the shape of every answer and its semantics: ``finish_reason`` (``length`` when
``max_tokens`` ended it, ``stop`` with ``stop_reason`` for a stop id or string), ``usage`` counts that
add up, the refusals' status codes. pddlink's own extension is one ``pddlink`` object per choice,
the only key vLLM lacks. Calls where pddlink deliberately differs (``n`` > 1, ``best_of``: a 400
naming the field, where vLLM samples) are listed in ``DIFFERENT``. The table of calls and verdicts
is printed (``pytest -s``) and written to ``$PDDLINK_CONFORMANCE_REPORT`` when set.

The same calls run a second time against the router in front of vLLM itself
(``engine = "vllm"``, started with ``pddlink router --config``: P and MD are vLLM servers of the
same model beside their pddlink sidecars, the shared pair): there the models are the same, so every
greedy call must also give vLLM's own text and token ids (``GREEDY_SAME``). That router has no
RelayDecode, so no answer here went through a handoff: ``test_openai_conformance_handoff.py`` holds
every call of a P->RLD->MD pipeline with a forced handoff (one-shot and catch-up) against vLLM.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
try:
    import vllm  # noqa: F401
except Exception as exc:  # vLLM missing or broken: the whole module skips with the reason
    pytest.skip(f"vLLM is not importable: {exc}", allow_module_level=True)

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
ROUTER_URL = "http://127.0.0.1:28000/v1"
VLLM_ROUTER_PORT = 28510
# greedy calls whose text and token ids must equal vLLM's own when the router fronts the same model
GREEDY_SAME = {
    "text", "ids", "ids_return_token_ids", "max_tokens_1", "stop_string", "stop_token_id", "two_prompts",
    "chat", "stream_text", "stream_ids", "stream_stop_string", "stream_two_prompts", "chat_stream",
}  # fmt: skip
PDDLINK_EXTENSIONS = {"pddlink"}
DIFFERENT = {"n_2", "best_of_2"}


def _start(cmd: list[str] | str, cwd: Path, env: dict[str, str], log: Path, shell: bool = False) -> Any:
    return subprocess.Popen(
        cmd, cwd=cwd, env=env, shell=shell, stdout=subprocess.PIPE, stderr=open(log, "w"),
        text=True, start_new_session=True,
    )  # fmt: skip


def _stop(procs: list[Any]) -> None:
    for p in reversed(procs):
        os.killpg(os.getpgid(p.pid), signal.SIGTERM)
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(os.getpgid(p.pid), signal.SIGKILL)
            p.wait()


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env


@pytest.fixture(scope="module")
def bare_vllm(vllm_pair: Any) -> tuple[Any, Path]:
    """vLLM's own OpenAI server on the tiny random Llama: the side every answer is held against.
    It is P's server of the session's shared pair (tests/conftest.py), which also serves the name
    "tiny"; these calls carry no transfer parameters, so its connector takes no part."""
    vc = openai.OpenAI(base_url=f"{vllm_pair.p.url}/v1", api_key="none", max_retries=0)
    return vc, vllm_pair.spec.model


@pytest.fixture(scope="module")
def clients(
    bare_vllm: tuple[Any, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Any, Any]]:
    from harness.vllm.tiny_model import TinyLlamaSpec, build_tiny_llama

    work = tmp_path_factory.mktemp("conformance")
    shutil.copytree(ROOT / "examples", work / "examples")
    (work / "run").mkdir()
    build_tiny_llama(work / "run" / "tiny", TinyLlamaSpec(vocab_size=2048))
    key = "conformance-key-0123456789"
    (work / "run" / "api-keys").write_text(key + "\n")
    env = _env()
    pki = work / "run" / "pki"  # as docs/deploy.md step 1: a CA kept apart, one directory per node
    subprocess.run(["pddlink", "pki", "init", str(pki / "ca")], env=env, check=True, capture_output=True)
    for role, ident in (("md", "md/md0"), ("rld", "rld/rld0"), ("p", "p/p0"), ("router", "router/router0")):
        argv = ["pddlink", "pki", "issue", "--ca", str(pki / "ca"), "--out", str(pki / role), ident]
        subprocess.run(argv, env=env, check=True, capture_output=True)
    procs = []
    try:
        for role in ("md", "rld", "p", "router"):
            cmd = "sidecar" if role != "router" else "router"
            p = _start(
                f"pddlink {cmd} --config examples/deploy/loopback/{role}.toml",
                work,
                env,
                work / f"{role}.log",
                True,
            )
            procs.append(p)
            line = p.stdout.readline()
            assert line.startswith("READY"), (role, (work / f"{role}.log").read_text()[-2000:])
        pc = openai.OpenAI(base_url=ROUTER_URL, api_key=key, max_retries=0)
        yield bare_vllm[0], pc
    finally:
        _stop(procs)


@pytest.fixture(scope="module")
def vllm_clients(bare_vllm: tuple[Any, Path], vllm_pair: Any) -> Iterator[tuple[Any, Any]]:
    """The router (``pddlink router --config``, ``engine = "vllm"``) in front of P and MD as vLLM
    servers of the bare server's model, each beside its pddlink sidecar (the shared pair)."""
    vc, model = bare_vllm
    pair = vllm_pair
    work = Path(tempfile.mkdtemp(prefix="pddlink-conf-"))
    procs = []
    try:
        (work / "router.toml").write_text(
            f'engine = "vllm"\nhost = "127.0.0.1"\ngrpc_port = 0\nhttp_port = {VLLM_ROUTER_PORT}\n'
            f"vocab_size = 1024\nmax_prompt_tokens = 1900\n"
            f'[vllm]\np_url = "{pair.p.url}"\nmd_url = "{pair.md.url}"\nmodel = "{model}"\n'
            f'[api]\nmodel = "tiny"\ntokenizer = "{model}"\n'
        )
        p = _start(f"pddlink router --config {work / 'router.toml'}", work, _env(), work / "router.log", True)
        procs.append(p)
        line = p.stdout.readline()
        assert line.startswith("READY"), (work / "router.log").read_text()[-2000:]
        pc = openai.OpenAI(base_url=f"http://127.0.0.1:{VLLM_ROUTER_PORT}/v1", api_key="none", max_retries=0)
        yield vc, pc
    finally:
        _stop(procs)
        shutil.rmtree(work, ignore_errors=True)


# -- shapes --------------------------------------------------------------------------------------


def shape(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: shape(x) for k, x in v.items()}
    if isinstance(v, list):
        return [shape(v[0])] if v else []
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int | float):
        return "number"
    return "null" if v is None else type(v).__name__


def diff(a: Any, b: Any, path: str = "") -> list[str]:
    """How pddlink's shape ``b`` differs from vLLM's ``a`` (extensions allowed in ``b``)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: missing" for k in a if k not in b]
        out += [f"{path}.{k}: extra" for k in b if k not in a and k not in PDDLINK_EXTENSIONS]
        for k in a:
            if k in b:
                out += diff(a[k], b[k], f"{path}.{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        return diff(a[0], b[0], path + "[]") if a and b else []
    if "null" in (a, b):
        return []  # a nullable field, set on one side only (the models differ): same field, no type clash
    return [] if a == b else [f"{path}: {a} vs {b}"]


def raw(call: Callable[..., Any], **kw: Any) -> tuple[int, Any]:
    try:
        r = call.with_raw_response.create(**kw)  # type: ignore[attr-defined]
        return r.http_response.status_code, r.http_response.json()
    except openai.APIStatusError as exc:
        return exc.status_code, exc.response.json()


def stream(call: Callable[..., Any], **kw: Any) -> list[dict[str, Any]]:
    return [c.model_dump(exclude_unset=True) for c in call.create(stream=True, **kw)]


def stream_parts(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The chunk kinds a stream has: first with content, the one with finish_reason, the usage one."""
    with_choices = [c for c in chunks if c["choices"]]
    parts = {
        "first": with_choices[0],
        "finish": next(c for c in with_choices if c["choices"][0].get("finish_reason")),
    }
    usage = [c for c in chunks if not c["choices"]]
    if usage:
        parts["usage"] = usage[-1]
    return parts


G = {"temperature": 0, "model": "tiny"}
IDS = [5, 6, 7, 8, 9, 10]
MSG = [{"role": "user", "content": "prefill decode relay"}]


def calls(c: Any) -> dict[str, tuple[str, Callable[[], Any]]]:
    cmpl, chat = c.completions, c.chat.completions
    tid = {"extra_body": {"return_token_ids": True}}
    return {
        "models": ("json", lambda: (200, c.models.list().model_dump(exclude_unset=True))),
        "text": ("json", lambda: raw(cmpl, prompt="prefill decode relay", max_tokens=6, **G)),
        "ids": ("json", lambda: raw(cmpl, prompt=IDS, max_tokens=6, **G)),
        "ids_return_token_ids": ("json", lambda: raw(cmpl, prompt=IDS, max_tokens=6, **G, **tid)),
        "max_tokens_1": ("json", lambda: raw(cmpl, prompt=IDS, max_tokens=1, **G)),
        "stop_string": ("json", lambda: raw(cmpl, prompt=IDS, max_tokens=24, stop=[" "], **G, **tid)),
        "stop_token_id": ("stop_id", lambda: None),
        "two_prompts": (
            "json",
            lambda: raw(cmpl, prompt=["prefill decode", "relay main"], max_tokens=4, **G),
        ),
        "seeded_sample": (
            "json",
            lambda: raw(cmpl, prompt=IDS, max_tokens=4, temperature=0.8, seed=7, model="tiny"),
        ),
        "stream_text": ("stream", lambda: stream(cmpl, prompt="prefill decode relay", max_tokens=6, **G)),
        "stream_usage": (
            "stream",
            lambda: stream(cmpl, prompt=IDS, max_tokens=6, stream_options={"include_usage": True}, **G),
        ),
        "stream_ids": ("stream", lambda: stream(cmpl, prompt=IDS, max_tokens=6, **G, **tid)),
        "stream_stop_string": ("stream", lambda: stream(cmpl, prompt=IDS, max_tokens=24, stop=[" "], **G)),
        "stream_two_prompts": ("stream", lambda: stream(cmpl, prompt=[IDS, [11, 12, 13]], max_tokens=3, **G)),
        "chat": ("json", lambda: raw(chat, messages=MSG, max_tokens=6, **G)),
        "chat_stream": ("stream", lambda: stream(chat, messages=MSG, max_tokens=6, **G)),
        "chat_stream_usage": (
            "stream",
            lambda: stream(chat, messages=MSG, max_tokens=6, stream_options={"include_usage": True}, **G),
        ),
        "refuse_max_tokens_0": ("json", lambda: raw(cmpl, prompt=IDS, max_tokens=0, **G)),
        "refuse_temperature": (
            "json",
            lambda: raw(cmpl, prompt=IDS, max_tokens=2, temperature=-1, model="tiny"),
        ),
        "refuse_top_p": ("json", lambda: raw(cmpl, prompt=IDS, max_tokens=2, top_p=2.0, **G)),
        "refuse_empty_prompt": ("json", lambda: raw(cmpl, prompt=[], max_tokens=2, **G)),
        "refuse_unknown_model": (
            "json",
            lambda: raw(cmpl, prompt=IDS, max_tokens=2, temperature=0, model="nope"),
        ),
        "refuse_big_max_tokens": ("json", lambda: raw(cmpl, prompt=IDS, max_tokens=10**7, **G)),
        "n_2": ("json", lambda: raw(cmpl, prompt=IDS, max_tokens=2, n=2, **G)),
        "best_of_2": ("json", lambda: raw(cmpl, prompt=IDS, max_tokens=2, best_of=2, **G)),
    }


def _stop_id_call(c: Any) -> tuple[int, Any]:
    """A stop id that this backend will meet: its own third greedy token."""
    first = c.completions.create(prompt=IDS, max_tokens=3, extra_body={"return_token_ids": True}, **G)
    stop = first.choices[0].token_ids[2]
    return raw(
        c.completions,
        prompt=IDS,
        max_tokens=12,
        extra_body={"stop_token_ids": [stop], "return_token_ids": True},
        **G,
    )


def _semantics(name: str, status: int, body: Any) -> list[str]:
    """What must hold of each answer on its own (both backends)."""
    problems = []
    if name.startswith("refuse"):
        want = 404 if name == "refuse_unknown_model" else 400
        if status != want or "error" not in body:
            problems.append(f"status {status}, wanted {want} with an error object")
        return problems
    if status != 200:
        return [f"status {status}: {body}"]
    if name in ("text", "ids", "ids_return_token_ids", "chat", "two_prompts"):
        problems += [
            f"finish_reason {ch['finish_reason']}"
            for ch in body["choices"]
            if ch["finish_reason"] != "length"
        ]
    if name in ("text", "ids", "chat"):
        u = body["usage"]
        if u["completion_tokens"] != 6 or u["total_tokens"] != u["prompt_tokens"] + 6:
            problems.append(f"usage {u}")
    if name == "stop_token_id":
        ch = body["choices"][0]
        if ch["finish_reason"] != "stop" or ch["stop_reason"] != ch["token_ids"][-1]:
            problems.append(f"stop id: {ch['finish_reason']} {ch['stop_reason']}")
    if name == "stop_string":
        ch = body["choices"][0]
        if ch["stop_reason"] == " " and (" " in ch["text"] or ch["finish_reason"] != "stop"):
            problems.append(f"stop string not cut: {ch['text']!r}")
    return problems


def _output(kind: str, body: Any) -> list[tuple[str, list[int]]]:
    """(text, token ids) of each choice, a stream's chunks joined."""
    chunks = body if kind == "stream" else [body]
    out: dict[int, tuple[str, list[int]]] = {}
    for c in chunks:
        for ch in c.get("choices") or []:
            text, ids = out.get(ch.get("index", 0), ("", []))
            piece = ch.get("text")
            if piece is None:
                piece = (ch.get("delta") or ch.get("message") or {}).get("content") or ""
            out[ch.get("index", 0)] = (text + piece, ids + list(ch.get("token_ids") or []))
    return [out[k] for k in sorted(out)]


def _compare(
    name: str, kind: str, vcall: Any, pcall: Any, vc: Any, pc: Any, exact: bool = False
) -> dict[str, Any]:
    same: list[str] = []
    if kind == "stop_id":
        (vs, vb), (ps, pb) = _stop_id_call(vc), _stop_id_call(pc)
        vfull, pfull = vb, pb
    elif kind == "stream":
        vfull, pfull = vcall(), pcall()
        vb, pb = stream_parts(vfull), stream_parts(pfull)
        if vb["first"] is vb["finish"] or pb["first"] is pb["finish"]:
            del (
                vb["first"],
                pb["first"],
            )  # one model stopped at once (stop string): no middle chunk to compare
        vs = ps = 200
    else:
        (vs, vb), (ps, pb) = vcall(), pcall()
        vfull, pfull = vb, pb
    if exact and name in GREEDY_SAME:  # the same model behind both: the same text and token ids
        vo, po = _output(kind, vfull), _output(kind, pfull)
        if vo != po:
            same.append(f"output differs: vLLM {vo} vs pddlink {po}"[:300])
    if name in DIFFERENT:
        ok = ps == 400 and name.rsplit("_", 1)[0] in pb["error"]["message"]
        return {"call": name, "matched": f"documented difference: pddlink 400 naming it, vLLM {vs}", "ok": ok}
    problems = diff(shape(vb), shape(pb))
    if kind != "stream":
        problems += [f"vllm: {p}" for p in _semantics(name, vs, vb)]
        problems += [f"pddlink: {p}" for p in _semantics(name, ps, pb)]
    else:
        vf, pf = vb["finish"]["choices"][0], pb["finish"]["choices"][0]
        if vf["finish_reason"] != pf["finish_reason"] and "stop_string" not in name:
            problems.append(f"finish_reason {vf['finish_reason']} vs {pf['finish_reason']}")
        if ("usage" in vb) != ("usage" in pb):
            problems.append("usage chunk present in one only")
    problems += same
    what = "status, fields and types" + (
        "" if kind == "stream" else ", finish_reason/usage/refusal semantics"
    )
    if exact and name in GREEDY_SAME:
        what += ", the same text and token ids"
    return {"call": name, "matched": what if not problems else "; ".join(problems[:4]), "ok": not problems}


def _conformance(vc: Any, pc: Any, *, exact: bool, report_env: str) -> None:
    vcalls, pcalls = calls(vc), calls(pc)
    report = []
    for name, (kind, vcall) in vcalls.items():
        pcall = pcalls[name][1]
        try:
            row = _compare(name, kind, vcall, pcall, vc, pc, exact)
        except Exception as exc:  # recorded, so that one broken call does not hide the others
            row = {"call": name, "matched": f"raised {type(exc).__name__}: {exc}"[:300], "ok": False}
        report.append(row)
    width = max(len(r["call"]) for r in report)
    print(
        "\n"
        + "\n".join(f"{'ok ' if r['ok'] else 'BAD'} {r['call']:<{width}}  {r['matched']}" for r in report)
    )
    if os.environ.get(report_env):
        Path(os.environ[report_env]).write_text(json.dumps(report, indent=1))
    assert len(report) >= 20
    assert all(r["ok"] for r in report), [r for r in report if not r["ok"]]


@pytest.mark.timeout(600)
def test_openai_conformance(clients: tuple[Any, Any]) -> None:
    _conformance(*clients, exact=False, report_env="PDDLINK_CONFORMANCE_REPORT")


@pytest.mark.timeout(900)
def test_openai_conformance_router_in_front_of_vllm(vllm_clients: tuple[Any, Any]) -> None:
    """The same calls with the router fronting vLLM: shapes as above, and greedy outputs equal."""
    _conformance(*vllm_clients, exact=True, report_env="PDDLINK_CONFORMANCE_VLLM_REPORT")
