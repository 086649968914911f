"""The engine contract: what pddlink needs from an inference engine, and when it asks for it.

One request's lifecycle on each role (P = prefill, RLD = RelayDecode, MD = MainDecode)::

    P    prefill(rid, prompt, sampling)          -> first token t0 (KV of the prompt is now held)
         export_kv(rid, first_block, n)          -> KV blocks handed to the sidecar for shipping
         release(rid)                            -> full prompt blocks stay in P's prefix cache

    RLD  import_kv(rid, prompt, blocks, sampling) <- whole prompt KV over the fast path
         extend(rid, [t0])                        -> t1 (one decode step of a single request)
         decode([rid, ...])                       -> t2, t3, ... (batched, one token per request)
         release(rid)                             after the handoff (one-shot) or when MD is level

    MD   cached_prefix_tokens(prompt)             -> how much of the prompt its pool already holds
         import_kv(rid, prompt, blocks, sampling, reuse_prefix_tokens=k)
                                                  <- only the missing suffix crosses the WAN
         extend(rid, [t0 .. tk-1])                -> tk: RLD's tokens recomputed in ONE forward pass
         decode([rid, ...])                       -> the rest
         release(rid)                             -> the finished sequence's full blocks are cached

Sequence state. A request holds ``tokens`` (prompt + generated) and ``kv_tokens``, the number of
leading tokens whose KV is computed. After ``prefill``/``extend``/``decode`` the newest sampled token
is *pending*: it is in ``tokens`` but its KV is computed by the next ``decode`` step. After
``import_kv`` nothing is pending (``kv_tokens == len(tokens)``), so the first call is ``extend``.

Sampling is reproducible across instances: the token at absolute position ``pos`` (its index in
``tokens``) is drawn with randomness that is a pure function of ``(sampling.seed, pos)``. An
instance that takes a request over therefore continues exactly as the first would have.

KV blocks. The pool is paged: block ``i`` of a request holds tokens ``[i*B, (i+1)*B)`` for the
layout's ``block_size`` B. ``export_kv`` returns ``KVBlocks`` whose ``data`` is one contiguous
little-endian buffer of shape ``[n_blocks, num_layers, 2 (k, v), num_kv_heads, block_size,
head_dim]`` in the layout's dtype; a partial last block is zero-padded and ``num_tokens`` says how
many tokens are real.

Errors. Every method validates before it changes anything: bad input raises an ``EngineError``
subclass and leaves the engine exactly as it was (unknown request, released request, token id out
of vocabulary, KV layout that does not match the model, block range out of bounds, pool full).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from pddlink.errors import ErrorCode, InvalidInput, LocalError, NotFound
from pddlink.kv import layout as _layout
from pddlink.sampling import SamplingParams as SamplingParams  # the core's; engines take it as is

# The KV layout and dtype table live in pddlink.kv (one of each); the engine contract names them.
KVLayout = _layout.KVLayout
DTYPE_BYTES = _layout.DTYPE_BYTES


class EngineError(LocalError):
    """Root of engine errors."""


class UnknownRequest(EngineError, NotFound):
    """The request id is unknown or already released."""


class InvalidTokens(EngineError, InvalidInput):
    """Token ids out of vocabulary, an empty prompt, or a sequence longer than the model allows."""


class LayoutMismatch(EngineError):
    """Imported KV was produced by a model with another layout."""

    code = ErrorCode.LAYOUT_MISMATCH


class InvalidBlocks(EngineError, InvalidInput):
    """A block range or block payload that does not fit the request."""


class InvalidRequest(EngineError, InvalidInput):
    """A request id used in the wrong state: already live (prefill/import), listed twice in one
    batch, finished (no more decoding), or without a pending token where ``decode`` needs one."""


class PoolExhausted(EngineError):
    """The paged KV pool has no free block left."""

    code = ErrorCode.CAPACITY


@dataclass(frozen=True, slots=True)
class KVBlocks:
    """A run of consecutive KV blocks of one request (see the module docstring for the byte layout)."""

    layout: KVLayout
    first_block: int
    num_blocks: int
    num_tokens: int  # real tokens covered, counted from token first_block * block_size
    data: bytes | bytearray | memoryview = field(repr=False)

    def __post_init__(self) -> None:
        expect = self.num_blocks * self.layout.bytes_per_block
        if len(memoryview(self.data).cast("B")) != expect:
            raise InvalidBlocks(
                f"KV payload is {len(self.data)} bytes, {self.num_blocks} blocks need {expect}"
            )
        if not 0 <= self.num_tokens <= self.num_blocks * self.layout.block_size:
            raise InvalidBlocks(f"num_tokens {self.num_tokens} does not fit {self.num_blocks} blocks")
        if self.first_block < 0:
            raise InvalidBlocks("first_block must be >= 0")


@dataclass(frozen=True, slots=True)
class StepOutput:
    """One sampled token of one request. ``position`` is its index in the request's token list."""

    request_id: str
    token_id: int
    position: int
    finished: bool  # max_tokens reached or a stop token drawn


