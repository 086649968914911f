"""The router's legs on vLLM: ``RequestRun``'s commands as calls on vLLM's own OpenAI servers.

Each role is a vLLM OpenAI server beside its pddlink vLLM sidecar (``sidecar.vllm_kv``), whose
``PddlinkConnector`` moves the KV; a run's calls go to its route's instances (``router.fleet.Route``:
the P, MD and RLD placement chose, each its ``api_url``). A request takes part in a transfer when
its ``kv_transfer_params`` hold ``{"pddlink": {"transfer": ID, "deadline_s": S}}``; the ID is the
leg's sub-request id. P's may add ``"to": ["rld", "md"]`` (the destinations) and, with pools,
``"md": NAME`` / ``"rld": NAME`` (the route's instances, as the topology P's sidecar reads names
them). The commands become (``VllmCalls``, driven by ``router.leg_driver.LegDriver``)::

  SendPrefill   P:  {prompt ids, max_tokens 1, transfer}  -> vLLM prefills, the connector hands
                    the KV to P's sidecar, which ships it to MD  (-> PrefillDone / PrefillFailed)
  OpenStream MD (P->MD leg)     {the same prompt, stream, the same transfer} -> MD's connector
                    parks the request until the KV is in, then MD streams from the prompt's end
  OpenStream MD (relay leg)     prime: {prompt, max_tokens 1, transfer}: MD loads the KV into its
                    prefix cache and waits for the handoff
  OpenStream RLD                {prompt, stream} on RLD (the KV from P when ``rld_gets_kv``)
  StartHandoff  by token ids: MD gets prompt + the k ids RLD streamed so far as one request
                    (the prompt's KV from its prefix cache, the k ids recomputed in one extend
                    step), then decodes. One-shot: RLD's stream is closed at once; catch-up: RLD
                    keeps streaming until MD's stream reaches RLD's position. Decided as
                    RLD's sidecar decides for the reference engine (``pddlink.lifecycle.
                    handoff_choice``: ``open_handoff``, and ``CatchUpRace`` for the race)
  TakeOver      MD extends prompt + the given ids (RLD lost)
  CancelStreams the role's HTTP streams are closed (vLLM aborts the request; the connector's
                    ``request_finished`` frees what the sidecars hold)
  (run's end)   a relay leg's MD prime still loading when the run finished on RLD is left to
                    end within the deadline: MD keeps the turn's KV for the conversation's next turn

Tokens carry absolute positions (``len(leg prompt) + i``); every event goes to ``inbox``, and the
lifecycle machine merges, falls back and ends the run. Every call runs under the request's time left;
one that raises what it does not expect (an answer it cannot read: a malformed SSE line, a reply
without ``choices``) ends the run at once (``router.leg_tasks.watch_leg``: ``leg_crashed``).
A stream that vLLM ends with a finish reason other than ``length``/``stop`` (a failed KV load under
policy ``fail``) is a failed stream, never tokens.

``VllmBackend`` (``router.vllm_backend``) is the router's ``EngineBackend`` for vLLM.
``generate_alone`` is the exactness reference: one vLLM generating alone, no connector involved.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import httpx

from engines_adapter.base import SamplingParams
from pddlink.errors import DeadlineExceeded, RemoteError
from pddlink.handoff import HandoffMode
from pddlink.lifecycle import (
    HandoffDone,
    HandoffResult,
    Leg,
    MdReady,
    PrefillDone,
    PrefillFailed,
    PrefillReport,
    SendPrefill,
    StreamClosed,
    StreamEnd,
    StreamEnded,
    TakeOver,
    TakeoverFailed,
    TokenArrived,
)
from pddlink.lifecycle.handoff_choice import CatchUpRace, HandoffAsk, RaceVerdict, open_handoff
from pddlink.lifecycle.outcomes import HandoffOutcome
from pddlink.roles import Role
from pddlink.routing import HandoffDecision, Pipeline, RecomputeMode
from router.fleet import Route
from router.leg_driver import Call, Cluster, LegDriver, LegRun
from router.leg_tasks import TaskKind

if TYPE_CHECKING:
    from router.vllm_backend import VllmBackend
from router.vllm_http import (
    FINISHED,
    cached_tokens,
    error_text,
    generate_alone,
    logprob_rows,
    post_completion,
    sampling_body,
)

__all__ = ["VllmCalls", "generate_alone", "sampling_body", "vllm_legs"]

NOTHING_HANDED = ":before_rld_first_token"  # a one-shot handoff's detail when RLD had streamed nothing


def vllm_legs(
    cluster: Cluster, backend: VllmBackend, deadline: float, route: Route | None = None
) -> LegDriver:
    """One run's legs on ``route``'s vLLM servers (None: the topology's first of each role)."""
    run = LegRun(cluster, deadline)
    return LegDriver(run, VllmCalls(run, backend, route))


@dataclass(slots=True)
class _LegState:
    """What ``VllmCalls`` keeps of one leg (by its sub-request id) while the run lasts."""

    leg: Leg
    rld_tokens: list[int] = field(default_factory=list)  # what RLD streamed so far
    race: CatchUpRace | None = None  # RLD's position, and MD's in a catch-up
    mode: HandoffMode | None = None  # the handoff's, once it opened
    rld_closed: StreamClosed | None = None  # how RLD's stream ended


class VllmCalls:
    """``router.leg_driver.RoleCalls`` on vLLM servers; see the module docstring. The answers'
    logprobs rows (``vllm_http.logprob_rows``, by role and absolute position: the router attaches
    each merged token's own), P's prefix hit as vLLM's usage reports it (``cached_tokens``;
    ``created_cache_tokens``: the prompt's whole blocks it computed and cached) and P's prompt
    logprobs (echo) go to the run (``LegRun``)."""

    # every call on the role: MD's prime, extend and take-over are streams too
    stream_kinds = frozenset({TaskKind.STREAM, TaskKind.PRIME, TaskKind.EXTEND, TaskKind.TAKE_OVER})

    def __init__(self, run: LegRun, backend: VllmBackend, route: Route | None = None) -> None:
        self.r = run
        self.b = backend
        self.retarget(route if route is not None else backend.first_route())
        self.legs: dict[str, _LegState] = {}

    def retarget(self, route: Route) -> None:
        """The calls from here on go to ``route``'s servers (a move within a role: a new leg on
        another MD or P, whose P is told the new MD's name); those under way keep theirs."""
        self.route = route
        self.p_url, self.md_url = route.p.instance.api_url, route.md.instance.api_url
        self.rld_url = route.rld.instance.api_url if route.rld is not None else ""

    def _kv(self, sid: str) -> dict[str, Any]:
        share = self.b.v.wan_share * self.r.left()  # MD's failure report still arrives in time
        return {"pddlink": {"transfer": sid, "deadline_s": share}}

    def _destinations(self, rld: bool, md: bool) -> dict[str, Any]:
        """Where P ships this leg's KV: ``to`` (the roles); with pools, each role's instance by its
        name in the topology (P's sidecar has a link to each)."""
        out: dict[str, Any] = {"to": [r for r, on in (("rld", rld), ("md", md)) if on]}
        if self.b.pools:
            if md:
                out["md"] = self.route.md.name
            if rld and self.route.rld is not None:
                out["rld"] = self.route.rld.name
        return out

    def _body(self, prompt: tuple[int, ...], sampling: SamplingParams, max_tokens: int = 0) -> dict[str, Any]:
        """One call's body; ``max_tokens`` 0: the sampling's own (P's prefill asks for 1: its
        ``min_tokens`` no more than that, which still masks the stop tokens at the first token)."""
        if max_tokens and sampling.min_tokens > max_tokens:
            sampling = replace(sampling, min_tokens=max_tokens)
        return {
            "model": self.b.v.model,
            "prompt": list(prompt),
            "return_token_ids": True,
            **sampling_body(sampling),
            "max_tokens": max_tokens or sampling.max_tokens,
        }

    def stream(self, on: Role, leg: Leg) -> tuple[TaskKind, Call]:
        self.legs.setdefault(leg.sid, _LegState(leg))
        if on is Role.RLD:
            return TaskKind.STREAM, self._rld_stream(leg)
        if leg.pipeline is Pipeline.P_RLD_MD:
            return TaskKind.PRIME, self._md_prime(leg)
        return TaskKind.STREAM, self._md_stream(leg)

    def prefill(self, cmd: SendPrefill) -> Call:
        return self._prefill(cmd)

    def start_handoff(self, sid: str) -> Call:
        return self._handoff(sid)

    def take_over(self, cmd: TakeOver) -> Call:
        return self._take_over(cmd)

    def _prime(self, sid: str) -> asyncio.Task[Any] | None:
        """Relay leg ``sid``'s MD prime (loading the prompt's KV), if it has one."""
        return self.r.tasks.latest(TaskKind.PRIME, sid)

    # -- P ---------------------------------------------------------------------------------------

    async def _prefill(self, cmd: SendPrefill) -> None:
        leg = cmd.leg
        t0 = time.monotonic()
        body = self._body(leg.prompt, leg.sampling, 1)
        if leg.sampling.prompt_logprobs is not None:  # only the prefill is asked (MD's prompt holds output)
            body["prompt_logprobs"] = leg.sampling.prompt_logprobs
        rld_kv = cmd.ship_to_rld and self.b.v.rld_gets_kv and self.route.rld is not None
        if cmd.ship_to_md or rld_kv:
            body["kv_transfer_params"] = self._kv(leg.sid)
            if self.b.v.rld_gets_kv or self.b.pools:  # P's sidecar has several: name this leg's
                body["kv_transfer_params"]["pddlink"].update(self._destinations(rld_kv, cmd.ship_to_md))
        try:
            out = await post_completion(self.b.http, self.p_url, body, self.r.deadline)
        except (RemoteError, DeadlineExceeded) as exc:
            await self.r.inbox.put(PrefillFailed(leg.sid, exc.message))
            return
        seconds = time.monotonic() - t0
        cached = cached_tokens(out)
        for row in logprob_rows(out["choices"][0], leg.sampling.logprobs_as_ids)[:1]:
            self.r.logprobs[Role.P.value, len(leg.prompt)] = row
        if self.r.prompt_logprobs is None:
            self.r.prompt_logprobs = out["choices"][0].get("prompt_logprobs")
        if self.r.prompt_usage is None:  # the first leg's (a fallback leg's prompt holds output too)
            whole = len(leg.prompt) // self.b.fleet.block_tokens() * self.b.fleet.block_tokens()
            self.r.prompt_usage = {"cached_tokens": cached, "created_cache_tokens": max(0, whole - cached)}
        self.r.cluster.on_prefilled(leg.sid, len(leg.prompt) - cached, seconds)
        report = PrefillReport(
            first_token=int(out["choices"][0]["token_ids"][0]),
            md_ok=cmd.ship_to_md,  # the shipment is under way; MD's stream says whether it landed
            rld_ok=cmd.ship_to_rld,
            p_cached_tokens=cached,
            prefill_seconds=seconds,
            fast_path="tcp" if cmd.ship_to_rld and self.b.v.rld_gets_kv else "",
        )
        await self.r.inbox.put(PrefillDone(leg.sid, report))

    # -- streams ---------------------------------------------------------------------------------

    async def _stream(
        self,
        role: Role,
        url: str,
        sid: str,
        prompt: tuple[int, ...],
        body: dict[str, Any],
        on_token: Any = None,
    ) -> StreamClosed:
        """One streaming completion: each token to the inbox at its absolute position; how it ended."""
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        pos = len(prompt)
        finish = ""
        as_ids = bool(body.get("return_tokens_as_token_ids"))  # the rows name tokens by id
        try:
            async with self.b.http.stream(
                "POST", url + "/v1/completions", json=body, timeout=self.r.left()
            ) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread())[:300].decode(errors="replace")
                    return StreamClosed(StreamEnd.FAILED, f"http_{resp.status_code}:{text}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("error"):  # vLLM failed the request mid-stream (a KV load, say)
                        return StreamClosed(StreamEnd.FAILED, f"vllm_error:{error_text(chunk)}"[:200])
                    for choice in chunk.get("choices") or []:
                        ids = [int(t) for t in choice.get("token_ids") or []]
                        rows = logprob_rows(choice, as_ids)
                        finish = choice.get("finish_reason") or finish
                        for i, tok in enumerate(ids):
                            last = bool(finish) and i == len(ids) - 1
                            if finish and finish not in FINISHED:
                                break  # never tokens from a request vLLM failed
                            if i < len(rows):
                                self.r.logprobs[role.value, pos] = rows[i]
                            await self.r.inbox.put(TokenArrived(sid, role, pos, tok, last))
                            pos += 1
                            if on_token is not None:
                                on_token(pos, tok)
        except httpx.TimeoutException:
            return StreamClosed(StreamEnd.FAILED, "deadline_exceeded")
        except httpx.HTTPError as exc:
            return StreamClosed(StreamEnd.FAILED, f"unreachable:{type(exc).__name__}")
        if finish in FINISHED:
            return StreamClosed(StreamEnd.FINISHED, finish)
        return StreamClosed(StreamEnd.FAILED, f"finish_reason_{finish or 'missing'}")

    async def _md_stream(self, leg: Leg) -> None:
        """P->MD: MD loads the transfer (unless it recomputes the prompt itself) and streams."""
        body = self._body(leg.prompt, leg.sampling, leg.sampling.max_tokens)
        if leg.recompute is RecomputeMode.NONE:
            body["kv_transfer_params"] = self._kv(leg.sid)
        closed = await self._stream(Role.MD, self.md_url, leg.sid, leg.prompt, body)
        await self.r.inbox.put(StreamEnded(leg.sid, Role.MD, closed))

    async def _md_prime(self, leg: Leg) -> bool:
        """Relay leg: MD gets the prompt's KV into its prefix cache (loads P's transfer, or on relay
        + recompute prefills the prompt itself, then ``MdReady``) and waits for the handoff. A
        failed load is MD lost (RLD finishes). True once MD holds the prompt's blocks."""
        body = self._body(leg.prompt, leg.sampling, 1)
        recompute = leg.recompute is not RecomputeMode.NONE
        if not recompute:
            body["kv_transfer_params"] = self._kv(leg.sid)
        t0 = time.monotonic()
        try:
            out = await post_completion(self.b.http, self.md_url, body, self.r.deadline)
        except (RemoteError, DeadlineExceeded) as exc:
            closed = StreamClosed(StreamEnd.FAILED, f"md_prime:{exc.message}"[:200])
            await self.r.inbox.put(StreamEnded(leg.sid, Role.MD, closed))
            return False
        finish = out["choices"][0].get("finish_reason")
        if finish not in FINISHED:
            closed = StreamClosed(StreamEnd.FAILED, f"md_kv_load_failed:{finish}")
            await self.r.inbox.put(StreamEnded(leg.sid, Role.MD, closed))
            return False
        if recompute:
            seconds, cached = time.monotonic() - t0, cached_tokens(out)
            self.r.cluster.on_md_ready(leg.sid, len(leg.prompt) - cached, seconds)
            await self.r.inbox.put(MdReady(leg.sid, seconds, cached))
        return True

    async def _rld_stream(self, leg: Leg) -> None:
        url = self.rld_url
        body = self._body(leg.prompt, leg.sampling, leg.sampling.max_tokens)
        if self.b.v.rld_gets_kv:  # the same transfer: RLD's vLLM parks it until the fast path landed
            body["kv_transfer_params"] = self._kv(leg.sid)
        st = self.legs[leg.sid]
        got = st.rld_tokens
        race = st.race = CatchUpRace(len(leg.prompt))

        def seen(pos: int, tok: int) -> None:
            got.append(tok)
            race.rld_token(pos - 1)

        closed = StreamClosed(StreamEnd.FAILED, "rld_cancelled")
        try:
            closed = await self._stream(Role.RLD, url, leg.sid, leg.prompt, body, seen)
        except asyncio.CancelledError:
            mode = st.mode
            if mode is not None:  # the handoff closed RLD's stream: it handed the request over
                await self.r.inbox.put(
                    StreamEnded(leg.sid, Role.RLD, StreamClosed(StreamEnd.HANDED_OFF, mode.value), mode)
                )
            raise
        st.rld_closed = closed
        await self.r.inbox.put(StreamEnded(leg.sid, Role.RLD, closed))

    def _rld_lost(self, sid: str) -> bool:
        """RLD's stream ended without finishing: the machine's RLD-lost row decides (MD takes over
        from the merged position); the handoff must not also report on it."""
        st = self.legs.get(sid)
        closed = st.rld_closed if st is not None else None
        return closed is not None and closed.end is not StreamEnd.FINISHED

    # -- the handoff by token ids ----------------------------------------------------------------

    async def _handoff(self, sid: str) -> None:
        st = self.legs.get(sid)
        leg = st.leg if st is not None else None
        rld = next(iter(self.r.tasks.running(role=Role.RLD, kinds={TaskKind.STREAM})), None)
        prime = self._prime(sid)
        if prime is not None and rld is not None:
            # MD holds the prompt's KV once its prime answered (the transfer landed and loaded)
            await asyncio.wait({prime, rld}, timeout=self.r.left(), return_when=asyncio.FIRST_COMPLETED)
        if self._rld_lost(sid):
            # RLD died while MD loaded: a FINISHED_ON_RLD here made the machine cancel MD's streams,
            # the take-over among them (measured: RLD killed mid-stream, the request ran into its
            # deadline)
            return
        ask = HandoffAsk(
            generated=len(st.rld_tokens) if st is not None else 0,
            max_tokens=leg.sampling.max_tokens if leg is not None else 0,
            rld_load=self.b.rld_load(self.r.cluster.rld_active),
            rld_decoding=leg is not None and rld is not None and not rld.done(),
            md_holds_kv=prime is None or (prime.done() and prime.result() is True),
        )
        decision = open_handoff(ask, self.b.policy)
        if not isinstance(decision, HandoffDecision):
            await self.r.inbox.put(HandoffDone(sid, decision))
            return
        assert st is not None and leg is not None and rld is not None
        mode = st.mode = decision.mode
        given = tuple(st.rld_tokens)
        if mode is HandoffMode.ONE_SHOT:
            rld.cancel()  # RLD is aborted at once; MD continues from what it streamed
            self.r.tasks.spawn(TaskKind.EXTEND, Role.MD, sid, self._extend(leg, given, None))
            # MD held the KV before RLD's first token (no WAN delay to speak of): MD makes every
            # token, a P->MD run in effect, and the trace says so rather than count a handoff
            detail = "" if given else NOTHING_HANDED
            await self.r.inbox.put(HandoffDone(sid, HandoffResult(HandoffOutcome.HANDED_OFF, detail), mode))
            return
        # catch-up: RLD keeps streaming until MD's stream reaches RLD's position. The switch is
        # posted from MD's stream at that token, before MD's later tokens reach the inbox: posted by
        # this task instead, it came after them whenever MD's rest arrived in one burst, the run
        # ended first and the trace said no handoff had started although MD made most tokens
        if st.race is None:
            st.race = CatchUpRace(len(leg.prompt) + len(given))
        race = st.race
        switched = asyncio.get_running_loop().create_future()

        def switch() -> None:
            if race.handed_off and not switched.done():
                switched.set_result(None)
                rld.cancel()
                self.r.inbox.put_nowait(HandoffDone(sid, HandoffResult(HandoffOutcome.HANDED_OFF), mode))

        extend = self.r.tasks.spawn(TaskKind.EXTEND, Role.MD, sid, self._extend(leg, given, switch, race))
        done, _ = await asyncio.wait(
            {switched, rld}, timeout=self.r.left(), return_when=asyncio.FIRST_COMPLETED
        )
        if switched.done():
            return
        if rld in done:  # RLD ended before MD caught up: MD's extend is not needed
            if race.rld_ended(finished=not self._rld_lost(sid)) is RaceVerdict.RLD_LOST:
                extend.cancel()  # RLD died instead: the machine's take-over continues
                return
            if race.verdict is RaceVerdict.RLD_FINISHED:
                extend.cancel()
                await self.r.inbox.put(HandoffDone(sid, HandoffResult(HandoffOutcome.FINISHED_ON_RLD), mode))
                return
        race.out_of_time()  # out of time waiting: MD goes on alone
        switch()

    async def _extend(
        self,
        leg: Leg,
        given: tuple[int, ...],
        reached: Callable[[], None] | None,
        race: CatchUpRace | None = None,
    ) -> None:
        """MD continues after prompt + ``given`` (the prompt's blocks from its prefix cache);
        catch-up: each of its tokens goes to the ``race``, ``reached()`` once MD is level with RLD."""
        prompt = leg.prompt + given
        body = self._body(prompt, leg.sampling.after(len(given)))

        def seen(pos: int, tok: int) -> None:
            caught_up = race is not None and race.md_token(pos - 1) is RaceVerdict.MD_CAUGHT_UP
            if caught_up and reached is not None:
                reached()

        closed = await self._stream(Role.MD, self.md_url, leg.sid, prompt, body, seen)
        await self.r.inbox.put(StreamEnded(leg.sid, Role.MD, closed))

    async def _take_over(self, cmd: TakeOver) -> None:
        """MD takes over from the given ids (RLD lost); MD recomputes what its cache lacks."""
        leg = cmd.leg
        if cmd.emit_given:
            for i, tok in enumerate(cmd.token_ids):
                pos = cmd.first_position + i
                row = self.r.logprobs.get((Role.RLD.value, pos))  # RLD drew it; MD sends it on
                if row is not None:
                    self.r.logprobs[Role.MD.value, pos] = row
                await self.r.inbox.put(TokenArrived(leg.sid, Role.MD, pos, tok))
        prompt = leg.prompt + cmd.token_ids
        body = self._body(prompt, leg.sampling.after(len(cmd.token_ids)))
        closed = await self._stream(Role.MD, self.md_url, leg.sid, prompt, body)
        if closed.end is not StreamEnd.FINISHED:
            await self.r.inbox.put(TakeoverFailed(leg.sid, closed.render()))
            return
        await self.r.inbox.put(StreamEnded(leg.sid, Role.MD, closed))

    # -- teardown --------------------------------------------------------------------------------

    async def close(self, *, finished: bool) -> None:
        """Every stream is closed. A relay leg's MD prime that is still loading the prompt's KV when
        the run finished on RLD is left to end on its own (it streams nothing; it is bounded by the
        request's deadline): MD then holds the conversation for its next turn, which ships only what
        is new. Cancelling it aborted P's WAN transfer too, so MD never held any turn's KV and every
        turn shipped the whole history again (measured: the demo's PDD phase matched 0 tokens on MD
        and no handoff happened). A run that failed or was cancelled cancels its primes too."""
        primes = set(self.r.tasks.running(kinds={TaskKind.PRIME})) if finished else set()
        tasks = [t for t in self.r.tasks if t not in primes]
        for task in tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)
        if primes:
            _, late = await asyncio.wait(primes, timeout=self.r.left() + 1.0)
            for task in late:
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.gather(*primes, return_exceptions=True)
