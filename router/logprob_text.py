"""Each logprob token's string as vLLM's own server spells it, made at the router.

vLLM's completions ``top_logprobs`` is an object keyed by the token's string, so two top tokens
that decode alike (two bytes of one UTF-8 character, both '') are one entry there, while vLLM's
chat lists both. The router's legs call the completions endpoint, so they ask for the tokens by id
instead (``return_tokens_as_token_ids``: "token_id:N", read back as ints by
``vllm_http.logprob_rows``) whenever the router can spell them itself: it has a tokenizer, or the
client asked for the ids. ``named_row`` then gives a row the strings vLLM's answer would hold: the
client's "token_id:N", or vLLM's ``decoded_token``, which ``vllm_tokens`` makes as vLLM's
``LogprobsProcessor`` does (``convert_ids_list_to_tokens`` and ``_verify_tokens``): each id decoded
alone, special tokens kept; the leading spaces that decoding drops from a SentencePiece piece put
back; a token whose text ends in U+FFFD decoded again after up to 4 of the choice's earlier output
tokens, and '' while its character is still incomplete. The context is the whole choice's output,
as for vLLM generating alone (an instance that continues after a handoff has only its own part).
``openai_api`` shapes the strings per endpoint: chat lists every top token, completions key them
by string, a later duplicate overwriting the earlier one's value as vLLM's dict does.

Not matched: what ``transformers`` adds to ``tokenizers`` when vLLM decodes (a ``tokenizer_config``
``clean_up_tokenization_spaces`` on a model that is not BPE; a model class that rebuilds its
tokenizer rather than read ``tokenizer.json``) and vLLM's other tokenizer modes (``mistral``, slow
tokenizers): the router reads ``tokenizer.json`` with ``tokenizers`` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from router.openai_text import TextCodec

ID_PREFIX = "token_id:"  # vLLM's ``format_token_id_placeholder`` (here: the router's base image has no httpx)
CONTEXT_TOKENS = 4  # vLLM: ``LogprobsProcessor._get_sampled_context_ids(max_context=4)``
REPLACEMENT = "\ufffd"


def id_name(token_id: int) -> str:
    """vLLM's name of a token asked for as an id (``format_token_id_placeholder``)."""
    return f"{ID_PREFIX}{token_id}"


def named_row(
    row: dict[str, Any], output: Sequence[int], codec: TextCodec | None, as_ids: bool
) -> dict[str, Any]:
    """``row`` (``vllm_http.logprob_rows``'s) with strings for its tokens, as vLLM's answer has
    them; ``output`` is the choice's output ids up to and including the row's token. A row of
    vLLM's strings (the legs did not ask for ids) is as it came. The named row keeps the drawn
    token's ``decoded`` text apart: vLLM's chat takes its ``bytes`` from it even when the token is
    named "token_id:N"."""
    token = row["token"]
    if isinstance(token, str):
        return row
    top = row["top"]
    ids = [token, *(t for t, _ in top)]
    texts = vllm_tokens(codec, ids, output[-1 - CONTEXT_TOKENS : -1]) if codec is not None else None
    names = texts if texts is not None and not as_ids else [id_name(t) for t in ids]
    return {
        "token": names[0],
        "logprob": row["logprob"],
        "top": [[name, value] for name, (_, value) in zip(names[1:], top, strict=True)],
        "decoded": names[0] if texts is None else texts[0],
    }


def vllm_tokens(codec: TextCodec, ids: Sequence[int], context: Sequence[int]) -> list[str]:
    """vLLM's ``decoded_token`` of each of one step's ``ids`` (the drawn token and its top ones),
    after the output's ``context`` (its last tokens before the step; vLLM reads up to 4)."""
    tok = codec.tokenizer
    texts = [t or "" for t in tok.decode_batch([[i] for i in ids], skip_special_tokens=False)]
    if codec.space_marker:
        texts = [
            _leading_spaces(tok.id_to_token(i) or "", t, codec.space_marker)
            for i, t in zip(ids, texts, strict=True)
        ]
    ctx = list(context[-CONTEXT_TOKENS:])
    return [
        _completed(codec, i, ctx) if t.endswith(REPLACEMENT) else t for i, t in zip(ids, texts, strict=True)
    ]


def _leading_spaces(piece: str, text: str, marker: str) -> str:
    """vLLM's ``_restore_leading_spaces``: as many leading spaces as the piece has markers."""
    markers = len(piece) - len(piece.lstrip(marker))
    missing = markers - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if missing > 0 else text


def _completed(codec: TextCodec, token_id: int, context: list[int]) -> str:
    """vLLM's ``_correct_decoded_token``: the token's text after the fewest context tokens that
    complete its character, less what the context's own complete tokens spell; '' when none do."""

    def decode(ids: list[int]) -> str:
        return codec.decode(ids, skip_special_tokens=False)

    for n in range(1, min(len(context), CONTEXT_TOKENS) + 1):
        ctx = context[-n:]
        full = decode([*ctx, token_id])
        if full.endswith(REPLACEMENT):
            continue
        clean = len(ctx)  # the context tokens before the ones of the same incomplete character
        while clean > 0 and decode([ctx[clean - 1]]).endswith(REPLACEMENT):
            clean -= 1
        prefix = decode(ctx[:clean]) if clean else ""
        if full.startswith(prefix):
            return full[len(prefix) :]
        # a normalizer changed the prefix: what follows the longest common prefix
        same = (k for k, (a, b) in enumerate(zip(prefix, full, strict=False)) if a != b)
        return full[next(same, min(len(prefix), len(full))) :]
    return ""
