"""vLLM's sampling surface at the router, in memory (issue 27, item 1): the schema turns vLLM's
fields into ``SamplingParams``; the vLLM legs' body carries them (and the prior output a continuing
leg holds in its prompt); the answer carries each token's logprobs in vLLM's completions and chat
shapes, ``n`` choices per prompt with vLLM's child seeds, vLLM's usage; a stop string ends the
router's run at once and still gets its trace and prefix hit. The router is a fake generator that
records what it was asked and honours ``STOP``."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from pddlink.errors import InvalidInput
from pddlink.lifecycle import RunOutcome
from pddlink.sampling import SamplingParams
from router import STOP
from router.answer import GenerateEvent, RequestEnd, StreamedToken
from router.openai_api import STOP as API_STOP
from router.openai_api import Responder
from router.openai_job import completion_job
from router.openai_schema import Endpoint, Limits, RequestRefused
from router.openai_text import TextCodec
from router.vllm_http import PRIOR_OUTPUT_ARG, logprob_rows, sampling_body

WORDS = ["prefill", "decode", "relay", "main", "wan", "token", "stream"]


@functools.cache
def _codec() -> TextCodec:
    """A byte-level BPE tokenizer trained here (as ``test_openai_text``)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] * 20, trainer)
    return TextCodec(tok, "{% for m in messages %}{{ m['content'] }}\n{% endfor %}", "<s>", "</s>", 1)


LIMITS = Limits(300, 4000, 4000)


def _row(tok: int) -> dict[str, Any]:
    return {"token": f"t{tok}", "logprob": -0.5 - tok / 1000, "top": [[f"t{tok}", -0.5], [f"u{tok}", -1.5]]}


class FakeRouter:
    """Yields ``answer`` tokens (with logprobs rows), then the final item; stops at ``STOP``."""

    def __init__(self, answer: list[int]) -> None:
        self.answer = answer
        self.asked: list[SamplingParams] = []
        self.made: list[int] = []

    async def generate(
        self, prompt: list[int], sampling: SamplingParams, **kw: Any
    ) -> AsyncGenerator[GenerateEvent, Any]:
        self.asked.append(sampling)
        made = 0
        for i, tok in enumerate(self.answer[: sampling.max_tokens]):
            made += 1
            row = _row(tok) if sampling.logprobs is not None else None
            ev = StreamedToken(len(prompt) + i, tok, "rld" if i < 2 else "md", row)
            if (yield ev) == STOP:
                break
            if tok in sampling.stop_token_ids:
                break
        self.made.append(made)
        usage = {"cached_tokens": 32, "created_cache_tokens": 0}
        prompt_logprobs = None
        if sampling.prompt_logprobs is not None:  # P's, in vLLM's JSON: none for the first token
            prompt_logprobs = [None] + [
                {str(t): {"logprob": -1.0, "rank": 1, "decoded_token": f"p{t}"},
                 "7": {"logprob": float("-inf"), "rank": 2, "decoded_token": "p7"}}
                for t in prompt[1:]
            ]  # fmt: skip
        yield RequestEnd("r", "r", RunOutcome.FINISHED, "", {"t": made}, usage, prompt_logprobs)


def _job(body: dict[str, Any], endpoint: Endpoint = Endpoint.COMPLETIONS) -> Any:
    return completion_job(json.dumps(body).encode(), endpoint, LIMITS, _codec())


def _body(router: FakeRouter, job: Any, chat: bool = False) -> dict[str, Any]:
    r = Responder(router, job, "tiny", _codec(), None)
    status, out = asyncio.run(r.body())
    assert status == 200, out
    return out


def _events(router: FakeRouter, job: Any) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        r = Responder(router, job, "tiny", _codec(), None)
        return [json.loads(e[6:]) for e in [x async for x in r.events()] if e != b"data: [DONE]\n\n"]

    return asyncio.run(run())


