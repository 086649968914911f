"""vLLM's OpenAI API as the router's vLLM legs call it: the sampling fields of a request
(``sampling_body``), one non-streaming completion with typed errors (``post_completion``), one vLLM
generating alone as the exactness reference (``generate_alone``), and what its answers say
(``error_text``, ``cached_tokens``, ``logprob_rows``). No state: ``router.vllm_legs`` holds the runs."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx

from pddlink.errors import DeadlineExceeded, RemoteError
from pddlink.sampling import SamplingParams
from router.logprob_text import ID_PREFIX

MIN_TIMEOUT_S = 0.01
FINISHED = ("length", "stop")


def sampling_body(sampling: SamplingParams, *, ignore_eos: bool = True) -> dict[str, Any]:
    """vLLM's sampling fields for ``sampling`` (seeded draws need ``PositionSeededSampling`` on
    the servers to continue exactly across instances). The router's requests stop only at
    ``stop_token_ids`` (its API adds the model's EOS there unless the client set ``ignore_eos``),
    so vLLM is told to ignore its own EOS: the same request stops at the same token on every role."""
    body: dict[str, Any] = {"temperature": sampling.temperature, "top_p": sampling.top_p}
    if sampling.top_k > 0:
        body["top_k"] = sampling.top_k
    if sampling.temperature > 0:
        body["seed"] = sampling.seed
    if sampling.stop_token_ids:
        body["stop_token_ids"] = list(sampling.stop_token_ids)
    if ignore_eos:
        body["ignore_eos"] = True
    return body | _vllm_fields(sampling)


PRIOR_OUTPUT_ARG = "pddlink_prior_output"  # ``engines_adapter.vllm.sampling`` reads it


def _vllm_fields(s: SamplingParams) -> dict[str, Any]:
    """vLLM's own fields, each only when set (so a plain request's body is as before). A leg whose
    prompt ends with ``prior_output_tokens`` of the request's output tells the servers' logits
    processor so (``vllm_xargs``): vLLM's presence and frequency penalties count output only."""
    body: dict[str, Any] = {}
    if s.min_p:
        body["min_p"] = s.min_p
    if s.presence_penalty:
        body["presence_penalty"] = s.presence_penalty
    if s.frequency_penalty:
        body["frequency_penalty"] = s.frequency_penalty
    if s.repetition_penalty != 1.0:
        body["repetition_penalty"] = s.repetition_penalty
    if s.logit_bias:
        body["logit_bias"] = {str(t): b for t, b in s.logit_bias}
    if s.min_tokens:
        body["min_tokens"] = s.min_tokens
    if s.allowed_token_ids:
        body["allowed_token_ids"] = list(s.allowed_token_ids)
    if s.bad_words:
        body["bad_words"] = list(s.bad_words)
    if s.logprobs is not None:
        body["logprobs"] = s.logprobs
    if s.logprobs_as_ids:  # "token_id:N": two tokens of one string stay two (``router.logprob_text``)
        body["return_tokens_as_token_ids"] = True
    if s.prior_output_tokens:
        body["vllm_xargs"] = {PRIOR_OUTPUT_ARG: s.prior_output_tokens}
    if s.structured:
        body |= json.loads(s.structured)
    return body


def left_s(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("no time left")
    return left


async def post_completion(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], deadline: float
) -> dict[str, Any]:
    """One non-streaming completion; typed errors at the edge."""
    try:
        r = await http.post(url + "/v1/completions", json=body, timeout=left_s(deadline))
    except httpx.TimeoutException as exc:
        raise DeadlineExceeded(f"{url} did not answer before the deadline") from exc
    except httpx.HTTPError as exc:
        raise RemoteError(f"{url}: {exc!r}") from exc
    if r.status_code != 200:
        raise RemoteError(f"{url} answered {r.status_code}: {r.text[:300]}")
    out: dict[str, Any] = r.json()
    return out


async def generate_alone(
    http: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: tuple[int, ...],
    sampling: SamplingParams,
    *,
    deadline_s: float = 60.0,
    ignore_eos: bool = True,
) -> tuple[int, ...]:
    """One vLLM generating alone (no transfer params: the connector stays out): the exactness
    reference for whatever the router produced."""
    body = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": sampling.max_tokens,
        "return_token_ids": True,
        **sampling_body(sampling, ignore_eos=ignore_eos),
    }
    out = await post_completion(http, url, body, time.monotonic() + deadline_s)
    return tuple(int(t) for t in out["choices"][0]["token_ids"])


def error_text(chunk: dict[str, Any]) -> str:
    """The message of vLLM's streamed error chunk (``{"error": {"message": ...}}``)."""
    err = chunk["error"]
    return str(err.get("message", err)) if isinstance(err, dict) else str(err)


def logprob_rows(choice: dict[str, Any], as_ids: bool = False) -> list[dict[str, Any]]:
    """Per token of a completions choice (streamed or not): vLLM's logprobs entry as one row
    ``{"token", "logprob", "top": [[token, logprob], ...]}`` (``top`` in vLLM's order: the drawn
    token, then by rank); [] when the choice has none. ``as_ids``: the call asked for
    ``return_tokens_as_token_ids``, and each token is its id (an int) for the router to spell."""
    lp = choice.get("logprobs")
    if not lp:
        return []
    read: Callable[[str], int | str] = token_id if as_ids else str
    tops = lp.get("top_logprobs") or [None] * len(lp["tokens"])
    return [
        {"token": read(tok), "logprob": value, "top": [[read(t), v] for t, v in (top or {}).items()]}
        for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], tops, strict=True)
    ]


def token_id(name: str) -> int:
    """The id in vLLM's "token_id:N"."""
    digits = name.removeprefix(ID_PREFIX)
    if digits == name or not (digits.isascii() and digits.isdigit()):
        raise RemoteError(f"vLLM named a logprob token {name[:40]!r}, not {ID_PREFIX}N")
    return int(digits)


def cached_tokens(out: dict[str, Any]) -> int:
    details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)
