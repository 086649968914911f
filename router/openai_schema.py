"""The router's client request schema: OpenAI completions and chat completions over HTTP, and the
gRPC ``Router.Generate`` request, validated by one set of pydantic models before any work starts.

Every field a client may send is declared here with its type and its bounds (a bad value is
refused: ``RequestRefused``, a 400 / ``INVALID_ARGUMENT`` naming the field). vLLM's sampling and
output fields (penalties, ``min_p``, ``logit_bias``, ``min_tokens``, ``allowed_token_ids``,
``bad_words``, ``logprobs``/``top_logprobs``, ``n``, ``echo``, ``response_format`` /
``structured_outputs``) become ``SamplingParams`` and ``Job`` fields (``docs/api.md``: how each
crosses a handoff; structured outputs run on a pipeline without one, ``NO_HANDOFF``); the
reference engine refuses the vLLM-only ones (``Router.validate``). Fields of vLLM's server that
pddlink does not implement are accepted only at their neutral value (no ``best_of``, no beam
search, ...: ``VLLM_NEUTRAL``), so a client that relies on them hears so instead of getting a
silently different answer; a field vLLM does not know either is ignored, as vLLM ignores it (and
logged). The gRPC request stays strict. Bounds
that depend on the deployment (vocabulary, prompt and output limits) come from ``Limits`` and are
checked in ``completion_job`` / ``generate_job``.

Defaults follow vLLM's: ``temperature`` 1 (a random seed unless ``seed`` is given), ``max_tokens``
16 (also for chat, where vLLM would use the rest of the context), the model's EOS ends a choice
unless ``ignore_eos``.

Parsing uses pydantic's JSON parser (jiter): nesting deeper than its recursion limit, NaN,
infinities and numbers out of range are invalid JSON, never an exception of another kind.
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engines_adapter import SamplingParams
from pddlink.errors import InvalidInput
from pddlink.routing import Pipeline
from pddlink.sampling import MAX_LOGPROBS

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 128
MAX_STOP_TOKEN_IDS = 64
MAX_REQUEST_ID_CHARS = 128
MAX_PROMPTS = 16
MAX_MESSAGES = 256
MAX_TEXT_CHARS = 1 << 20
MAX_DEADLINE_S = 600.0
MAX_CHOICES = 64  # prompts x n per request
MAX_BAD_WORDS = 64
MAX_LOGIT_BIAS = 1024

SEED_MASK = 2**63 - 1
TokenId = Annotated[int, Field(ge=0, lt=2**31)]


# A forced pipeline (tests, the P->MD baseline): a pipeline's name or a routing option's
# (``router.options.FORCEABLE``).
ForcedPipeline = Literal["", "p_md", "p_rld_md", "singular", "ship", "relay", "recompute", "relay_recompute"]


class RequestRefused(InvalidInput):
    """A client request that the schema refuses; ``param`` names the field ("" for the body)."""

    def __init__(self, message: str, param: str = "") -> None:
        super().__init__(message)
        self.param = param


class Endpoint(StrEnum):
    COMPLETIONS = "completions"
    CHAT = "chat"
    GRPC = "grpc"


@dataclass(frozen=True, slots=True)
class Limits:
    """The deployment's bounds (``RouterConfig``): what a request may ask of it."""

    vocab_size: int
    max_prompt_tokens: int
    max_tokens_limit: int
    max_prompt_bytes: int = 0  # a text prompt's UTF-8 bytes, checked before tokenizing (0: no check)


class TextCodec(Protocol):
    """What the schema needs of a tokenizer (``router.openai_text.TextCodec``)."""

    @property
    def max_token_bytes(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def render_chat(self, messages: list[dict[str, str]]) -> str: ...


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class _Open(BaseModel):
    """vLLM's own request models let unknown fields through (and ignore them): so do these."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, frozen=True)


class _Body(BaseModel):
    """A top-level body: unknown fields are kept aside (``model_extra``) for ``_check_extra``."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False, frozen=True)


# Fields of vLLM's OpenAI server that pddlink does not carry (yet): accepted at the value that
# changes nothing, refused otherwise (400 naming the field), never silently dropped. A field in
# neither the schema nor this table is unknown to vLLM too, and ignored as vLLM ignores it.
_ANY = object()  # ignored whatever its value: changes no token of the answer
VLLM_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),  # (chat: completions declare it)
    "add_special_tokens": (None, True),  # the tokenizer's special tokens are added (chat too)
    "length_penalty": (None, 1.0),
    "use_beam_search": (None, False),
    "truncate_prompt_tokens": (None,),
    "truncation_side": (_ANY,),
    "prompt_logprobs": (None,),
    "logprob_token_ids": (None, []),
    "spaces_between_special_tokens": (None, True),
    "priority": (None, 0),
    "request_id": (_ANY,),
    "session_id": (_ANY,),
    "return_tokens_as_token_ids": (None, False),
    "return_token_offsets": (None, False),
    "return_prompt_text": (None, False),
    "routed_experts_prompt_start": (None,),
    "prompt_embeds": (None,),
    "mm_payload": (None,),
    "return_mm_kwargs": (None, False),
    "cache_salt": (None,),  # a salt asks for cache isolation: not to be dropped
    "kv_transfer_params": (None,),
    "ec_transfer_params": (None,),
    "vllm_xargs": (None, {}),
    "repetition_detection": (None,),
    "thinking_token_budget": (None,),
    "stream_interval": (None, 1),
    "watermarking": (None,),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (_ANY,),
    "reasoning_effort": (None,),
    "include_reasoning": (None, True),
    "continue_final_message": (None, False),
    "documents": (None,),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "media_io_kwargs": (None, {}),
    "mm_processor_kwargs": (None, {}),
}
log = logging.getLogger("pddlink.router.api")