def test_the_schema_carries_vllms_sampling_fields() -> None:
    job = _job({"prompt": [5, 6, 7], "max_tokens": 20, "min_p": 0.1, "presence_penalty": 0.5,
                "frequency_penalty": -0.5, "repetition_penalty": 1.3, "logit_bias": {"17": 500, "3": -1},
                "min_tokens": 4, "allowed_token_ids": [1, 2, 17], "bad_words": ["ab"], "logprobs": 3,
                "seed": 9, "temperature": 0.7, "n": 2})  # fmt: skip
    s = job.sampling
    assert (s.min_p, s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.1, 0.5, -0.5, 1.3)
    assert s.logit_bias == ((17, 100.0), (3, -1.0))  # vLLM clamps to [-100, 100]
    assert (s.min_tokens, s.allowed_token_ids, s.bad_words, s.logprobs) == (4, (1, 2, 17), ("ab",), 3)
    assert job.n == 2 and job.logprobs and [job.choice_sampling(i).seed for i in (0, 1)] == [9, 10]
    for bad, field in (({"logit_bias": {"999": 1}}, "logit_bias"), ({"allowed_token_ids": [300]}, "allowed"),
                       ({"min_tokens": 30}, "min_tokens"), ({"presence_penalty": 3}, "presence_penalty"),
                       ({"logprobs": 21}, "logprobs"), ({"n": 2, "temperature": 0}, "n")):  # fmt: skip
        with pytest.raises(RequestRefused) as err:
            _job({"prompt": [5], "max_tokens": 20, **bad})
        assert err.value.param.startswith(field)
    with pytest.raises(RequestRefused, match="top_logprobs"):
        _job({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, Endpoint.CHAT)
    chat = _job(
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2}, Endpoint.CHAT
    )
    assert chat.sampling.logprobs == 2 and chat.logprobs


def test_after_counts_what_is_left_and_the_body_names_the_prior_output() -> None:
    s = SamplingParams(max_tokens=20, min_tokens=5, presence_penalty=1.0, logprobs=1, min_p=0.2)
    a = s.after(7)
    assert (a.max_tokens, a.min_tokens, a.prior_output_tokens) == (13, 0, 7)
    assert a.after(3).prior_output_tokens == 10 and s.after(0) is s
    body = sampling_body(a)
    assert body["vllm_xargs"] == {PRIOR_OUTPUT_ARG: 7} and body["presence_penalty"] == 1.0
    assert body["logprobs"] == 1 and body["min_p"] == 0.2 and "min_tokens" not in body
    assert "vllm_xargs" not in sampling_body(s) and sampling_body(SamplingParams()).keys() == {
        "temperature",
        "top_p",
        "ignore_eos",
    }
    assert set(s.vllm_only()) == {"min_tokens", "presence_penalty", "logprobs", "min_p"}
    assert SamplingParams.from_dict(a.to_dict()) == a
    with pytest.raises(InvalidInput):
        SamplingParams(repetition_penalty=0.0)


def test_prior_output_arg_is_the_processors() -> None:
    sampling = pytest.importorskip("engines_adapter.vllm.sampling")
    assert sampling.PRIOR_OUTPUT_ARG == PRIOR_OUTPUT_ARG


def test_logprob_rows_read_vllms_completions_shape() -> None:
    choice = {"logprobs": {"tokens": ["a", "b"], "token_logprobs": [-1.0, -2.0], "text_offset": [0, 1],
                           "top_logprobs": [{"a": -1.0, "c": -1.5}, {"b": -2.0}]}}  # fmt: skip
    assert logprob_rows(choice) == [
        {"token": "a", "logprob": -1.0, "top": [["a", -1.0], ["c", -1.5]]},
        {"token": "b", "logprob": -2.0, "top": [["b", -2.0]]},
    ]
    assert logprob_rows({"logprobs": None}) == []


def test_completions_answer_has_each_tokens_logprobs_and_n_choices() -> None:
    router = FakeRouter([40, 41, 42, 43])
    out = _body(router, _job({"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 4, "logprobs": 1, "n": 2,
                             "seed": 3, "temperature": 0.5}))  # fmt: skip
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [s.seed for s in router.asked] == [3, 4, 3, 4]
    lp = out["choices"][0]["logprobs"]
    assert lp["tokens"] == ["t40", "t41", "t42", "t43"] and lp["text_offset"] == [0, 3, 6, 9]
    assert lp["top_logprobs"][1] == {"t41": -0.5, "u41": -1.5}
    assert lp["token_logprobs"][2] == pytest.approx(-0.542)
    usage = out["usage"]
    assert usage["prompt_tokens"] == 5 and usage["completion_tokens"] == 16  # each prompt once
    assert usage["prompt_tokens_details"] == {"cached_tokens": 32, "created_cache_tokens": None,
                                              "multimodal_tokens": None}  # fmt: skip


