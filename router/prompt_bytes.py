"""A text prompt's byte limit, checked before any tokenizing (issue 27: length limits bytes first).

``prompt_byte_limit``: the most UTF-8 bytes a text prompt (or a chat's messages together) may have;
``check_bytes``: ``RequestRefused`` over it, as the schema's validation calls it; ``oversized_text``:
the same check on a large body before anything else reads it. The body is parsed as plain JSON
(pydantic-core, about 0.5 ms a MB, no validation) and its texts measured; a body over the limit is
refused there, on the event loop, where handing it to a parse worker (``router.parse_pool``: a copy
into the pipe, another out, the validation) held a small request of another client 1.4-1.6x its
unloaded first token on 2 cores (``pddlink bench edge`` heavy_1mb). A body whose texts fit goes on
to the whole validation; one that is not JSON, or not shaped as a request, too: its error is the
validator's to name.
"""

from __future__ import annotations

from typing import Any

import pydantic_core

from router.openai_schema import Endpoint, Limits, RequestRefused, TextCodec


def prompt_byte_limit(limits: Limits, codec: TextCodec) -> int:
    """The most UTF-8 bytes a text prompt may have: ``limits.max_prompt_bytes`` when set, else
    what ``max_prompt_tokens`` tokens of the longest token can spell (so no prompt within the
    token limit is refused by it, and a longer one is refused before any tokenizing)."""
    return limits.max_prompt_bytes or limits.max_prompt_tokens * max(1, codec.max_token_bytes)


def check_bytes(size: int, limits: Limits, codec: TextCodec, where: str) -> None:
    limit = prompt_byte_limit(limits, codec)
    if size > limit:
        raise RequestRefused(
            f'"{where}" has {size} bytes of text; the limit is {limit} bytes '
            f"(at most {limits.max_prompt_tokens} tokens)",
            where,
        )


def oversized_text(body: bytes, endpoint: Endpoint, limits: Limits, codec: TextCodec | None) -> None:
    """``RequestRefused`` when a text of ``body`` is over the byte limit (see the module)."""
    if codec is None:
        return
    try:
        data = pydantic_core.from_json(body)
    except ValueError:
        return
    if not isinstance(data, dict):
        return
    if endpoint is Endpoint.CHAT:
        texts = [_message_text(m) for m in data.get("messages") or () if isinstance(m, dict)]
        check_bytes(sum(_utf8(t) for t in texts), limits, codec, "messages")
        return
    prompt = data.get("prompt")
    for text in [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else ():
        if isinstance(text, str):
            check_bytes(_utf8(text), limits, codec, "prompt")


def _message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _utf8(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))
