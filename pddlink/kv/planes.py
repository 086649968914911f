"""Byte planes of 16-bit floats: the lossless transform in front of the KV codec's entropy coder.

A bf16 value is ``sign | exponent(8) | mantissa(7)``. The exponent of KV values is concentrated on a
few values (about 2.5 bits of entropy) while sign and mantissa are close to random. Rotating each
16-bit word left by one bit moves the sign next to the mantissa, so the high byte becomes exactly
the exponent (compressible) and the low byte ``mantissa | sign`` (incompressible, sent as it is).
fp16 (``sign | exponent(5) | mantissa(10)``) gets the same rotation: its high byte then holds the
exponent and the top three mantissa bits, which compresses less; the codec policy decides from a
measured sample whether that still pays.

``split`` and ``merge`` are exact inverses for every bit pattern (NaN payloads, infinities,
denormals, negative zero). Both are whole-array numpy operations: no Python loop per value, and
numpy releases the GIL, so several threads can split chunks at once. Pure: no I/O.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from pddlink.errors import InvalidInput

U8 = npt.NDArray[np.uint8]
U16 = npt.NDArray[np.uint16]


def _words(data: memoryview | bytes | bytearray) -> U16:
    buf = memoryview(data).cast("B")
    if len(buf) % 2:
        raise InvalidInput(f"a 16-bit chunk must have an even length, got {len(buf)} bytes")
    return np.frombuffer(buf, dtype="<u2")


def split(data: memoryview | bytes | bytearray) -> tuple[U8, U8]:
    """Split little-endian 16-bit words into (exponent plane, mantissa-and-sign plane)."""
    words = _words(data)
    rotated = (words << np.uint16(1)) | (words >> np.uint16(15))
    high = (rotated >> np.uint16(8)).astype(np.uint8)
    low = rotated.astype(np.uint8)
    return high, low


def merge(high: U8 | bytes, low: U8 | bytes | memoryview) -> U16:
    """Inverse of ``split``: the original little-endian 16-bit words."""
    hi = np.frombuffer(high, dtype=np.uint8) if not isinstance(high, np.ndarray) else high
    lo = np.frombuffer(low, dtype=np.uint8) if not isinstance(low, np.ndarray) else low
    if hi.shape != lo.shape:
        raise InvalidInput(f"planes differ in length: {hi.size} and {lo.size} bytes")
    rotated = (hi.astype(np.uint16) << np.uint16(8)) | lo
    words: U16 = ((rotated >> np.uint16(1)) | (rotated << np.uint16(15))).astype("<u2", copy=False)
    return words
