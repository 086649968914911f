"""Logprob tokens named at the router as vLLM names them (``router.logprob_text``), in memory: the
legs ask vLLM for ids and read them back; two top tokens of one string stay two in chat and merge
in completions as vLLM's dict merges them; a byte token is spelled after the choice's earlier
output (across a handoff too); SentencePiece leading spaces come back; a client's
``return_tokens_as_token_ids`` keeps "token_id:N"; a router without a tokenizer keeps vLLM's
strings. ``tests/vllm/test_logprob_text_vllm.py`` holds the same against vLLM's own code."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pddlink.errors import RemoteError
from pddlink.lifecycle import RunOutcome
from pddlink.sampling import SamplingParams
from router.answer import GenerateEvent, RequestEnd, StreamedToken
from router.logprob_text import named_row, vllm_tokens
from router.openai_api import Responder
from router.openai_job import Job, completion_job
from router.openai_schema import Endpoint, Limits
from router.openai_text import TextCodec, leading_space_marker
from router.vllm_http import logprob_rows, sampling_body
from tests.sidecar.test_openai_sampling_surface import _codec as sampling_surface_codec

LIMITS = Limits(300, 4000, 4000)
MSG = [{"role": "user", "content": "x"}]


# byte-level BPE trained on ASCII words: "日" is three byte tokens, each '\ufffd' alone
_codec = sampling_surface_codec


def _ids(text: str) -> list[int]:
    return _codec().encode(text)


NI = _ids("日")  # three byte tokens
WORD = _ids("relay")[0]


class Steps:
    """A router whose tokens carry the given rows (ids, as the legs read them with ``as_ids``)."""

    def __init__(self, steps: list[tuple[int, list[tuple[int, float]]]]) -> None:
        self.steps = steps
        self.asked: list[SamplingParams] = []

    async def generate(
        self, prompt: list[int], sampling: SamplingParams, **kw: Any
    ) -> AsyncGenerator[GenerateEvent, Any]:
        self.asked.append(sampling)
        for i, (tok, top) in enumerate(self.steps[: sampling.max_tokens]):
            row = {"token": tok, "logprob": top[0][1], "top": [[t, v] for t, v in top]}
            yield StreamedToken(len(prompt) + i, tok, "rld" if i < 2 else "md", row)
        yield RequestEnd("r", "r", RunOutcome.FINISHED, "", {}, {"cached_tokens": 0}, None)


def _job(body: dict[str, Any], endpoint: Endpoint = Endpoint.COMPLETIONS, codec: Any = "codec") -> Job:
    codec = _codec() if codec == "codec" else codec
    return completion_job(json.dumps({"ignore_eos": True, **body}).encode(), endpoint, LIMITS, codec)


def _answer(router: Steps, job: Job, codec: TextCodec | None) -> dict[str, Any]:
    status, out = asyncio.run(Responder(router, job, "tiny", codec, None).body())
    assert status == 200, out
    return out


def _stream(router: Steps, job: Job, codec: TextCodec | None) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        r = Responder(router, job, "tiny", codec, None)
        return [json.loads(e[6:]) for e in [x async for x in r.events()] if e != b"data: [DONE]\n\n"]

    return asyncio.run(run())


# -- the legs ------------------------------------------------------------------------------------


def test_the_legs_ask_for_ids_and_read_them_back() -> None:
    assert (
        sampling_body(SamplingParams(logprobs=2, logprobs_as_ids=True))["return_tokens_as_token_ids"] is True
    )
    assert "return_tokens_as_token_ids" not in sampling_body(SamplingParams(logprobs=2))
    choice = {"logprobs": {"tokens": ["token_id:7"], "token_logprobs": [-1.0], "text_offset": [0],
                           "top_logprobs": [{"token_id:7": -1.0, "token_id:12": -1.5}]}}  # fmt: skip
    assert logprob_rows(choice, as_ids=True) == [
        {"token": 7, "logprob": -1.0, "top": [[7, -1.0], [12, -1.5]]}
    ]
    assert logprob_rows(choice)[0]["token"] == "token_id:7"  # not asked: vLLM's string as it is
    for bad in ("7", "token_id:", "token_id:-1", "token_id:\u00b2"):
        choice["logprobs"]["tokens"] = [bad]
        with pytest.raises(RemoteError):
            logprob_rows(choice, as_ids=True)


def test_the_job_asks_for_ids_when_the_router_can_name_them() -> None:
    assert _job({"prompt": [5], "logprobs": 2}).sampling.logprobs_as_ids  # a tokenizer
    assert not _job({"prompt": [5], "logprobs": 2}, codec=None).sampling.logprobs_as_ids  # vLLM's strings
    theirs = _job({"prompt": [5], "logprobs": 2, "return_tokens_as_token_ids": True}, codec=None)
    assert theirs.sampling.logprobs_as_ids and theirs.tokens_as_ids
    assert not _job({"prompt": [5]}).sampling.logprobs_as_ids  # no logprobs: nothing to name
    chat = _job({"messages": MSG, "logprobs": True, "top_logprobs": 3}, Endpoint.CHAT)
    assert chat.sampling.logprobs_as_ids and not chat.tokens_as_ids


# -- naming --------------------------------------------------------------------------------------


def test_byte_tokens_are_spelled_after_the_output_before_them() -> None:
    codec = _codec()
    assert [codec.decode([t]) for t in NI] == ["\ufffd"] * 3
    assert [vllm_tokens(codec, [t], NI[:k]) for k, t in enumerate(NI)] == [[""], [""], ["日"]]
    assert vllm_tokens(codec, [NI[2]], [WORD] * 5 + NI[:2]) == ["日"]  # the last tokens are read
    assert vllm_tokens(codec, [NI[2]], [NI[1]]) == [""]  # the character's first byte is missing
    # a complete token before the character is not part of the name
    assert vllm_tokens(codec, [NI[2]], [WORD, NI[0], NI[1]]) == ["日"]


def test_chat_lists_both_tokens_of_one_string_and_completions_merge_them() -> None:
    step = (NI[0], [(NI[0], -0.5), (NI[1], -1.0), (WORD, -1.2), (NI[2], -2.0), (7, -3.0)])
    chat = _answer(Steps([step]), _job({"messages": MSG, "max_tokens": 1, "logprobs": True,
                                        "top_logprobs": 4}, Endpoint.CHAT), _codec())  # fmt: skip
    entry = chat["choices"][0]["logprobs"]["content"][0]
    assert (entry["token"], entry["bytes"]) == ("", [])
    assert [(t["token"], t["logprob"]) for t in entry["top_logprobs"]] == [
        ("", -0.5),
        ("", -1.0),
        ("relay", -1.2),
        ("", -2.0),
    ]
    comp = _answer(Steps([step]), _job({"prompt": [5], "max_tokens": 1, "logprobs": 4}), _codec())
    top = comp["choices"][0]["logprobs"]["top_logprobs"][0]
    # vLLM's dict: the last '' wins the value, the first keeps the place
    assert list(top.items()) == [("", -2.0), ("relay", -1.2), (_codec().decode([7]), -3.0)]


def test_a_character_spans_the_handoff_and_offsets_follow_the_names() -> None:
    steps = [
        (WORD, [(WORD, -0.1)]),
        (NI[0], [(NI[0], -0.2)]),
        (NI[1], [(NI[1], -0.3)]),
        (NI[2], [(NI[2], -0.4)]),
    ]
    job = _job({"prompt": [5], "max_tokens": 4, "logprobs": 0})
    lp = _answer(Steps(steps), job, _codec())["choices"][0]["logprobs"]
    assert lp["tokens"] == ["relay", "", "", "日"]  # RLD made the first two, MD the rest
    assert lp["text_offset"] == [0, 5, 5, 5]
    chunks = _stream(
        Steps(steps), _job({"prompt": [5], "max_tokens": 4, "logprobs": 0, "stream": True}), _codec()
    )
    rows = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    streamed = [(t, o) for r in rows for t, o in zip(r["tokens"], r["text_offset"], strict=True)]
    assert streamed == list(zip(lp["tokens"], lp["text_offset"], strict=True))


def test_a_clients_ids_stay_ids() -> None:
    step = (NI[0], [(NI[0], -0.5), (NI[1], -1.0)])
    steps = [(NI[1], [(NI[1], -0.1)]), step]
    job = _job({"prompt": [5], "max_tokens": 2, "logprobs": 1, "return_tokens_as_token_ids": True})
    lp = _answer(Steps(steps), job, _codec())["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{NI[1]}", f"token_id:{NI[0]}"]
    assert lp["top_logprobs"][1] == {f"token_id:{NI[0]}": -0.5, f"token_id:{NI[1]}": -1.0}
    assert lp["text_offset"] == [0, len(f"token_id:{NI[1]}")]
    # chat: the drawn token's bytes are its decoded text's (vLLM's ``step_decoded``), a top one's its name's
    steps = [(NI[0], [(NI[0], -0.1)]), (NI[1], [(NI[1], -0.2)]), (NI[2], [(NI[2], -0.3), (WORD, -0.4)])]
    chat = _job({"messages": MSG, "max_tokens": 3, "logprobs": True, "top_logprobs": 2,
                 "return_tokens_as_token_ids": True}, Endpoint.CHAT)  # fmt: skip
    last = _answer(Steps(steps), chat, _codec())["choices"][0]["logprobs"]["content"][2]
    assert (last["token"], last["bytes"]) == (f"token_id:{NI[2]}", list("日".encode()))
    assert last["top_logprobs"][1] == {"token": f"token_id:{WORD}", "logprob": -0.4,
                                       "bytes": list(f"token_id:{WORD}".encode())}  # fmt: skip
    # without a tokenizer too (the legs asked for ids for the client)
    bare = _job(
        {"prompt": [5], "max_tokens": 2, "logprobs": 1, "return_tokens_as_token_ids": True}, codec=None
    )
    assert _answer(Steps(steps), bare, None)["choices"][0]["logprobs"]["tokens"][0] == f"token_id:{NI[0]}"


def test_vllms_own_strings_pass_through() -> None:
    row = {"token": "a", "logprob": -1.0, "top": [["a", -1.0]]}
    assert named_row(row, [1], None, False) is row
    assert named_row(row, [1], _codec(), False) is row


def test_sentencepiece_leading_spaces_come_back() -> None:
    vocab = {"<unk>": 0, "\u2581word": 1, "word": 2, "\u2581\u2581x": 3, "\u2581": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(), pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")]
    )
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    codec = TextCodec(tok)
    assert codec.space_marker == "\u2581" and _codec().space_marker == ""
    assert [tok.decode([i]) for i in (1, 2, 3, 4)] == ["word", "word", "x", ""]  # decoding drops them
    assert vllm_tokens(codec, [1, 2, 3, 4], []) == [" word", "word", "  x", " "]


def test_the_marker_is_read_as_vllm_reads_it() -> None:
    tok = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="_")
    assert leading_space_marker(tok) == "_"
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit()])
    assert leading_space_marker(tok) == ""


def test_echo_names_the_prompt_by_id_when_asked() -> None:
    class WithPrompt(Steps):
        async def generate(
            self, prompt: list[int], sampling: SamplingParams, **kw: Any
        ) -> AsyncGenerator[GenerateEvent, Any]:
            async for ev in super().generate(prompt, sampling, **kw):
                if isinstance(ev, RequestEnd):
                    plp = [None] + [
                        {str(t): {"logprob": -1.0, "rank": 1, "decoded_token": "p"}} for t in prompt[1:]
                    ]
                    ev = RequestEnd("r", "r", RunOutcome.FINISHED, "", {}, {"cached_tokens": 0}, plp)
                yield ev

    body = {
        "prompt": [5, 6],
        "max_tokens": 1,
        "logprobs": 0,
        "echo": True,
        "return_tokens_as_token_ids": True,
    }
    lp = _answer(WithPrompt([(WORD, [(WORD, -0.1)])]), _job(body), _codec())["choices"][0]["logprobs"]
    assert lp["tokens"] == ["token_id:5", "token_id:6", f"token_id:{WORD}"]
    assert lp["top_logprobs"][:2] == [None, {"token_id:6": -1.0}]
