"""Text at the router: incremental detokenization with stop strings and stop ids, on a real
byte-level BPE tokenizer trained here (``tokenizers``), token by token."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from router.openai_text import ChoiceText, TextCodec

WORDS = ["prefill", "decode", "relay", "main", "wan", "käse", "straße", "日本語", "token", "stream"]


@functools.cache
def _codec() -> TextCodec:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] * 20, trainer)
    return TextCodec(
        tok, "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", "<s>", "</s>", 1
    )


@pytest.fixture
def codec() -> TextCodec:
    return _codec()


def _run(ct: ChoiceText, ids: list[int], stop_ids: tuple[int, ...] = ()) -> str:
    out = ""
    for t in ids:
        out += ct.push(t, is_stop_token=t in stop_ids)
        if ct.stopped is not None:
            break
    return out + ct.finish()


def test_deltas_add_up_to_the_whole_decode(codec: TextCodec) -> None:
    text = "prefill 日本語 straße relay käse"
    ids = codec.encode(text)
    out = _run(ChoiceText(codec), ids)
    assert out == codec.decode(ids) == text


def test_no_partial_utf8_is_emitted(codec: TextCodec) -> None:
    ids = codec.encode("日本語")
    ct = ChoiceText(codec)
    for t in ids:
        assert "\ufffd" not in ct.push(t)


def test_stop_string_across_tokens_is_cut_and_never_emitted(codec: TextCodec) -> None:
    ids = codec.encode("prefill decode relay main wan")
    ct = ChoiceText(codec, stop=("lay ma",))
    out = _run(ct, ids)
    assert out == "prefill decode re" and ct.stopped == "lay ma"
    keep = ChoiceText(codec, stop=("lay ma",), include_stop=True)
    assert _run(keep, ids) == "prefill decode relay ma"


def test_stop_token_text_is_left_out(codec: TextCodec) -> None:
    ids = codec.encode("prefill decode")
    stop = ids[-1]
    out = _run(ChoiceText(codec), ids, stop_ids=(stop,))
    assert out == codec.decode(ids[:-1])


def test_chat_template_renders(codec: TextCodec) -> None:
    assert codec.render_chat([{"role": "user", "content": "hi"}]) == "<s>user: hi\n"


@settings(max_examples=200, deadline=None)
@given(
    words=st.lists(st.sampled_from([*WORDS, " ", "ß", "語"]), max_size=12),
    stop=st.sampled_from([*WORDS, "e d", "語"]),
)
def test_stop_strings_match_a_cut_of_the_whole_text(words: list[str], stop: str) -> None:
    codec = _codec()
    text = " ".join(words)
    ids = codec.encode(text)
    ct = ChoiceText(codec, stop=(stop,))
    out = _run(ct, ids)
    whole = codec.decode(ids)
    if stop in whole:
        assert ct.stopped == stop and out == whole[: whole.index(stop)]
    else:
        assert ct.stopped is None and out == whole
