"""The declared size of a chunked request body, seen as each chunk's size line arrives.

h11 decodes a ``Transfer-Encoding: chunked`` body, but says nothing of a chunk's declared size
until its data comes: a client that declares ``ffffffffff`` and then sends a byte a minute would
be refused only at the body deadline. ``ChunkSizes`` follows the chunked framing over the same
raw bytes (beside h11, which stays the decoder and the judge of malformed framing) and raises
``BodyTooLarge`` as soon as the sizes declared so far pass the body limit.

Sans-I/O: ``feed(data)`` with the bytes as they arrive, from the first byte after the head.
Bytes after the last chunk's trailers belong to the next request and are ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum, auto

MAX_SIZE_LINE = 4096  # a size line with extensions; longer is malformed (h11 answers it)
_HEX = re.compile(rb"[0-9A-Fa-f]+")


class BodyTooLarge(ValueError):
    """The chunk sizes declared so far add up to more than the body limit."""

    def __init__(self, declared: int, limit: int) -> None:
        super().__init__(f"chunked body declares {declared} bytes (limit {limit} bytes)")
        self.declared, self.limit = declared, limit


class _State(Enum):
    SIZE = auto()  # reading a chunk's size line
    DATA = auto()  # inside a chunk's data
    DATA_END = auto()  # the CRLF after a chunk's data
    TRAILERS = auto()  # after the last chunk: trailer lines up to an empty one
    DONE = auto()  # the body ended (or its framing is malformed: h11 says so)


@dataclass(slots=True)
class ChunkSizes:
    limit: int
    declared: int = 0
    state: _State = _State.SIZE
    _line: bytearray | None = None
    _left: int = 0

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view and self.state is not _State.DONE:
            view = view[self._step(view) :]

    def _step(self, view: memoryview) -> int:
        """Consume the start of ``view``; return how many bytes were used."""
        if self.state is _State.DATA:
            n = min(self._left, len(view))
            self._left -= n
            if not self._left:
                self.state, self._left = _State.DATA_END, 2
            return n
        if self.state is _State.DATA_END:
            n = min(self._left, len(view))
            self._left -= n
            if not self._left:
                self.state = _State.SIZE
            return n
        line, used = self._line_from(view)
        if line is not None:
            self._line_done(line)
        return used

    def _line_from(self, view: memoryview) -> tuple[bytes | None, int]:
        """A whole line (without CRLF) once its end has arrived, and the bytes used."""
        if self._line is None:
            self._line = bytearray()
        end = bytes(view[: MAX_SIZE_LINE + 2]).find(b"\n")
        if end < 0:
            self._line += view
            if len(self._line) > MAX_SIZE_LINE:
                self.state = _State.DONE
            return None, len(view)
        self._line += view[:end]
        line, self._line = bytes(self._line).rstrip(b"\r"), None
        return line, end + 1

    def _line_done(self, line: bytes) -> None:
        if self.state is _State.TRAILERS:
            if not line:
                self.state = _State.DONE
            return
        size_text = line.split(b";", 1)[0].strip(b" \t")
        if not _HEX.fullmatch(size_text):
            self.state = _State.DONE  # malformed: h11 refuses it
            return
        size = int(size_text, 16)
        self.declared += size
        if self.declared > self.limit:
            raise BodyTooLarge(self.declared, self.limit)
        self.state, self._left = (_State.TRAILERS, 0) if size == 0 else (_State.DATA, size)
