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
checked in ``router.openai_job`` (``completion_job`` / ``generate_job``).

Defaults follow vLLM's: ``temperature`` 1 (a random seed unless ``seed`` is given), ``max_tokens``
16 (also for chat, where vLLM would use the rest of the context), the model's EOS ends a choice
unless ``ignore_eos``.

Parsing uses pydantic's JSON parser (jiter): nesting deeper than its recursion limit, NaN,
infinities and numbers out of range are invalid JSON, never an exception of another kind.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator

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
    return_tokens_as_token_ids: bool | None = None
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


_ = Pipeline  # ForcedPipeline spells FORCEABLE's names (test_schema_pipelines_are_the_routing_pipelines)
