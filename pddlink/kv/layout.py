"""The shape of one model's KV cache (``KVLayout``): the one layout type of every layer (engines,
transfers, the wire's ``KVLayoutSpec`` is its encoding). Two sides exchange KV only when their
layouts are equal. Block ``i`` holds tokens ``[i*B, (i+1)*B)``; its bytes are
``[num_layers, 2 (k, v), num_kv_heads, block_size, head_dim]`` in the layout's dtype.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Final

from pddlink.errors import InvalidInput
from pddlink.kv.dtypes import KVDtype

DTYPE_BYTES: Final[dict[str, int]] = {d.name: d.itemsize for d in KVDtype}
"""Item size of each dtype name (derived from ``KVDtype``, the one dtype table)."""


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one model's KV cache. Two sides exchange KV only when their layouts are equal."""

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise InvalidInput(f"layout.dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise InvalidInput(f"layout.{name} must be positive")

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        return cls(**d)
