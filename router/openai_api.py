"""OpenAI-compatible responses at the router, shaped as vLLM's own server shapes them.

``Responder`` runs a validated ``Job`` (``router.openai_schema``): one router request per choice
(``n`` per prompt; choice i of a prompt draws with ``seed + i``, vLLM's child-seed rule), run
concurrently, each choice's tokens turned into text (``router.openai_text.ChoiceText``); the
answer is one JSON body or server-sent events. Fields match vLLM's (``stop_reason``, ``token_ids``
and ``prompt_token_ids`` with ``return_token_ids``; ``logprobs`` in the completions or chat shape
from each token's row, which the router's token events carry from the instance that drew it;
``echo``; ``usage`` with ``prompt_tokens_details`` from P's prefix hit, counted as vLLM counts it);
what pddlink adds (request id, token positions and sources, the trace) sits in one ``pddlink``
object per choice, where vLLM puts its own per-choice extensions, only when the client asks for
it (``Responder.trace``: the request header ``pddlink-trace: 1``): an answer carries no field
vLLM's would not. A choice that a stop string ends sends ``STOP`` into its router request, which
ends the run at once and answers with its final item (trace, prefix hit).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from engines_adapter import SamplingParams
from router.answer import GenerateEvent, RequestEnd
from router.logprob_text import id_name, named_row
from router.openai_job import Job
from router.openai_schema import Endpoint
from router.openai_text import ChoiceText, TextCodec

FINGERPRINT = "pddlink-0.1"


STOP = "stop"  # ``router.STOP``: sent into the router's generator when a stop string ended a choice


class Generator(Protocol):
    def generate(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        *,
        deadline_s: float = 0.0,
        pipeline: str = "",
        request_id: str = "",
    ) -> AsyncGenerator[GenerateEvent, Any]: ...


@dataclass(slots=True)
class Choice:
    """One prompt's progress: text, ids, where its tokens came from, how it ended."""

    index: int
    prompt: tuple[int, ...]
    text: ChoiceText
    sampling: SamplingParams
    tokens: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # per token, named (``logprob_text``)
    positions: list[int] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str = ""
    request_id: str = ""
    trace: dict[str, Any] = field(default_factory=dict)
    prompt_usage: dict[str, int] = field(default_factory=dict)  # vLLM's legs: P's prefix hit
    echo: str = ""  # completions' ``echo``: the prompt's text leads the answer's
    prompt_logprobs: list[Any] | None = None  # P's, in vLLM's JSON (``echo`` with ``logprobs``)

    @property
    def cached_tokens(self) -> int:
        return int(self.prompt_usage.get("cached_tokens", self.trace.get("p_cached_tokens", 0)))

    @property
    def created_cache_tokens(self) -> int:
        return int(self.prompt_usage.get("created_cache_tokens", len(self.prompt) - self.cached_tokens))

    def ended(self, final: RequestEnd) -> None:
        """The router's final item: the request's id, trace and prompt usage."""
        self.request_id, self.trace = final.request_id, dict(final.trace)
        self.prompt_usage = dict(final.prompt_usage or {})
        self.prompt_logprobs = final.prompt_logprobs


@dataclass(frozen=True, slots=True)
class Delta:
    """What one step of a choice adds: new text and tokens; ``done`` when the choice has ended."""

    choice: Choice
    text: str
    tokens: list[int]
    positions: list[int]
    sources: list[str]
    done: bool = False
    logprobs: list[dict[str, Any]] = field(default_factory=list)


