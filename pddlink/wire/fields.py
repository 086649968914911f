"""Field codecs: how one message field is validated, written into and read from a frame body.

A message declares its body as a table of ``(field name, codec)`` pairs; the frame codec walks that
table. Each codec does three things with one meaning: ``check`` validates (and normalises, e.g. a
list into a tuple) a value given to a message constructor, raising ``InvalidInput``; ``write``
appends the value's bytes; ``read`` takes them back from a ``BodyReader`` and raises only
``MalformedMessage`` on bad bytes. Encodings are little-endian; integers are LEB128 varints
(zigzag for signed ones); 128-bit block hashes are 16 raw bytes.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from enum import Enum, IntEnum
from typing import Any, ClassVar, Generic, Literal, Protocol, TypeVar, cast

from pddlink.errors import InvalidInput
from pddlink.kv.hash_bytes import HASH_BYTE_ORDER
from pddlink.wire.errors import MalformedMessage

T = TypeVar("T")
E = TypeVar("E", bound=IntEnum)
M = TypeVar("M", bound=Enum)
S = TypeVar("S", bound="WireStruct")

_F64 = struct.Struct("<d")
_MAX_VARINT_BYTES = 10
U64_MAX = 2**64 - 1
U128_MAX = 2**128 - 1


class BodyReader:
    """A cursor over one frame body. Reads past the end raise ``MalformedMessage``."""

    __slots__ = ("_end", "_mv", "pos")

    def __init__(self, body: memoryview) -> None:
        self._mv = body
        self._end = len(body)
        self.pos = 0

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if n < 0 or end > self._end:
            raise MalformedMessage(f"body truncated: need {n} bytes at offset {self.pos}, have {self._end}")
        view = self._mv[self.pos : end]
        self.pos = end
        return view

    def uvarint(self) -> int:
        mv, pos = self._mv, self.pos
        if pos < self._end and mv[pos] < 0x80:  # the common one-byte case
            self.pos = pos + 1
            return mv[pos]
        return self._long_uvarint()

    def _long_uvarint(self) -> int:
        mv, pos, end = self._mv, self.pos, self._end
        result = shift = 0
        for i in range(_MAX_VARINT_BYTES):
            if pos + i >= end:
                raise MalformedMessage(f"body truncated inside a varint at offset {pos}")
            b = mv[pos + i]
            result |= (b & 0x7F) << shift
            if b < 0x80:
                if i and b == 0:
                    raise MalformedMessage(f"non-canonical varint at offset {pos}")
                self.pos = pos + i + 1
                if result > U64_MAX:
                    raise MalformedMessage(f"varint above 2**64 at offset {pos}")
                return result
            shift += 7
        raise MalformedMessage(f"varint longer than {_MAX_VARINT_BYTES} bytes at offset {pos}")

    def uvarints(self, count: int) -> list[int]:
        """``count`` varints in a row (token ids, chunk indices)."""
        read = self.uvarint
        return [read() for _ in range(count)]

    def at_end(self) -> bool:
        return self.pos == self._end


def write_uvarint(out: bytearray, value: int) -> None:
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)


def _need_int(name: str, value: object, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise InvalidInput(f"{name} must be in [{lo}, {hi}], got {value}")
    return int(value)


class FieldCodec(Protocol[T]):
    def check(self, name: str, value: Any) -> T: ...
    def write(self, out: bytearray, value: T) -> None: ...
    def read(self, r: BodyReader) -> T: ...


class UVarint:
    """Unsigned integer, at most ``bits`` wide."""

    def __init__(self, bits: int = 64) -> None:
        self.max = 2**bits - 1

    def check(self, name: str, value: Any) -> int:
        return _need_int(name, value, 0, self.max)

    def write(self, out: bytearray, value: int) -> None:
        write_uvarint(out, value)

    def read(self, r: BodyReader) -> int:
        v = r.uvarint()
        if v > self.max:
            raise MalformedMessage(f"value {v} above {self.max}")
        return v


class SVarint:
    """Signed 64-bit integer, zigzag-encoded."""

    def check(self, name: str, value: Any) -> int:
        return _need_int(name, value, -(2**63), 2**63 - 1)

    def write(self, out: bytearray, value: int) -> None:
        write_uvarint(out, (value << 1) ^ (value >> 63))

    def read(self, r: BodyReader) -> int:
        v = r.uvarint()
        return (v >> 1) ^ -(v & 1)


class Bool:
    def check(self, name: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise InvalidInput(f"{name} must be a bool, got {type(value).__name__}")
        return value

    def write(self, out: bytearray, value: bool) -> None:
        out.append(1 if value else 0)

    def read(self, r: BodyReader) -> bool:
        b = r.take(1)[0]
        if b > 1:
            raise MalformedMessage(f"bool byte {b} is neither 0 nor 1")
        return b == 1


class F64:
    """A finite float (IEEE double)."""

    def check(self, name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise InvalidInput(f"{name} must be a finite float, got {value!r}")
        return float(value)

    def write(self, out: bytearray, value: float) -> None:
        out += _F64.pack(value)

    def read(self, r: BodyReader) -> float:
        (v,) = _F64.unpack(r.take(8))
        if not math.isfinite(v):
            raise MalformedMessage("non-finite float")
        return float(v)


class Str:
    """UTF-8 text of at most ``max_bytes`` bytes."""

    def __init__(self, max_bytes: int = 1024) -> None:
        self.max_bytes = max_bytes

    def check(self, name: str, value: Any) -> str:
        if not isinstance(value, str):
            raise InvalidInput(f"{name} must be a str, got {type(value).__name__}")
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise InvalidInput(f"{name} is not valid unicode text") from exc
        if size > self.max_bytes:
            raise InvalidInput(f"{name} is longer than {self.max_bytes} bytes")
        return value

    def write(self, out: bytearray, value: str) -> None:
        data = value.encode("utf-8")
        write_uvarint(out, len(data))
        out += data

    def read(self, r: BodyReader) -> str:
        n = r.uvarint()
        if n > self.max_bytes:
            raise MalformedMessage(f"text of {n} bytes above limit {self.max_bytes}")
        try:
            return str(r.take(n), "utf-8")
        except UnicodeDecodeError as exc:
            raise MalformedMessage("text is not valid UTF-8") from exc


class FixedBytes:
    """Exactly ``size`` raw bytes (an RDMA GID): no length prefix."""

    def __init__(self, size: int) -> None:
        self.size = size

    def check(self, name: str, value: Any) -> bytes:
        if not isinstance(value, bytes | bytearray | memoryview):
            raise InvalidInput(f"{name} must be bytes, got {type(value).__name__}")
        data = bytes(value)
        if len(data) != self.size:
            raise InvalidInput(f"{name} must be {self.size} bytes, got {len(data)}")
        return value if isinstance(value, bytes) else data

    def write(self, out: bytearray, value: bytes) -> None:
        out += value

    def read(self, r: BodyReader) -> bytes:
        return bytes(r.take(self.size))


class U128:
    """A 128-bit unsigned integer (a digest), 16 bytes little-endian."""

    ORDER: ClassVar[Literal["little", "big"]] = "little"

    def check(self, name: str, value: Any) -> int:
        return _need_int(name, value, 0, U128_MAX)

    def write(self, out: bytearray, value: int) -> None:
        out += value.to_bytes(16, self.ORDER)

    def read(self, r: BodyReader) -> int:
        return int.from_bytes(r.take(16), self.ORDER)


class BlockHash(U128):
    """A block hash: 16 bytes in the one block-hash byte order (``pddlink.kv.hash_bytes``)."""

    ORDER = HASH_BYTE_ORDER


class U128List:
    """A list of 128-bit values: a varint count, then 16 bytes each (little-endian)."""

    ORDER: ClassVar[Literal["little", "big"]] = "little"

    def __init__(self, max_items: int) -> None:
        self.max_items = max_items

    def check(self, name: str, value: Any) -> tuple[int, ...]:
        items = _as_tuple(name, value, self.max_items)
        for v in items:
            _need_int(name, v, 0, U128_MAX)
        return items

    def write(self, out: bytearray, value: tuple[int, ...]) -> None:
        write_uvarint(out, len(value))
        out += b"".join(v.to_bytes(16, self.ORDER) for v in value)

    def read(self, r: BodyReader) -> tuple[int, ...]:
        n = r.uvarint()
        if n > self.max_items:
            raise MalformedMessage(f"{n} hashes above limit {self.max_items}")
        raw = r.take(16 * n)
        return tuple(int.from_bytes(raw[i : i + 16], self.ORDER) for i in range(0, 16 * n, 16))


class BlockHashList(U128List):
    """A list of block hashes, each in the one block-hash byte order (``pddlink.kv.hash_bytes``)."""

    ORDER = HASH_BYTE_ORDER


class ListOf(Generic[T]):
    """A varint count followed by that many items of one codec."""

    def __init__(self, item: FieldCodec[T], max_items: int) -> None:
        self.item = item
        self.max_items = max_items

    def check(self, name: str, value: Any) -> tuple[T, ...]:
        items = _as_tuple(name, value, self.max_items)
        item = self.item
        if isinstance(item, UVarint) and all(type(v) is int and 0 <= v <= item.max for v in items):
            return items  # the common case, checked in one pass
        return tuple(item.check(f"{name}[{i}]", v) for i, v in enumerate(items))

    def write(self, out: bytearray, value: tuple[T, ...]) -> None:
        write_uvarint(out, len(value))
        for v in value:
            self.item.write(out, v)

    def read(self, r: BodyReader) -> tuple[T, ...]:
        n = r.uvarint()
        if n > self.max_items:
            raise MalformedMessage(f"{n} items above limit {self.max_items}")
        item = self.item
        if isinstance(item, UVarint):
            values = r.uvarints(n)
            if values and max(values) > item.max:
                raise MalformedMessage(f"value {max(values)} above {item.max}")
            return tuple(values)
        return tuple(item.read(r) for _ in range(n))


class CodedEnum(Generic[M]):
    """An enum of another layer as a varint of its wire code (``codes``: member -> code, never
    renumbered); an unknown code is an error."""

    def __init__(self, codes: Mapping[M, int]) -> None:
        self.codes = dict(codes)
        self.members = {code: member for member, code in self.codes.items()}
        self.name = type(next(iter(self.codes))).__name__

    def check(self, name: str, value: Any) -> M:
        if value not in self.codes:
            raise InvalidInput(f"{name}: {value!r} is not a {self.name}")
        return cast(M, value)

    def write(self, out: bytearray, value: M) -> None:
        write_uvarint(out, self.codes[value])

    def read(self, r: BodyReader) -> M:
        v = r.uvarint()
        try:
            return self.members[v]
        except KeyError:
            raise MalformedMessage(f"{v} is not a {self.name}") from None


class EnumOf(Generic[E]):
    """An IntEnum as a varint. ``fallback`` maps values a newer peer may send; else they are errors."""

    def __init__(self, enum: type[E], fallback: E | None = None) -> None:
        self.enum = enum
        self.fallback = fallback

    def check(self, name: str, value: Any) -> E:
        try:
            return self.enum(value)
        except ValueError as exc:
            raise InvalidInput(f"{name}: {value!r} is not a {self.enum.__name__}") from exc

    def write(self, out: bytearray, value: E) -> None:
        write_uvarint(out, int(value))

    def read(self, r: BodyReader) -> E:
        v = r.uvarint()
        try:
            return self.enum(v)
        except ValueError:
            if self.fallback is not None:
                return self.fallback
            raise MalformedMessage(f"{v} is not a {self.enum.__name__}") from None


class Optional(Generic[T]):
    """A presence byte, then the value when present."""

    def __init__(self, inner: FieldCodec[T]) -> None:
        self.inner = inner

    def check(self, name: str, value: Any) -> T | None:
        return None if value is None else self.inner.check(name, value)

    def write(self, out: bytearray, value: T | None) -> None:
        out.append(0 if value is None else 1)
        if value is not None:
            self.inner.write(out, value)

    def read(self, r: BodyReader) -> T | None:
        flag = r.take(1)[0]
        if flag > 1:
            raise MalformedMessage(f"presence byte {flag} is neither 0 nor 1")
        return self.inner.read(r) if flag else None


class WireStruct:
    """Base of nested value types (a layout, an index event) encoded by their field table."""

    __slots__ = ()
    WIRE_FIELDS: ClassVar[tuple[tuple[str, FieldCodec[Any]], ...]] = ()

    def __post_init__(self) -> None:
        for name, codec in self.WIRE_FIELDS:
            value = getattr(self, name)
            normalised = codec.check(f"{type(self).__name__}.{name}", value)
            if normalised is not value:
                object.__setattr__(self, name, normalised)
        self._check_invariants()

    def _check_invariants(self) -> None:
        """Rules across fields (each field's own range is its codec's); raise ``InvalidInput``."""

    @classmethod
    def from_wire(cls: type[S], values: dict[str, Any]) -> S:
        """Build from values a codec has just read (each already in range): only the cross-field
        rules run again. Raises ``MalformedMessage``."""
        obj = object.__new__(cls)
        for name, value in values.items():
            object.__setattr__(obj, name, value)
        try:
            obj._check_invariants()
        except InvalidInput as exc:
            raise MalformedMessage(f"invalid {cls.__name__}: {exc.message}") from exc
        return obj


class StructOf(Generic[S]):
    """A nested ``WireStruct`` dataclass, written field by field."""

    def __init__(self, cls: type[S]) -> None:
        self.cls = cls

    def check(self, name: str, value: Any) -> S:
        if not isinstance(value, self.cls):
            raise InvalidInput(f"{name} must be a {self.cls.__name__}, got {type(value).__name__}")
        return value

    def write(self, out: bytearray, value: S) -> None:
        for name, codec in self.cls.WIRE_FIELDS:
            codec.write(out, getattr(value, name))

    def read(self, r: BodyReader) -> S:
        return self.cls.from_wire({name: codec.read(r) for name, codec in self.cls.WIRE_FIELDS})


class Payload:
    """A bytes-like field sent as the frame payload: checked here, never copied by the codec."""

    def check(self, name: str, value: Any) -> memoryview | bytes:
        if isinstance(value, bytes):
            return value
        if isinstance(value, bytearray | memoryview):
            view = memoryview(value)
            if not view.contiguous:
                raise InvalidInput(f"{name} must be a contiguous buffer")
            return view if view.format == "B" and view.ndim == 1 else view.cast("B")
        raise InvalidInput(f"{name} must be bytes-like, got {type(value).__name__}")

    def write(self, out: bytearray, value: memoryview | bytes) -> None:
        raise TypeError("payload fields travel outside the body")

    def read(self, r: BodyReader) -> memoryview | bytes:
        raise TypeError("payload fields travel outside the body")


def _as_tuple(name: str, value: Any, max_items: int) -> tuple[Any, ...]:
    if isinstance(value, str | bytes | bytearray | memoryview) or not isinstance(value, Sequence):
        raise InvalidInput(f"{name} must be a sequence, got {type(value).__name__}")
    if len(value) > max_items:
        raise InvalidInput(f"{name} has {len(value)} items, limit {max_items}")
    return value if isinstance(value, tuple) else tuple(value)
