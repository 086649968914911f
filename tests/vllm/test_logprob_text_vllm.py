"""The router names logprob tokens as vLLM does (``router.logprob_text.vllm_tokens``), held against
vLLM's own code on the tokenizer vLLM loads (``get_tokenizer``: ``transformers`` over the same
``tokenizer.json``): ``convert_ids_list_to_tokens`` then ``LogprobsProcessor._verify_tokens``, for a
byte-level BPE (GPT-2 style, the project's tiny model) and a SentencePiece-style one (``Metaspace``
with byte fallback: leading spaces restored), every token alone and steps of byte tokens after
random output contexts. In memory; no server."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from router.logprob_text import vllm_tokens
from router.openai_text import TextCodec

try:
    from transformers import PreTrainedTokenizerFast
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
    from vllm.tokenizers.registry import get_tokenizer
    from vllm.v1.engine.logprobs import LogprobsProcessor
except Exception as exc:  # vLLM missing or broken: the whole module skips with the reason
    pytest.skip(f"vLLM is not importable: {exc}", allow_module_level=True)

pytestmark = [pytest.mark.vllm, pytest.mark.hf, pytest.mark.timeout(300)]

WORDS = ["prefill", "decode", "relay", "main", "wan", "token", "stream", "two  spaces", "x"]
TEXTS = ["日本語 テスト héllo", "wörld ünïcödé", "😀 emoji 🎉 mix", "prefill  decode"]


def _byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] * 20, trainer)
    return tok


def _metaspace() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=special)
    tok.train_from_iterator(
        [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] * 20 + TEXTS, trainer
    )
    return tok


@pytest.mark.parametrize("build", [_byte_level, _metaspace], ids=["byte_level", "metaspace"])
def test_names_equal_vllms(build: Any, tmp_path: Path) -> None:
    tok = build()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(str(tmp_path))
    hf = get_tokenizer(str(tmp_path))
    codec = TextCodec.load(tmp_path)
    proc = LogprobsProcessor(hf, None, None, None, None, None)

    def vllms(step: list[int], context: list[int]) -> list[str]:
        return proc._verify_tokens(convert_ids_list_to_tokens(hf, step), step, context[-4:])

    every = list(range(codec.vocab_size))
    assert vllm_tokens(codec, every, []) == vllms(every, [])
    partial = [i for i in every if hf.decode([i]).endswith("\ufffd")]
    assert len(partial) >= 64  # the byte tokens of incomplete characters
    rng = random.Random(0)
    differ = 0
    for _ in range(400):
        context = (codec.encode(rng.choice(TEXTS)) + rng.sample(partial, rng.randint(0, 3)))[
            -rng.randint(0, 6) :
        ]
        step = [rng.choice(partial), rng.randrange(codec.vocab_size), *rng.sample(partial, 3)]
        want = vllms(step, context)
        assert vllm_tokens(codec, step, context) == want, (context, step)
        differ += want != vllms(step, [])
    assert differ > 20  # the context named some byte tokens