async def run_choice(
    gen: AsyncGenerator[GenerateEvent, Any], job: Job, choice: Choice, eos: int | None
) -> AsyncIterator[Delta]:
    s = choice.sampling
    try:
        async for ev in gen:
            if isinstance(ev, RequestEnd):
                choice.ended(ev)
                if not ev.finished:
                    choice.error = ev.reason or "failed"
                else:
                    _finish(choice, s, eos)
                yield Delta(choice, choice.text.finish(), [], [], [], done=True)
                return
            tok = ev.token_id
            choice.tokens.append(tok)
            choice.positions.append(ev.position)
            choice.sources.append(ev.source)
            rows = (
                []
                if ev.logprobs is None
                else [named_row(ev.logprobs, choice.tokens, choice.text.codec, job.tokens_as_ids)]
            )
            choice.logprobs += rows
            is_stop = tok in s.stop_token_ids
            text = choice.text.push(tok, is_stop_token=is_stop)
            delta = Delta(choice, text, [tok], [ev.position], [ev.source], logprobs=rows)
            if choice.text.stopped is not None:
                choice.finish_reason, choice.stop_reason = "stop", choice.text.stopped
                with contextlib.suppress(StopAsyncIteration):  # the run ends; its trace and usage
                    end = await gen.asend(STOP)
                    if isinstance(end, RequestEnd):  # the answer to STOP: the final item
                        choice.ended(end)
                yield delta
                yield Delta(choice, "", [], [], [], done=True)
                return
            yield delta
    finally:
        aclose = getattr(gen, "aclose", None)
        if aclose is not None:
            await aclose()  # a stop string (or a client gone) cancels the request at the router


def _finish(choice: Choice, s: SamplingParams, eos: int | None) -> None:
    last = choice.tokens[-1] if choice.tokens else None
    if last is not None and last in s.stop_token_ids:
        choice.finish_reason, choice.stop_reason = "stop", (None if last == eos else last)
    elif len(choice.tokens) >= s.max_tokens:
        choice.finish_reason = "length"
    else:
        choice.finish_reason = "stop"


async def admitted(
    router: Generator, job: Job, choices: list[Choice]
) -> list[AsyncGenerator[GenerateEvent, Any]]:
    """One router request per choice, all started at once and each run up to its first event: the
    router's admission (``Overloaded``) or its own checks raise here, before any answer is sent; then
    none is left open."""
    starts = [
        _primed(router.generate(list(c.prompt), c.sampling, deadline_s=job.deadline_s, pipeline=job.pipeline))
        for c in choices
    ]
    results = await asyncio.gather(*starts, return_exceptions=True)
    gens = [r for r in results if not isinstance(r, BaseException)]
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        for g in gens:
            await _close(g)
        raise failed[0]
    return gens


async def _primed(gen: AsyncGenerator[GenerateEvent, Any]) -> AsyncGenerator[GenerateEvent, Any]:
    """``gen`` with its first event taken now (so the router's admission error surfaces here);
    a value sent into the result goes on to ``gen`` (``STOP``); closing the result closes ``gen``
    at once, which cancels the router's request (a client gone)."""
    try:
        first = await gen.__anext__()
    except BaseException:
        await _close(gen)
        raise

    async def forwarding() -> AsyncGenerator[GenerateEvent, Any]:
        try:
            sent = yield first
            while True:
                sent = yield await gen.asend(sent)
        except StopAsyncIteration:
            return
        finally:
            await _close(gen)

    return forwarding()


async def _close(gen: AsyncIterator[Any]) -> None:
    aclose = getattr(gen, "aclose", None)
    if aclose is not None:
        await aclose()


async def merged(
    gens: list[AsyncGenerator[GenerateEvent, Any]], job: Job, choices: list[Choice], eos: int | None
) -> AsyncIterator[Delta]:
    """Every choice's deltas as they come (one task per choice); all cancelled if the reader leaves."""
    if len(choices) == 1:
        async for d in run_choice(gens[0], job, choices[0], eos):
            yield d
        return
    queue: asyncio.Queue[Delta | None] = asyncio.Queue()

    async def pump(g: AsyncGenerator[GenerateEvent, Any], c: Choice) -> None:
        try:
            async for d in run_choice(g, job, c, eos):
                await queue.put(d)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(g, c)) for g, c in zip(gens, choices, strict=True)]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(slots=True)
