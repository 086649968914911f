"""A large body's texts measured before the parse workers see it (``router.prompt_bytes``): the same
refusal the whole validation gives, for completions (one prompt, a batch) and chat (the messages
together); nothing refused that fits, nor what the validator must name (bad JSON, wrong shapes)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from harness import edge_bench as eb
from router.openai_job import completion_job
from router.openai_schema import Endpoint, Limits, RequestRefused
from router.openai_text import TextCodec
from router.prompt_bytes import oversized_text, prompt_byte_limit

LIMITS = Limits(vocab_size=2048, max_prompt_tokens=500, max_tokens_limit=16)


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(eb.WORDS)] * 10, trainer)
    return TextCodec(tok, "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")


def _refusal(body: dict[str, Any], endpoint: Endpoint, codec: TextCodec) -> tuple[str, str] | None:
    try:
        oversized_text(json.dumps(body).encode(), endpoint, LIMITS, codec)
    except RequestRefused as exc:
        return exc.message, exc.param
    return None


def _validator(body: dict[str, Any], endpoint: Endpoint, codec: TextCodec) -> tuple[str, str]:
    with pytest.raises(RequestRefused) as err:
        completion_job(json.dumps(body).encode(), endpoint, LIMITS, codec)
    return err.value.message, err.value.param


@pytest.mark.parametrize(
    "endpoint, body",
    [
        (Endpoint.COMPLETIONS, {"prompt": "ü" * 40_000, "max_tokens": 2}),  # 80,000 bytes of 40,000 chars
        (Endpoint.COMPLETIONS, {"prompt": ["short", "x" * 90_000], "max_tokens": 2}),
        (Endpoint.CHAT, {"messages": [{"role": "user", "content": "x" * 30_000}] * 3}),
        (
            Endpoint.CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "y" * 90_000}]}]},
        ),
    ],
)
def test_over_the_limit_is_refused_as_the_validator_refuses_it(
    endpoint: Endpoint, body: dict[str, Any], codec: TextCodec
) -> None:
    assert prompt_byte_limit(LIMITS, codec) < 80_000  # every body here is over it
    got = _refusal(body, endpoint, codec)
    assert got is not None and got == _validator(body, endpoint, codec)


@pytest.mark.parametrize(
    "endpoint, raw",
    [
        (Endpoint.COMPLETIONS, json.dumps({"prompt": "prefill decode " * 100, "max_tokens": 2})),
        (Endpoint.COMPLETIONS, json.dumps({"prompt": list(range(5000)), "max_tokens": 2})),  # ids: no text
        (Endpoint.CHAT, json.dumps({"messages": [{"role": "user", "content": "hi"}] * 50})),
        (Endpoint.COMPLETIONS, '{"prompt": "' + "x" * 90_000),  # not JSON: the validator's to name
        (Endpoint.COMPLETIONS, json.dumps(["x" * 90_000])),  # not an object
        (Endpoint.CHAT, json.dumps({"messages": "x" * 90_000})),  # not a list of messages
    ],
)
def test_what_fits_or_is_malformed_goes_on_to_the_validator(
    endpoint: Endpoint, raw: str, codec: TextCodec
) -> None:
    oversized_text(raw.encode(), endpoint, LIMITS, codec)  # returns: nothing refused here


def test_without_a_tokenizer_nothing_is_measured() -> None:
    oversized_text(json.dumps({"prompt": "x" * 1_000_000}).encode(), Endpoint.COMPLETIONS, LIMITS, None)
