"""Types of the optional C extension built from _native_hash.c (see pddlink/kv/hashing.py)."""

def chain_u32(tokens: list[int] | tuple[int, ...], block_size: int, parent: bytes, /) -> list[int] | None:
    """Chained XXH3-128 block hashes (scheme 1) of a list/tuple of uint32 ids, from a 16-byte parent
    digest; None when an item is not an int. Raises OverflowError for an int outside [0, 2**32)."""