class Responder:
    """Builds one job's answer: ``body()`` (non-streaming) or ``events()`` (SSE)."""

    router: Generator
    job: Job
    model: str
    codec: TextCodec | None
    eos: int | None
    trace: bool = False  # add the per-choice ``pddlink`` object (request id, positions, sources, trace)
    created: int = field(default_factory=lambda: int(time.time()))
    choices: list[Choice] = field(default_factory=list)
    gens: list[AsyncGenerator[GenerateEvent, Any]] = field(default_factory=list)
    _offsets: dict[int, int] = field(default_factory=dict)  # per choice: a stream's next text_offset
    _first_out: int | None = None  # a stream's first choice to send anything (vLLM's usage is its)

    def __post_init__(self) -> None:
        j = self.job
        self.choices = [
            Choice(
                i * j.n + k,
                p,
                ChoiceText(
                    self.codec, j.stop, j.include_stop_str, j.skip_special_tokens, j.sampling.min_tokens
                ),
                j.choice_sampling(k),
                echo=self._echo(i),
            )
            for i, p in enumerate(j.prompts)
            for k in range(j.n)
        ]

    def _echo(self, i: int) -> str:
        """vLLM's echoed prompt text: as sent, or its ids decoded; none with ``return_token_ids``."""
        j = self.job
        if not j.echo or j.return_token_ids or self.codec is None:
            return ""
        sent = j.prompt_texts[i] if i < len(j.prompt_texts) else None
        return sent if sent is not None else self.codec.decode(list(j.prompts[i]), skip_special_tokens=False)

    @property
    def chat(self) -> bool:
        return self.job.endpoint is Endpoint.CHAT

    @property
    def response_id(self) -> str:
        rid = self.choices[0].request_id or f"{time.time_ns():x}"
        return ("chatcmpl-" if self.chat else "cmpl-") + rid

    async def admit(self) -> None:
        """Start the job's router requests; raises ``Overloaded`` (nothing left running) when the
        router cannot meet the deadline. ``body()``/``events()`` call it when it was not called."""
        if not self.gens:
            self.gens = await admitted(self.router, self.job, self.choices)

    async def body(self) -> tuple[int, dict[str, Any]]:
        await self.admit()
        async for _ in merged(self.gens, self.job, self.choices, self.eos):
            pass
        failed = [c for c in self.choices if c.error]
        if failed:
            return 503, _error(f"request failed: {failed[0].error}", "ServiceUnavailableError", 503)
        out: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [self._choice(c) for c in self.choices],
            "service_tier": None,
            "system_fingerprint": FINGERPRINT,
            "usage": self._usage(full=True),
        }
        if self.chat:
            out.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
        out.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
        return 200, out

    def _choice(self, c: Choice) -> dict[str, Any]:
        ids = c.tokens if self.job.return_token_ids else None
        if self.chat:
            message = {
                "role": "assistant",
                "content": c.text.text if self.codec else "",
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "reasoning": None,
            }
            head: dict[str, Any] = {
                "index": c.index,
                "message": message,
                "logprobs": self._logprobs(c.logprobs),
            }
        else:
            text = c.echo + (c.text.text if self.codec else "")
            rows = self._prompt_rows(c) + c.logprobs if self.job.echo else c.logprobs
            head = {"index": c.index, "text": text, "logprobs": self._logprobs(rows)}
        head.update(finish_reason=c.finish_reason, stop_reason=c.stop_reason, token_ids=ids)
        if not self.chat:
            head.update(
                prompt_logprobs=c.prompt_logprobs if self.job.echo else None,
                prompt_token_ids=list(c.prompt) if self.job.return_token_ids else None,
            )
        head.update(routed_experts=None)
        if self.trace:
            head["pddlink"] = self._ext(c, c.positions, c.sources, final=True)
        return head

    def _ext(self, c: Choice, positions: list[int], sources: list[str], final: bool) -> dict[str, Any]:
        ext: dict[str, Any] = {"positions": positions, "sources": sources}
        if final:
            ext.update(request_id=c.request_id, token_ids=c.tokens, trace=c.trace)
        return ext

    def _logprobs(self, rows: list[dict[str, Any]], offset: int = 0) -> dict[str, Any] | None:
        """vLLM's logprobs object for ``rows`` (a choice's, or a streamed delta's from text offset
        ``offset``); None when the request asked for none."""
        if not self.job.logprobs:
            return None
        if self.chat:
            return chat_logprobs(rows, self.job.sampling.logprobs or 0)
        return completion_logprobs(rows, offset)

    def _prompt_rows(self, c: Choice) -> list[dict[str, Any]]:
        """The prompt's logprobs rows (P's ``prompt_logprobs``) as vLLM's echo reports them: the
        first token (or any without an entry) has none."""
        if not self.job.logprobs:
            return []
        raw = c.prompt_logprobs or [None] * len(c.prompt)
        return [self._prompt_row(tok, entry) for tok, entry in zip(c.prompt, raw, strict=False)]

    def _prompt_row(self, tok: int, entry: dict[str, Any] | None) -> dict[str, Any]:
        """One prompt token's row: P's ``decoded_token`` strings, or "token_id:N" when the client
        asked for ids (vLLM's ``return_tokens_as_token_ids``)."""
        as_ids = self.job.tokens_as_ids
        step = (entry or {}).get(str(tok))
        if entry is None or step is None:
            text = self.codec.decode([tok], skip_special_tokens=False) if self.codec else ""
            return {"token": id_name(tok) if as_ids else text, "logprob": None, "top": None}
        name = step.get("decoded_token")
        if name is None and self.codec is not None:
            name = self.codec.decode([tok], skip_special_tokens=False)
        top = [
            [id_name(int(t)) if as_ids else e.get("decoded_token"), max(e["logprob"], -9999.0)]
            for t, e in entry.items()
        ]
        token = id_name(tok) if as_ids else name or ""
        return {"token": token, "logprob": max(step["logprob"], -9999.0), "top": top}

    def _usage(self, full: bool) -> dict[str, Any]:
        """vLLM's usage: every prompt once, every choice's tokens; the prefix hit is one prompt's
        (vLLM's completions: the last prompt's when not streamed, else the first result's; chat
        has one prompt), P's as vLLM counts it (``created_cache_tokens``: chat's only; None in a
        completions body, absent from a streamed one)."""
        prompt = sum(len(c.prompt) for c in self.choices if c.index % self.job.n == 0)
        completion = sum(len(c.tokens) for c in self.choices)
        one = self._first_out if not full or self._first_out is None else None
        c = self.choices[one if one is not None else (len(self.job.prompts) - 1) * self.job.n]
        details: dict[str, Any] = {"cached_tokens": c.cached_tokens}
        if self.chat:
            details["created_cache_tokens"] = c.created_cache_tokens
        elif full:
            details["created_cache_tokens"] = None
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": details,
        }
        if full:
            usage["prompt_tokens_details"]["multimodal_tokens"] = None
            usage["completion_tokens_details"] = None
        return usage

    async def events(self) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        sent_first: set[int] = set()
        rid = ""
        await self.admit()
        async for d in merged(self.gens, self.job, self.choices, self.eos):
            c = d.choice
            self._first_out = c.index if self._first_out is None else self._first_out
            rid = rid or self.response_id
            if c.error:
                yield _sse(_error(f"request failed: {c.error}", "ServiceUnavailableError", 503))
                break
            if self.chat and c.index not in sent_first:
                yield _sse(
                    self._chunk(rid, obj, [self._chat_first(c)], prompt_token_ids=None, prompt_text=None)
                )
            choice = self._stream_choice(c, d, first=c.index not in sent_first)
            sent_first.add(c.index)
            if d.text or d.tokens or d.done:
                # vLLM: the fingerprint rides on the last chunk, or on the usage chunk when one follows
                extra = {"system_fingerprint": FINGERPRINT} if d.done and not self.job.include_usage else {}
                yield _sse(self._chunk(rid, obj, [choice], **extra))
        else:
            if self.job.include_usage:
                yield _sse(
                    self._chunk(rid, obj, [], usage=self._usage(full=False), system_fingerprint=FINGERPRINT)
                )
        yield b"data: [DONE]\n\n"

    def _chunk(self, rid: str, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def _chat_first(self, c: Choice) -> dict[str, Any]:
        return {
            "index": c.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def _stream_choice(self, c: Choice, d: Delta, first: bool) -> dict[str, Any]:
        ids = d.tokens if self.job.return_token_ids else None
        offset = self._offsets.get(c.index, 0)
        logprobs = self._logprobs(d.logprobs, offset) if d.logprobs or not self.chat else None
        if logprobs is not None and not self.chat:
            tokens = logprobs["tokens"]
            self._offsets[c.index] = logprobs["text_offset"][-1] + len(tokens[-1]) if tokens else offset
        if self.chat:
            out: dict[str, Any] = {"index": c.index, "delta": {"content": d.text}, "logprobs": logprobs}
            out["finish_reason"] = c.finish_reason if d.done else None
            if d.done:
                out["stop_reason"] = c.stop_reason
            out["token_ids"] = ids
        else:
            out = {"index": c.index, "text": (c.echo if first else "") + d.text, "logprobs": logprobs}
            out.update(
                finish_reason=c.finish_reason if d.done else None,
                stop_reason=c.stop_reason if d.done else None,
            )
            pids = list(c.prompt) if first and self.job.return_token_ids else None
            out.update(prompt_token_ids=pids, token_ids=ids)
        if self.trace:
            out["pddlink"] = self._ext(c, d.positions, d.sources, final=d.done)
        return out


def completion_logprobs(rows: list[dict[str, Any]], offset: int = 0) -> dict[str, Any]:
    """vLLM's completions ``logprobs`` (``_create_completion_logprobs``): each token's string and
    logprob, its top logprobs (the drawn token first), and text offsets from ``offset`` by the
    tokens' string lengths."""
    offsets = []
    for r in rows:
        offsets.append(offset)
        offset += len(r["token"])
    return {
        "text_offset": offsets,
        "token_logprobs": [r["logprob"] for r in rows],
        "tokens": [r["token"] for r in rows],
        "top_logprobs": [None if r["top"] is None else {str(t): v for t, v in r["top"]} for r in rows],
    }


def chat_logprobs(rows: list[dict[str, Any]], top: int) -> dict[str, Any]:
    """vLLM's chat ``logprobs`` (``_create_chat_logprobs``): per token its string, logprob, UTF-8
    bytes (of its decoded text, even when it is named "token_id:N"), and the first ``top`` entries
    of its top logprobs (the drawn token first), each with its own string's bytes."""

    def entry(token: str, logprob: float, text: str | None = None) -> dict[str, Any]:
        raw = token if text is None else text
        return {"token": token, "logprob": logprob, "bytes": list(raw.encode("utf-8", errors="replace"))}

    return {
        "content": [
            {
                **entry(r["token"], r["logprob"], r.get("decoded")),
                "top_logprobs": [entry(str(t), v) for t, v in r["top"][:top]],
            }
            for r in rows
        ]
    }


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _error(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return _error(message, kind, code, param)


def models_body(model: str, root: str, max_model_len: int, created: int) -> dict[str, Any]:
    perm = {
        "id": f"modelperm-{model}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": False,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    card = {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "pddlink",
        "root": root,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [perm],
    }
    return {"object": "list", "data": [card]}