def _check_extra(body: _Body) -> None:
    """Refuse a vLLM field pddlink cannot honour; log (as vLLM does) the unknown ones ignored."""
    ignored = []
    for name, value in (body.model_extra or {}).items():
        neutral = VLLM_NEUTRAL.get(name)
        if neutral is None:
            ignored.append(name)
        elif _ANY not in neutral and not any(_same(value, n) for n in neutral):
            shown = " or ".join(json.dumps(n) for n in neutral)
            raise RequestRefused(f'"{name}" is not supported by pddlink (only {shown})', name)
    if ignored:
        log.warning("fields present in the request but ignored: %s", ", ".join(sorted(ignored))[:256])


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality: ``true`` is not ``1``, ``1`` is ``1.0``."""
    if isinstance(value, bool) or isinstance(neutral, bool) or value is None or neutral is None:
        return value is neutral
    return bool(value == neutral)


class StreamOptions(_Open):
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False


def _neutral(value: Any, neutral: tuple[Any, ...], what: str) -> Any:
    if value not in neutral:
        raise ValueError(f"{what} is not supported by pddlink")
    return value


class ResponseFormat(_Open):
    """OpenAI's ``response_format`` as vLLM takes it (its own validation follows on the servers)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: dict[str, Any] | None = None
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False, frozen=True)


# Pipelines without a handoff: structured outputs are served there only. vLLM's grammar state is
# built from the request's own output, so an instance continuing from prompt + another's tokens
# would constrain its tokens as if the answer began there (stock vLLM takes no prior grammar state)
NO_HANDOFF = ("p_md", "ship", "recompute", "singular")


class _Sampling(_Body):
    """Fields shared by completions and chat (OpenAI's, vLLM's extensions, pddlink's)."""

    model: str | None = Field(None, max_length=256)
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=1 << 20)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] | None = Field(
        None, max_length=MAX_STOP_STRINGS
    )
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=MAX_CHOICES)
    user: str | None = Field(None, max_length=256)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    allowed_token_ids: list[TokenId] | None = Field(None, max_length=1 << 20)
    bad_words: list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]] | None = Field(
        None, max_length=MAX_BAD_WORDS
    )
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_token_ids: bool | None = None
    min_tokens: int = Field(0, ge=0, le=1_000_000)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    # pddlink's own: the request's deadline and a forced pipeline (tests, the P->MD baseline)
    deadline_s: float | None = Field(None, gt=0.0, le=MAX_DEADLINE_S)
    pipeline: ForcedPipeline = ""

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v: Any) -> Any:
        if v == "":
            raise ValueError("a stop string must not be empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v: Any) -> Any:
        if v and not all(k.isascii() and k.isdigit() and len(k) < 10 for k in v):
            raise ValueError("keys must be token ids")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


PromptIds = Annotated[list[int], Field(min_length=1, max_length=1 << 20)]
PromptText = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]


class CompletionBody(_Sampling):
    prompt: PromptText | PromptIds | list[PromptText] | list[PromptIds] = Field(union_mode="left_to_right")
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: Any) -> Any:
        return _neutral(v, (None, 1), "best_of > 1")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: Any) -> Any:
        return _neutral(v, (None, ""), "suffix")


class TextPart(_Open):
    type: Literal["text"]
    text: str = Field(max_length=MAX_TEXT_CHARS)


class Message(_Open):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart] = Field(max_length=MAX_TEXT_CHARS)
    name: str | None = Field(None, max_length=256)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatBody(_Sampling):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True


class GenerateBody(_Strict):
    """The gRPC request, as a dict of its protobuf fields (``router.api``)."""

    request_id: str = Field("", max_length=MAX_REQUEST_ID_CHARS, pattern=r"^[A-Za-z0-9._:-]*$")
    prompt: PromptIds
    seed: int = Field(0, ge=0, lt=2**63)
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    top_k: int = Field(0, ge=0, le=1 << 20)
    top_p: float = Field(1.0, ge=0.0, le=1.0)
    max_tokens: int = Field(0, ge=0, le=1_000_000)
    stop_token_ids: list[TokenId] = Field([], max_length=MAX_STOP_TOKEN_IDS)
    deadline_s: float = Field(0.0, ge=0.0, le=MAX_DEADLINE_S)
    pipeline: ForcedPipeline = ""


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
    body: _Sampling, limits: Limits, max_tokens: int | None, eos: int | None, logprobs: int | None, echo: bool
) -> SamplingParams:
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
    sampling = _sampling(parsed, limits, max_tokens, eos, logprobs, echo)
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


_ = Pipeline  # ForcedPipeline spells FORCEABLE's names (test_schema_pipelines_are_the_routing_pipelines)