class EngineAdapter(ABC):
    """The contract. Implementations: ``engines_adapter.torch_ref`` and ``engines_adapter.hf``.

    Not thread-safe: one caller drives an engine (the sidecar's engine loop).
    """

    @property
    @abstractmethod
    def layout(self) -> KVLayout: ...

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @abstractmethod
    def prefill(self, request_id: str, prompt: Sequence[int], sampling: SamplingParams) -> StepOutput:
        """Compute the prompt's KV, reusing cached prefix blocks, and sample the first token."""

    @abstractmethod
    def decode(self, request_ids: Sequence[str]) -> list[StepOutput]:
        """One batched step: compute KV of each request's pending token and sample the next."""

    @abstractmethod
    def extend(self, request_id: str, token_ids: Sequence[int]) -> StepOutput:
        """Recompute the KV of tokens generated elsewhere in ONE forward pass and sample the next.

        ``token_ids`` continue the sequence right after its last KV-computed token. If the request
        has a pending token, ``token_ids[0]`` must equal it (catch-up slices overlap by that one
        token); a different id raises ``InvalidTokens`` and changes nothing. The handoff's step."""

    @abstractmethod
    def import_kv(
        self,
        request_id: str,
        prompt: Sequence[int],
        blocks: Sequence[KVBlocks],
        sampling: SamplingParams,
        *,
        reuse_prefix_tokens: int = 0,
    ) -> None:
        """Create a request whose KV for ``prompt`` comes from ``blocks`` (covering tokens
        ``[reuse_prefix_tokens, len(prompt))``) plus this engine's own cached prefix for the first
        ``reuse_prefix_tokens`` tokens (a multiple of block_size)."""

    @abstractmethod
    def export_kv(self, request_id: str, first_block: int = 0, num_blocks: int | None = None) -> KVBlocks:
        """Copy out KV blocks of a live request (default: from ``first_block`` to its last KV token)."""

    @abstractmethod
    def release(self, request_id: str, *, cache_prefix: bool = True) -> None:
        """Forget a request; with ``cache_prefix`` its full blocks stay in the prefix cache."""

    @abstractmethod
    def cached_prefix_tokens(self, prompt: Sequence[int]) -> int:
        """Tokens of ``prompt``'s longest prefix held in the prefix cache (a multiple of block_size)."""

    @abstractmethod
    def evict_prefix_blocks(self, block_hashes: Sequence[int]) -> int:
        """Free cached blocks by chained block hash (the DRC decides what to evict); returns freed."""

    def drain_evicted_hashes(self) -> list[int]:
        """Hashes of cached blocks the pool dropped on its own (it ran short) since the last call.

        The owner tells the prefix index (``PrefixIndex.forget``), so the index never reports
        blocks the engine no longer holds. An engine whose pool never evicts by itself returns [].
        """
        return []

    @abstractmethod
    def tokens(self, request_id: str) -> list[int]:
        """The request's token list (prompt + generated, pending token included)."""