def test_chat_and_streamed_logprobs() -> None:
    msg = [{"role": "user", "content": "x"}]
    chat = _body(FakeRouter([40, 41]), _job({"messages": msg, "max_tokens": 2, "logprobs": True,
                                             "top_logprobs": 1}, Endpoint.CHAT))  # fmt: skip
    content = chat["choices"][0]["logprobs"]["content"]
    top = [{"token": "t40", "logprob": -0.5, "bytes": list(b"t40")}]
    assert content[0] == {
        "token": "t40",
        "logprob": pytest.approx(-0.54),
        "bytes": list(b"t40"),
        "top_logprobs": top,
    }
    assert chat["usage"]["prompt_tokens_details"]["created_cache_tokens"] == 0
    chunks = _events(FakeRouter([40, 41, 42]), _job({"prompt": [5], "max_tokens": 3, "logprobs": 0,
                                                     "stream": True}))  # fmt: skip
    rows = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    assert [r["text_offset"] for r in rows if r["tokens"]] == [[0], [3], [6]]


def test_a_stop_string_ends_the_run_at_once_and_keeps_its_trace_and_prefix_hit() -> None:
    codec = _codec()
    ids = codec.encode("prefill decode relay main wan token stream")
    router = FakeRouter(ids)
    out = _body(router, _job({"prompt": [5], "max_tokens": 30, "stop": "relay"}))
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "relay"
    assert router.made[0] < len(ids)  # the run stopped there, not at its end
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    # min_tokens: no stop string before that many tokens (vLLM's detokenizer)
    late = FakeRouter(ids)
    out = _body(
        late, _job({"prompt": [5], "max_tokens": len(ids), "stop": "relay", "min_tokens": len(ids) - 1})
    )
    assert out["choices"][0]["finish_reason"] == "length" and late.made[0] == len(ids)


def test_stop_is_the_routers() -> None:
    assert STOP == API_STOP


def test_echo_puts_the_prompt_first_in_text_and_logprobs() -> None:
    codec = _codec()
    prompt = codec.encode("prefill decode")
    out = _body(FakeRouter([40, 41]), _job({"prompt": "prefill decode", "max_tokens": 2, "echo": True}))
    assert out["choices"][0]["text"].startswith("prefill decode")
    ids = _body(FakeRouter([40, 41]), _job({"prompt": prompt, "max_tokens": 2, "echo": True}))
    assert ids["choices"][0]["text"].startswith(codec.decode(prompt, skip_special_tokens=False))
    kept = _body(
        FakeRouter([40]), _job({"prompt": prompt, "max_tokens": 1, "echo": True, "return_token_ids": True})
    )
    assert not kept["choices"][0]["text"].startswith("prefill")  # vLLM: no prompt text with the ids
    router = FakeRouter([40, 41])
    out = _body(router, _job({"prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 1}))
    assert router.asked[0].prompt_logprobs == 1
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 2 and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and lp["tokens"][1] == f"p{prompt[1]}"
    assert lp["top_logprobs"][1] == {f"p{prompt[1]}": -1.0, "p7": -9999.0}  # vLLM clamps -inf
    assert lp["tokens"][-2:] == ["t40", "t41"] and out["choices"][0]["prompt_logprobs"][0] is None
    with pytest.raises(RequestRefused, match="echo"):
        _job({"prompt": prompt, "echo": True, "logprobs": 1, "stream": True})


def test_structured_outputs_run_without_a_handoff() -> None:
    msg = [{"role": "user", "content": "x"}]
    job = _job({"messages": msg, "response_format": {"type": "json_object"}}, Endpoint.CHAT)
    assert job.pipeline == "p_md" and json.loads(job.sampling.structured) == {
        "response_format": {"type": "json_object"}
    }
    assert sampling_body(job.sampling)["response_format"] == {"type": "json_object"}
    assert "structured" in job.sampling.vllm_only()
    plain = _job({"messages": msg, "response_format": {"type": "text"}}, Endpoint.CHAT)
    assert plain.pipeline == "" and not plain.sampling.structured
    guided = _job({"prompt": [5], "structured_outputs": {"choice": ["a", "b"]}, "pipeline": "recompute"})
    assert guided.pipeline == "recompute" and "structured_outputs" in sampling_body(guided.sampling)
    with pytest.raises(RequestRefused, match="without a handoff") as err:
        _job({"prompt": [5], "response_format": {"type": "json_object"}, "pipeline": "p_rld_md"})
    assert err.value.param == "response_format"
