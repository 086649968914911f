"""Text at the router: a tokenizer (Hugging Face ``tokenizers``, loaded from a model directory),
its chat template (jinja2, sandboxed), and per-choice incremental detokenization with stop strings.

``TextCodec.load(dir)`` reads ``tokenizer.json`` and the chat template (``chat_template.jinja``, or
``chat_template`` in ``tokenizer_config.json``), and measures the longest token in bytes (a text
prompt's byte limit follows from it: ``router.openai_job.prompt_byte_limit``). Without a
tokenizer the router works on token ids only: a text prompt is refused (400).

``TextWorkers`` keeps tokenizing off the event loop (issue 27): a request body larger than a few
kB is parsed and tokenized on one of ``api.tokenizer_workers`` threads, which run at a lower CPU
priority than the loop; ``tokenizers`` releases the GIL while it encodes a batch, so one client's
long prompt delays only itself. Incremental detokenizing (``ChoiceText``) decodes a window of a
few tokens per step, microseconds, and stays on the loop.

``ChoiceText`` turns one choice's token stream into text deltas the way vLLM's server does: text
of a stop token id is left out, a stop string ends the choice and is cut from the text (unless
asked to keep it), and text that could still become a stop string is held back until it cannot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from pddlink.errors import ConfigError, InvalidInput


@dataclass(frozen=True, slots=True)
class TextCodec:
    tokenizer: Tokenizer
    chat_template: str = ""
    bos_token: str = ""
    eos_token: str = ""
    eos_token_id: int | None = None
    max_token_bytes: int = 0  # the longest token's UTF-8 bytes (0: measured here)
    space_marker: str = field(default="", init=False)  # ``leading_space_marker``'s

    def __post_init__(self) -> None:
        if not self.max_token_bytes:
            object.__setattr__(self, "max_token_bytes", longest_token_bytes(self.tokenizer))
        object.__setattr__(self, "space_marker", leading_space_marker(self.tokenizer))

    @classmethod
    def load(cls, directory: str | Path) -> TextCodec:
        d = Path(directory)
        try:
            tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises its own Exception type
            raise ConfigError(f"api.tokenizer {d}: cannot load tokenizer.json: {exc}") from None
        conf: dict[str, object] = {}
        if (d / "tokenizer_config.json").is_file():
            conf = json.loads((d / "tokenizer_config.json").read_text())
        template = str(conf.get("chat_template") or "")
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        eos = str(conf.get("eos_token") or "")
        eos_id = tok.token_to_id(eos) if eos else None
        if (d / "generation_config.json").is_file():
            gen = json.loads((d / "generation_config.json").read_text())
            if isinstance(gen.get("eos_token_id"), int):
                eos_id = gen["eos_token_id"]
        return cls(tok, template, str(conf.get("bos_token") or ""), eos, eos_id)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        # encode_batch, not encode: it releases the GIL (measured: 1.5 MB held it 3.6 s, the batch 0.15 s)
        return list(self.tokenizer.encode_batch([text], add_special_tokens=True)[0].ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        if not self.chat_template:
            raise InvalidInput("this model has no chat template: use /v1/completions")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        try:
            return env.from_string(self.chat_template).render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except Exception as exc:  # a template error is the model's, reported as a refusal
            raise InvalidInput(f"the chat template failed: {type(exc).__name__}: {exc}") from None


def longest_token_bytes(tok: Tokenizer) -> int:
    """An upper bound of the UTF-8 bytes one token spells: the longest of its decoded text and its
    vocabulary string (which carries markers such as ``Ġ`` or ``▁`` that decoding drops)."""
    n = tok.get_vocab_size(with_added_tokens=True)
    decoded = tok.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    pieces = (tok.id_to_token(i) or "" for i in range(n))
    return max(max((len(t.encode()) for t in decoded), default=1), max(len(p.encode()) for p in pieces))


def leading_space_marker(tok: Tokenizer) -> str:
    """The space marker of a SentencePiece-style pre-tokenizer (``Metaspace``, alone or in a
    ``Sequence``), whose leading instance decoding one token drops; "" for none. vLLM's
    ``get_leading_space_marker``, read from the same JSON."""
    try:
        pre = json.loads(tok.to_str()).get("pre_tokenizer") or {}
    except ValueError:
        return ""
    for p in [pre, *(pre.get("pretokenizers") or [] if pre.get("type") == "Sequence" else [])]:
        if p.get("type") == "Metaspace":
            return str(p.get("replacement", "\u2581"))
    return ""


T = TypeVar("T")
INLINE_BYTES = 4096  # a request body this small is parsed and tokenized on the loop (microseconds)


class TextWorkers:
    """A bounded pool of threads for parsing and tokenizing large request bodies."""

    def __init__(self, workers: int) -> None:
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="tokenize", initializer=_yield_cpu)

    async def run(self, fn: Callable[[], T], size: int) -> T:
        """``fn()`` on a worker when ``size`` (its input's bytes) is large, else here and now."""
        if size <= INLINE_BYTES:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _yield_cpu() -> None:
    """A worker thread runs at a lower priority than the event loop (Linux: per-thread nice)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


@dataclass(slots=True)
class ChoiceText:
    """One choice's text as its tokens arrive. ``push`` returns the new text to emit; ``stopped``
    names the stop string that ended the choice (the router then cancels the request)."""

    codec: TextCodec | None
    stop: tuple[str, ...] = ()
    include_stop: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0  # vLLM: no stop string ends a choice before this many tokens
    ids: list[int] = field(default_factory=list)
    text: str = ""  # decoded so far (with the part held back)
    emitted: int = 0  # characters of ``text`` already handed out
    stopped: str | None = None
    _prefix: int = 0
    _read: int = 0
    _min_end: int = 0  # a stop string must end past this much text (``min_tokens``' text)

    def push(self, token_id: int, *, is_stop_token: bool = False) -> str:
        self.ids.append(token_id)
        if self.codec is None or self.stopped is not None:
            return ""
        if is_stop_token and not self.include_stop:
            return self._release(final=True)
        self.text += self._delta()
        if len(self.ids) <= self.min_tokens:
            self._min_end = len(self.text)
        elif self.stop:
            for s in self.stop:
                at = self.text.find(s, max(0, self.emitted - len(s) + 1, self._min_end - len(s) + 1))
                if at >= 0:
                    self.stopped = s
                    self.text = self.text[: at + len(s) if self.include_stop else at]
                    return self._release(final=True)
        return self._release(final=False)

    def finish(self) -> str:
        """The text held back, once the choice has ended."""
        return self._release(final=True)

    def _delta(self) -> str:
        assert self.codec is not None
        before = self.codec.decode(self.ids[self._prefix : self._read], self.skip_special_tokens)
        now = self.codec.decode(self.ids[self._prefix :], self.skip_special_tokens)
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        self._prefix, self._read = self._read, len(self.ids)
        return now[len(before) :]

    def _release(self, final: bool) -> str:
        hold = 0 if final or not self.stop else max(len(s) for s in self.stop) - 1
        end = max(self.emitted, len(self.text) - hold)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
