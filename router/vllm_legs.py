"""The router's legs on vLLM: ``RequestRun``'s commands as calls on vLLM's own OpenAI servers.

Each role is a vLLM OpenAI server beside its pddlink vLLM sidecar (``sidecar.vllm_kv``), whose
``PddlinkConnector`` moves the KV. A request takes part in a transfer when its
``kv_transfer_params`` hold ``{"pddlink": {"transfer": ID, "deadline_s": S}}``; the ID is the leg's
sub-request id. The commands become (``VllmLegs``)::

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
                    keeps streaming until MD's stream reaches RLD's position. Chosen by
                    RLD's load (``choose_handoff_mode``), as RLD's sidecar does for the reference
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
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import httpx

from engines_adapter.base import SamplingParams
from pddlink.errors import DeadlineExceeded, RemoteError
from pddlink.handoff import HandoffMode
from pddlink.lifecycle import (
    CancelStreams,
    DetachHandoff,
    HandoffDone,
    HandoffResult,
    Leg,
    MdReady,
    OpenStream,
    PrefillDone,
    PrefillFailed,
    PrefillReport,
    ReleaseRldSlot,
    RunCommand,
    RunEvent,
    SendPrefill,
    StartHandoff,
    StreamClosed,
    StreamEnd,
    StreamEnded,
    TakeOver,
    TakeoverFailed,
    TokenArrived,
)
from pddlink.lifecycle.outcomes import HandoffOutcome
from pddlink.roles import Role
from pddlink.routing import Pipeline, RecomputeMode, choose_handoff_mode
from router.leg_tasks import LegTasks, TaskKind
from router.legs import Cluster

if TYPE_CHECKING:
    from router.vllm_backend import VllmBackend
from router.vllm_http import (
    FINISHED,
    MIN_TIMEOUT_S,
    cached_tokens,
    error_text,
    generate_alone,
    logprob_rows,
    post_completion,
    sampling_body,
)

__all__ = ["VllmLegs", "generate_alone", "sampling_body"]

NOTHING_HANDED = ":before_rld_first_token"  # a one-shot handoff's detail when RLD had streamed nothing


class VllmLegs:
    """``router.backend.Legs`` on vLLM servers; see the module docstring."""

    def __init__(self, cluster: Cluster, backend: VllmBackend, deadline: float) -> None:
        self.c = cluster
        self.b = backend
        self.deadline = deadline
        self.inbox: asyncio.Queue[RunEvent] = asyncio.Queue()
        self.tasks = LegTasks(self.inbox)
        self.rld_tokens: dict[str, list[int]] = {}  # per leg: what RLD streamed so far
        self.rld_pos: dict[str, int] = {}  # per leg: the next position RLD will stream
        self.md_reached: dict[str, asyncio.Event] = {}  # catch-up: MD streamed RLD's position
        self.handoff_mode: dict[str, HandoffMode] = {}
        self._legs: dict[str, Leg] = {}
        self.primes: dict[str, asyncio.Task[bool]] = {}  # relay legs: MD loading the prompt's KV
        self.rld_closed: dict[str, StreamClosed] = {}  # per leg: how RLD's stream ended
        # (role, absolute position) -> vLLM's logprobs row of the token that role drew there
        # (``vllm_http.logprob_rows``), when the request asked for logprobs: the router attaches
        # each merged token's own
        self.logprobs: dict[tuple[str, int], dict[str, Any]] = {}
        # P's prefix hit as vLLM's usage reports it (``cached_tokens``; ``created_cache_tokens``:
        # the prompt's whole blocks it computed and cached), once P answered the prefill
        self.prompt_usage: dict[str, int] | None = None
        self.prompt_logprobs: list[Any] | None = None  # P's, in vLLM's JSON (echo with logprobs)

    def left(self) -> float:
        return max(self.deadline - time.monotonic(), MIN_TIMEOUT_S)

    def _kv(self, sid: str) -> dict[str, Any]:
        share = self.b.v.wan_share * self.left()  # MD's failure report still arrives in time
        return {"pddlink": {"transfer": sid, "deadline_s": share}}

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

    def execute(self, cmd: RunCommand) -> None:
        if isinstance(cmd, OpenStream):
            sid = cmd.leg.sid
            self._legs[sid] = cmd.leg
            if cmd.on is Role.RLD:
                self.c.rld_active += 1
                self.tasks.spawn(TaskKind.STREAM, Role.RLD, sid, self._rld_stream(cmd.leg))
            elif cmd.leg.pipeline is Pipeline.P_RLD_MD:
                self.primes[sid] = self.tasks.spawn(TaskKind.PRIME, Role.MD, sid, self._md_prime(cmd.leg))
            else:
                self.tasks.spawn(TaskKind.STREAM, Role.MD, sid, self._md_stream(cmd.leg))
        elif isinstance(cmd, SendPrefill):
            self.tasks.spawn(TaskKind.PREFILL, Role.P, cmd.leg.sid, self._prefill(cmd))
        elif isinstance(cmd, StartHandoff):
            self.tasks.spawn(TaskKind.HANDOFF, None, cmd.sid, self._handoff(cmd.sid))
        elif isinstance(cmd, TakeOver):
            self.tasks.spawn(TaskKind.TAKE_OVER, Role.MD, cmd.leg.sid, self._take_over(cmd))
        elif isinstance(cmd, CancelStreams):
            self.tasks.cancel(role=cmd.on)  # every call on the role: MD's take-over and extend too
        elif isinstance(cmd, ReleaseRldSlot):
            self.c.rld_active -= 1
        elif isinstance(cmd, DetachHandoff):
            self.tasks.forget(TaskKind.HANDOFF)

    # -- P ---------------------------------------------------------------------------------------

    async def _prefill(self, cmd: SendPrefill) -> None:
        leg = cmd.leg
        t0 = time.monotonic()
        body = self._body(leg.prompt, leg.sampling, 1)
        if leg.sampling.prompt_logprobs is not None:  # only the prefill is asked (MD's prompt holds output)
            body["prompt_logprobs"] = leg.sampling.prompt_logprobs
        rld_kv = cmd.ship_to_rld and self.b.v.rld_gets_kv
        if cmd.ship_to_md or rld_kv:
            body["kv_transfer_params"] = self._kv(leg.sid)
            if self.b.v.rld_gets_kv:  # P's sidecar has both destinations: name this leg's
                to = [r for r, on in (("rld", rld_kv), ("md", cmd.ship_to_md)) if on]
                body["kv_transfer_params"]["pddlink"]["to"] = to
        try:
            out = await post_completion(self.b.http, self.b.v.p_url, body, self.deadline)
        except (RemoteError, DeadlineExceeded) as exc:
            await self.inbox.put(PrefillFailed(leg.sid, exc.message))
            return
        seconds = time.monotonic() - t0
        cached = cached_tokens(out)
        for row in logprob_rows(out["choices"][0])[:1]:
            self.logprobs[Role.P.value, len(leg.prompt)] = row
        if self.prompt_logprobs is None:
            self.prompt_logprobs = out["choices"][0].get("prompt_logprobs")
        if self.prompt_usage is None:  # the first leg's (a fallback leg's prompt holds output too)
            whole = len(leg.prompt) // self.b.fleet.block_tokens() * self.b.fleet.block_tokens()
            self.prompt_usage = {"cached_tokens": cached, "created_cache_tokens": max(0, whole - cached)}
        self.c.on_prefilled(leg.sid, len(leg.prompt) - cached, seconds)
        report = PrefillReport(
            first_token=int(out["choices"][0]["token_ids"][0]),
            md_ok=cmd.ship_to_md,  # the shipment is under way; MD's stream says whether it landed
            rld_ok=cmd.ship_to_rld,
            p_cached_tokens=cached,
            prefill_seconds=seconds,
            fast_path="tcp" if cmd.ship_to_rld and self.b.v.rld_gets_kv else "",
        )
        await self.inbox.put(PrefillDone(leg.sid, report))

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
        try:
            async with self.b.http.stream(
                "POST", url + "/v1/completions", json=body, timeout=self.left()
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
                        rows = logprob_rows(choice)
                        finish = choice.get("finish_reason") or finish
                        for i, tok in enumerate(ids):
                            last = bool(finish) and i == len(ids) - 1
                            if finish and finish not in FINISHED:
                                break  # never tokens from a request vLLM failed
                            if i < len(rows):
                                self.logprobs[role.value, pos] = rows[i]
                            await self.inbox.put(TokenArrived(sid, role, pos, tok, last))
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
        closed = await self._stream(Role.MD, self.b.v.md_url, leg.sid, leg.prompt, body)
        await self.inbox.put(StreamEnded(leg.sid, Role.MD, closed))

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
            out = await post_completion(self.b.http, self.b.v.md_url, body, self.deadline)
        except (RemoteError, DeadlineExceeded) as exc:
            closed = StreamClosed(StreamEnd.FAILED, f"md_prime:{exc.message}"[:200])
            await self.inbox.put(StreamEnded(leg.sid, Role.MD, closed))
            return False
        finish = out["choices"][0].get("finish_reason")
        if finish not in FINISHED:
            closed = StreamClosed(StreamEnd.FAILED, f"md_kv_load_failed:{finish}")
            await self.inbox.put(StreamEnded(leg.sid, Role.MD, closed))
            return False
        if recompute:
            seconds, cached = time.monotonic() - t0, cached_tokens(out)
            self.c.on_md_ready(leg.sid, len(leg.prompt) - cached, seconds)
            await self.inbox.put(MdReady(leg.sid, seconds, cached))
        return True

    async def _rld_stream(self, leg: Leg) -> None:
        url = self.b.v.rld_url
        body = self._body(leg.prompt, leg.sampling, leg.sampling.max_tokens)
        if self.b.v.rld_gets_kv:  # the same transfer: RLD's vLLM parks it until the fast path landed
            body["kv_transfer_params"] = self._kv(leg.sid)
        got = self.rld_tokens.setdefault(leg.sid, [])
        self.rld_pos[leg.sid] = len(leg.prompt)

        def seen(pos: int, tok: int) -> None:
            got.append(tok)
            self.rld_pos[leg.sid] = pos

        closed = StreamClosed(StreamEnd.FAILED, "rld_cancelled")
        try:
            closed = await self._stream(Role.RLD, url, leg.sid, leg.prompt, body, seen)
        except asyncio.CancelledError:
            mode = self.handoff_mode.get(leg.sid)
            if mode is not None:  # the handoff closed RLD's stream: it handed the request over
                await self.inbox.put(
                    StreamEnded(leg.sid, Role.RLD, StreamClosed(StreamEnd.HANDED_OFF, mode.value), mode)
                )
            raise
        self.rld_closed[leg.sid] = closed
        await self.inbox.put(StreamEnded(leg.sid, Role.RLD, closed))

    def _rld_lost(self, sid: str) -> bool:
        """RLD's stream ended without finishing: the machine's RLD-lost row decides (MD takes over
        from the merged position); the handoff must not also report on it."""
        closed = self.rld_closed.get(sid)
        return closed is not None and closed.end is not StreamEnd.FINISHED

    # -- the handoff by token ids ----------------------------------------------------------------

    async def _handoff(self, sid: str) -> None:
        leg = self._legs.get(sid)
        rld = next(iter(self.tasks.running(role=Role.RLD, kinds={TaskKind.STREAM})), None)
        prime = self.primes.get(sid)
        if prime is not None and rld is not None:
            # MD holds the prompt's KV once its prime answered (the transfer landed and loaded)
            await asyncio.wait({prime, rld}, timeout=self.left(), return_when=asyncio.FIRST_COMPLETED)
        if self._rld_lost(sid):
            # RLD died while MD loaded: a FINISHED_ON_RLD here made the machine cancel MD's streams,
            # the take-over among them (measured: RLD killed mid-stream, the request ran into its
            # deadline)
            return
        if leg is None or rld is None or rld.done():
            await self.inbox.put(HandoffDone(sid, HandoffResult(HandoffOutcome.FINISHED_ON_RLD)))
            return
        if prime is not None and (not prime.done() or prime.result() is not True):
            result = HandoffResult(HandoffOutcome.FAILED, "md_kv_not_loaded")
            await self.inbox.put(HandoffDone(sid, result))
            return
        mode = choose_handoff_mode(self.b.rld_load(self.c.rld_active), self.b.policy).mode
        given = tuple(self.rld_tokens.get(sid, ()))
        if leg.sampling.max_tokens - len(given) <= 1:
            await self.inbox.put(HandoffDone(sid, HandoffResult(HandoffOutcome.FINISHED_ON_RLD)))
            return
        self.handoff_mode[sid] = mode
        if mode is HandoffMode.ONE_SHOT:
            rld.cancel()  # RLD is aborted at once; MD continues from what it streamed
            self.tasks.spawn(TaskKind.EXTEND, Role.MD, sid, self._extend(leg, given, None))
            # MD held the KV before RLD's first token (no WAN delay to speak of): MD makes every
            # token, a P->MD run in effect, and the trace says so rather than count a handoff
            detail = "" if given else NOTHING_HANDED
            await self.inbox.put(HandoffDone(sid, HandoffResult(HandoffOutcome.HANDED_OFF, detail), mode))
            return
        # catch-up: RLD keeps streaming until MD's stream reaches RLD's position. The switch is
        # posted from MD's stream at that token, before MD's later tokens reach the inbox: posted by
        # this task instead, it came after them whenever MD's rest arrived in one burst, the run
        # ended first and the trace said no handoff had started although MD made most tokens
        switched = asyncio.get_running_loop().create_future()

        def switch() -> None:
            if not switched.done():
                switched.set_result(None)
                rld.cancel()
                self.inbox.put_nowait(HandoffDone(sid, HandoffResult(HandoffOutcome.HANDED_OFF), mode))

        extend = self.tasks.spawn(TaskKind.EXTEND, Role.MD, sid, self._extend(leg, given, switch))
        done, _ = await asyncio.wait(
            {switched, rld}, timeout=self.left(), return_when=asyncio.FIRST_COMPLETED
        )
        if switched.done():
            return
        if rld in done:  # RLD finished before MD caught up: MD's extend is not needed
            extend.cancel()
            if self._rld_lost(sid):  # RLD died instead: the machine's take-over continues
                return
            await self.inbox.put(HandoffDone(sid, HandoffResult(HandoffOutcome.FINISHED_ON_RLD), mode))
            return
        switch()  # out of time waiting: MD goes on alone

    async def _extend(self, leg: Leg, given: tuple[int, ...], reached: Callable[[], None] | None) -> None:
        """MD continues after prompt + ``given`` (the prompt's blocks from its prefix cache);
        ``reached()`` once MD's stream is at RLD's position (catch-up)."""
        prompt = leg.prompt + given
        body = self._body(prompt, leg.sampling.after(len(given)))

        def seen(pos: int, tok: int) -> None:
            if reached is not None and pos >= self.rld_pos.get(leg.sid, 0):
                reached()

        closed = await self._stream(Role.MD, self.b.v.md_url, leg.sid, prompt, body, seen)
        await self.inbox.put(StreamEnded(leg.sid, Role.MD, closed))

    async def _take_over(self, cmd: TakeOver) -> None:
        """MD takes over from the given ids (RLD lost); MD recomputes what its cache lacks."""
        leg = cmd.leg
        if cmd.emit_given:
            for i, tok in enumerate(cmd.token_ids):
                pos = cmd.first_position + i
                row = self.logprobs.get((Role.RLD.value, pos))  # RLD drew it; MD sends it on
                if row is not None:
                    self.logprobs[Role.MD.value, pos] = row
                await self.inbox.put(TokenArrived(leg.sid, Role.MD, pos, tok))
        prompt = leg.prompt + cmd.token_ids
        body = self._body(prompt, leg.sampling.after(len(cmd.token_ids)))
        closed = await self._stream(Role.MD, self.b.v.md_url, leg.sid, prompt, body)
        if closed.end is not StreamEnd.FINISHED:
            await self.inbox.put(TakeoverFailed(leg.sid, closed.render()))
            return
        await self.inbox.put(StreamEnded(leg.sid, Role.MD, closed))

    # -- teardown --------------------------------------------------------------------------------

    async def close(self, *, finished: bool) -> None:
        """Every stream is closed. A relay leg's MD prime that is still loading the prompt's KV when
        the run finished on RLD is left to end on its own (it streams nothing; it is bounded by the
        request's deadline): MD then holds the conversation for its next turn, which ships only what
        is new. Cancelling it aborted P's WAN transfer too, so MD never held any turn's KV and every
        turn shipped the whole history again (measured: the demo's PDD phase matched 0 tokens on MD
        and no handoff happened). A run that failed or was cancelled cancels its primes too."""
        primes = {t for t in self.primes.values() if not t.done()} if finished else set()
        tasks = [t for t in self.tasks if t not in primes]
        for task in tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)
        if primes:
            _, late = await asyncio.wait(primes, timeout=self.left() + 1.0)
            for task in late:
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.gather(*primes, return_exceptions=True)
