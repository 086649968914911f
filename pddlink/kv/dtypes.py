"""KV element types: the one dtype table (name, wire id, item size) of every layer.

Names are the dtype strings of ``KVLayout.dtype`` and of engine configuration; wire ids travel in KV
codec frames and are never renumbered.
"""

from __future__ import annotations

from enum import Enum

from pddlink.errors import InvalidInput


class KVDtype(Enum):
    """KV element types: wire id and item size. Names match ``KVLayout.dtype``."""

    bfloat16 = (1, 2)
    float16 = (2, 2)
    float32 = (3, 4)
    float64 = (4, 8)
    int8 = (5, 1)
    float8_e4m3fn = (6, 1)
    float8_e5m2 = (7, 1)
    uint8 = (8, 1)

    @property
    def wire_id(self) -> int:
        return self.value[0]

    @property
    def itemsize(self) -> int:
        return self.value[1]

    @property
    def plane_codable(self) -> bool:
        """Whether the byte-plane transform applies (16- and 32-bit floats)."""
        return self in (KVDtype.bfloat16, KVDtype.float16, KVDtype.float32)

    @classmethod
    def parse(cls, dtype: KVDtype | str) -> KVDtype:
        if isinstance(dtype, KVDtype):
            return dtype
        try:
            return cls[dtype]
        except KeyError:
            raise InvalidInput(f"unknown KV dtype {dtype!r}; known: {', '.join(cls.__members__)}") from None
