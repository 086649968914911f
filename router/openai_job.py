"""A validated request body becomes a ``Job``: what the router runs, one prompt per choice.

``completion_job`` (OpenAI completions and chat) and ``generate_job`` (gRPC ``Router.Generate``)
parse with ``router.openai_schema``'s models, then check what depends on the deployment
(``Limits``: vocabulary, prompt and output limits; the tokenizer's byte bound) and build the
``SamplingParams``. Every refusal is ``RequestRefused`` (400 / ``INVALID_ARGUMENT``) naming the
field, raised before any work starts.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from engines_adapter import SamplingParams
from pddlink.errors import InvalidInput
from router.openai_schema import (
    MAX_CHOICES,
    MAX_PROMPTS,
    NO_HANDOFF,
    SEED_MASK,
    ChatBody,
    CompletionBody,
    Endpoint,
    GenerateBody,
    Limits,
    RequestRefused,
    TextCodec,
    _Body,
    _check_extra,
    _Sampling,
    _Strict,
)


@dataclass(frozen=True, slots=True)
class Job:
    """A validated request: what the router runs, one prompt per choice."""

    endpoint: Endpoint
    prompts: tuple[tuple[int, ...], ...]
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    deadline_s: float = 0.0
    pipeline: str = ""
    model: str = ""
    request_id: str = ""
    ignore_eos: bool = False
    include_stop_str: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool = False
    n: int = 1  # choices per prompt (vLLM's: choice i of a seeded request draws with seed + i)
    seeded: bool = True  # the client gave a seed (else each choice draws a random one)
    logprobs: bool = False  # the answer carries each token's logprobs (``sampling.logprobs`` of them)
    echo: bool = False  # completions: the prompt leads the text (and the logprobs)
    tokens_as_ids: bool = False  # logprob tokens named "token_id:N" (vLLM's ``return_tokens_as_token_ids``)
    prompt_texts: tuple[str | None, ...] = ()  # per prompt: its text as sent (None: token ids)

    def choice_sampling(self, i: int) -> SamplingParams:
        """The sampling of a prompt's ``i``-th choice: vLLM's ``ParentRequest`` gives child ``i``
        the seed ``seed + i`` (a request without a seed: a random one each)."""
        if self.n == 1:
            return self.sampling
        seed = (self.sampling.seed + i) & SEED_MASK if self.seeded else secrets.randbelow(2**63)
        return replace(self.sampling, seed=seed)


def explain(exc: ValidationError) -> RequestRefused:
    """One message naming the first offending field (all unknown fields at once)."""
    errors = exc.errors(include_url=False)
    unknown = sorted(".".join(str(p) for p in e["loc"]) for e in errors if e["type"] == "extra_forbidden")
    if unknown:
        return RequestRefused(f"unknown field(s): {', '.join(unknown)}", unknown[0])
    first = min(errors, key=lambda e: len(e["loc"]))  # the outermost: a union's branches come later
    loc = [str(p) for p in first["loc"]]
    field = ".".join(loc)
    if first["type"] == "json_invalid":
        return RequestRefused(f"body is not valid JSON: {first['msg'].removeprefix('Invalid JSON: ')}")
    if first["type"] == "model_type":
        return RequestRefused("body must be a JSON object")
    if first["type"] == "missing":
        return RequestRefused(f'"{field}" is required', loc[0])
    if loc[:1] == ["prompt"]:
        return RequestRefused(
            '"prompt" must be a string, a list of token ids (ints), or a list of strings or of id lists',
            "prompt",
        )
    msg = str(first["msg"]).removeprefix("Value error, ")
    return RequestRefused(f'"{field}": {msg}', loc[0] if loc else "")


def parse_body(model: type[_Strict] | type[_Body], body: bytes) -> Any:
    try:
        parsed = model.model_validate_json(body)
    except ValidationError as exc:
        raise explain(exc) from None
    if isinstance(parsed, _Body):
        _check_extra(parsed)
    return parsed


def _check_prompt(ids: list[int], limits: Limits, where: str) -> tuple[int, ...]:
    if not ids:
        raise RequestRefused(f'"{where}" must not be empty', where)
    if len(ids) > limits.max_prompt_tokens:
        raise RequestRefused(
            f'"{where}" has {len(ids)} tokens; the limit is {limits.max_prompt_tokens}', where
        )
    if any(not 0 <= t < limits.vocab_size for t in ids):
        raise RequestRefused(f'"{where}": token ids must be in [0, {limits.vocab_size})', where)
    return tuple(ids)


def _sampling(
    body: _Sampling,
    limits: Limits,
    max_tokens: int | None,
    eos: int | None,
    logprobs: int | None,
    echo: bool,
    spelled: bool,
) -> SamplingParams:
    """``spelled``: the router can name logprob tokens itself (a tokenizer, or the client's ids)."""
    max_tokens = max_tokens or 16
    if max_tokens > limits.max_tokens_limit:
        raise RequestRefused(
            f'"max_tokens": {max_tokens} exceeds the limit {limits.max_tokens_limit}', "max_tokens"
        )
    if body.min_tokens > max_tokens:
        raise RequestRefused(
            f'"min_tokens" must be less than or equal to max_tokens={max_tokens}, got {body.min_tokens}',
            "min_tokens",
        )
    stops = _ids_in_vocab(body.stop_token_ids, limits, "stop_token_ids")
    if eos is not None and not body.ignore_eos and eos not in stops:
        stops += (eos,)
    bias = tuple((int(k), min(100.0, max(-100.0, v))) for k, v in (body.logit_bias or {}).items())
    _ids_in_vocab([t for t, _ in bias], limits, "logit_bias")
    temperature = 1.0 if body.temperature is None else body.temperature
    if (body.n or 1) > 1 and temperature < 1e-5:  # vLLM's ``_verify_greedy_sampling``
        raise RequestRefused(f'"n" must be 1 when using greedy sampling, got {body.n}', "n")
    top_k = body.top_k or 0
    return SamplingParams(
        seed=secrets.randbelow(2**63) if body.seed is None else body.seed,
        temperature=temperature,
        top_k=0 if top_k < 0 or top_k >= limits.vocab_size else top_k,
        top_p=1.0 if body.top_p is None else body.top_p,
        max_tokens=max_tokens,
        stop_token_ids=stops,
        min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=bias,
        min_tokens=body.min_tokens,
        allowed_token_ids=_ids_in_vocab(body.allowed_token_ids, limits, "allowed_token_ids"),
        bad_words=tuple(body.bad_words or ()),
        logprobs=logprobs,
        prompt_logprobs=logprobs if echo else None,  # vLLM: echo answers the prompt's logprobs too
        structured=_structured(body),
        logprobs_as_ids=logprobs is not None and spelled,  # the legs' rows keep each top token
    )


def _structured(body: _Sampling) -> str:
    """vLLM's structured-output fields as one JSON object ("" when there are none)."""
    fields: dict[str, Any] = {}
    if body.response_format is not None and body.response_format.type != "text":
        fields["response_format"] = body.response_format.model_dump(exclude_none=True)
    if body.structured_outputs:
        fields["structured_outputs"] = body.structured_outputs
    return json.dumps(fields) if fields else ""


def _pipeline(forced: str, structured: bool) -> str:
    """A structured-output request runs on a pipeline without a handoff (``NO_HANDOFF``)."""
    if not structured:
        return forced
    if forced and forced not in NO_HANDOFF:
        raise RequestRefused(
            f'"response_format" / "structured_outputs" need a pipeline without a handoff '
            f"({', '.join(NO_HANDOFF)}), not {forced!r}",
            "response_format",
        )
    return forced or "p_md"


def _ids_in_vocab(ids: list[int] | None, limits: Limits, field: str) -> tuple[int, ...]:
    out = tuple(ids or ())
    if any(t >= limits.vocab_size for t in out):
        raise RequestRefused(f'"{field}" must be in [0, {limits.vocab_size})', field)
    return out


def completion_job(
    body: bytes, endpoint: Endpoint, limits: Limits, codec: TextCodec | None, eos: int | None = None
) -> Job:
    """A completions or chat request body, validated whole; ``RequestRefused`` else."""
    parsed: CompletionBody | ChatBody
    prompts: tuple[tuple[int, ...], ...]
    echo, texts = False, tuple[str | None, ...]()
    if endpoint is Endpoint.CHAT:
        chat: ChatBody = parse_body(ChatBody, body)
        if codec is None:
            raise RequestRefused("chat completions need a tokenizer with a chat template", "messages")
        _check_bytes(sum(len(m.text().encode()) for m in chat.messages), limits, codec, "messages")
        text = codec.render_chat([{"role": m.role, "content": m.text()} for m in chat.messages])
        prompts = (_check_prompt(codec.encode(text), limits, "messages"),)
        parsed, max_tokens = chat, chat.max_completion_tokens or chat.max_tokens
        if chat.top_logprobs and not chat.logprobs:
            raise RequestRefused("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        logprobs = (chat.top_logprobs or 0) if chat.logprobs else None
    else:
        comp: CompletionBody = parse_body(CompletionBody, body)
        prompts = _completion_prompts(comp.prompt, limits, codec)
        parsed, max_tokens, logprobs = comp, comp.max_tokens, comp.logprobs
        echo, texts = comp.echo, _prompt_texts(comp.prompt)
        if echo and logprobs is not None and comp.stream:
            raise RequestRefused('"echo" with "logprobs" is not supported by pddlink when streaming', "echo")
    n = parsed.n or 1
    if n * len(prompts) > MAX_CHOICES:
        raise RequestRefused(f'"n": at most {MAX_CHOICES} choices per request (prompts x n)', "n")
    opts = parsed.stream_options
    if opts is not None and not parsed.stream:
        raise RequestRefused('"stream_options" is only allowed with "stream": true', "stream_options")
    as_ids = bool(parsed.return_tokens_as_token_ids)
    sampling = _sampling(parsed, limits, max_tokens, eos, logprobs, echo, as_ids or codec is not None)
    return Job(
        endpoint=endpoint,
        prompts=prompts,
        sampling=sampling,
        stop=parsed.stop_strings(),
        stream=bool(parsed.stream),
        include_usage=bool(opts and opts.include_usage),
        deadline_s=parsed.deadline_s or 0.0,
        pipeline=_pipeline(parsed.pipeline, bool(sampling.structured)),
        model=parsed.model or "",
        ignore_eos=parsed.ignore_eos,
        include_stop_str=parsed.include_stop_str_in_output,
        skip_special_tokens=parsed.skip_special_tokens,
        return_token_ids=bool(parsed.return_token_ids),
        n=n,
        seeded=parsed.seed is not None,
        logprobs=logprobs is not None,
        echo=echo,
        prompt_texts=texts,
        tokens_as_ids=as_ids,
    )


def _completion_prompts(prompt: Any, limits: Limits, codec: TextCodec | None) -> tuple[tuple[int, ...], ...]:
    items: list[Any] = [prompt] if isinstance(prompt, str) or _is_ids(prompt) else list(prompt)
    if not items:
        raise RequestRefused('"prompt" must not be empty', "prompt")
    if len(items) > MAX_PROMPTS:
        raise RequestRefused(f'"prompt": at most {MAX_PROMPTS} prompts per request', "prompt")
    out = []
    for item in items:
        ids = item if isinstance(item, list) else _encode(item, limits, codec)
        out.append(_check_prompt(ids, limits, "prompt"))
    return tuple(out)


def _prompt_texts(prompt: Any) -> tuple[str | None, ...]:
    """Each prompt's text as the client sent it (None: sent as ids), for ``echo``."""
    items: list[Any] = [prompt] if isinstance(prompt, str) or _is_ids(prompt) else list(prompt)
    return tuple(item if isinstance(item, str) else None for item in items)


def _is_ids(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int)


def _encode(text: str, limits: Limits, codec: TextCodec | None) -> list[int]:
    if not text:
        raise RequestRefused('"prompt" must not be empty', "prompt")
    if codec is None:  # answering it with empty text would hide the misconfiguration (issue 27)
        raise RequestRefused(
            "this router has no tokenizer ([api] tokenizer): send the prompt as token ids", "prompt"
        )
    _check_bytes(len(text.encode()), limits, codec, "prompt")
    return codec.encode(text)


def prompt_byte_limit(limits: Limits, codec: TextCodec) -> int:
    """The most UTF-8 bytes a text prompt may have: ``limits.max_prompt_bytes`` when set, else
    what ``max_prompt_tokens`` tokens of the longest token can spell (so no prompt within the
    token limit is refused by it, and a longer one is refused before any tokenizing)."""
    return limits.max_prompt_bytes or limits.max_prompt_tokens * max(1, codec.max_token_bytes)


def _check_bytes(size: int, limits: Limits, codec: TextCodec, where: str) -> None:
    limit = prompt_byte_limit(limits, codec)
    if size > limit:
        raise RequestRefused(
            f'"{where}" has {size} bytes of text; the limit is {limit} bytes '
            f"(at most {limits.max_prompt_tokens} tokens)",
            where,
        )


def generate_job(fields: dict[str, Any], limits: Limits) -> Job:
    """The gRPC request's fields (see ``GenerateBody``), validated; ``RequestRefused`` else."""
    try:
        g = GenerateBody.model_validate(fields)
    except ValidationError as exc:
        raise explain(exc) from None
    prompt = _check_prompt(g.prompt, limits, "prompt")
    if any(t >= limits.vocab_size for t in g.stop_token_ids):
        raise RequestRefused(f'"stop_token_ids" must be in [0, {limits.vocab_size})', "stop_token_ids")
    max_tokens = g.max_tokens or 16
    if max_tokens > limits.max_tokens_limit:
        raise RequestRefused(f'"max_tokens": {max_tokens} exceeds the limit {limits.max_tokens_limit}')
    try:
        sampling = SamplingParams(
            seed=g.seed,
            temperature=g.temperature,
            top_k=g.top_k,
            top_p=g.top_p or 1.0,
            max_tokens=max_tokens,
            stop_token_ids=tuple(g.stop_token_ids),
        )
    except InvalidInput as exc:
        raise RequestRefused(exc.message) from None
    return Job(
        Endpoint.GRPC,
        (prompt,),
        sampling,
        deadline_s=g.deadline_s,
        pipeline=g.pipeline,
        request_id=g.request_id,
    )
