"""The request lifecycle over a paged KV pool, shared by every adapter that keeps its own pool.

``PagedEngine`` implements the whole ``EngineAdapter`` contract (validation, block allocation,
prefix reuse, the pending-token rule, sampling, export/import) and leaves one method to the
subclass: ``_run(seqs, new_tokens)``, which computes the KV of the new tokens of each sequence at
positions ``kv_tokens ..`` (their blocks are already allocated), writes it into ``self.pool`` and
returns the last new token's logits per sequence.

``prefill_slowdown`` k >= 1 makes every pass that computes more than one token of a sequence (a
prefill, an extend: not a decode step) take k times as long, holding the engine as the pass itself
does: a chip that prefills k times slower than the one the model was measured on (a decode-leaning
MainDecode's, emulated on a machine whose CPUs are all alike; the demo's wan-overload scenario).

Every public method validates everything first, then reserves blocks (``PoolExhausted`` before
any change), then mutates; if the forward pass itself fails, the allocation is undone.
"""

from __future__ import annotations

import math
import time
from abc import abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engines_adapter.base import (
    EngineAdapter,
    InvalidBlocks,
    InvalidRequest,
    InvalidTokens,
    KVBlocks,
    KVLayout,
    LayoutMismatch,
    PoolExhausted,
    SamplingParams,
    StepOutput,
    UnknownRequest,
)
from engines_adapter.torch_ref.kv_pool import KVPool
from engines_adapter.torch_ref.sampling import sample_tokens
from pddlink.errors import ConfigError
from pddlink.kv.hashing import BlockHasher


@dataclass(slots=True)
class SequenceState:
    """One live request. ``tokens[kv_tokens:]`` is empty or the single pending token."""

    request_id: str
    tokens: list[int]
    prompt_len: int
    sampling: SamplingParams
    blocks: list[int]
    kv_tokens: int
    block_hashes: list[int]  # chained hashes of the full KV blocks hashed so far
    own_cached: set[int] = field(default_factory=set)  # blocks this request put in the prefix cache
    finished: bool = False

    @property
    def pending(self) -> bool:
        return self.kv_tokens < len(self.tokens)


class PagedEngine(EngineAdapter):
    """``EngineAdapter`` over a ``KVPool``; subclasses supply the forward pass (``_run``)."""

    def __init__(
        self,
        *,
        layout: KVLayout,
        vocab_size: int,
        max_positions: int,
        num_blocks: int,
        device: torch.device,
        chunk_tokens: int = 2048,
        prefill_slowdown: float = 1.0,
    ) -> None:
        if chunk_tokens <= 0:
            raise ConfigError(f"chunk_tokens must be positive, got {chunk_tokens}")
        if not 1.0 <= prefill_slowdown <= 100.0:
            raise ConfigError(f"prefill_slowdown must be in [1, 100], got {prefill_slowdown}")
        self.prefill_slowdown = prefill_slowdown
        self.chunk_tokens = chunk_tokens  # prefill/extend passes longer than this run in pieces
        self._layout = layout
        self._vocab_size = vocab_size
        self.max_positions = max_positions
        self.device = device
        self.pool = KVPool(layout, num_blocks, device)
        self.hasher = BlockHasher(layout.model_id, layout.block_size)
        self._seqs: dict[str, SequenceState] = {}
        self._released: deque[str] = deque(maxlen=4096)  # for clearer errors only

    @abstractmethod
    def _run(self, seqs: Sequence[SequenceState], new_tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """Compute and store KV of ``new_tokens[i]`` at positions ``seqs[i].kv_tokens ..``; last logits."""

    def _forget(self, seq: SequenceState) -> None:
        """Hook: ``seq`` was released (drop anything cached for it). Nothing by default."""

    # -- contract: properties ---------------------------------------------------------------
    @property
    def layout(self) -> KVLayout:
        return self._layout

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    # -- contract: compute ------------------------------------------------------------------
    def prefill(self, request_id: str, prompt: Sequence[int], sampling: SamplingParams) -> StepOutput:
        self._check_new(request_id)
        ids = self._check_tokens(prompt, "prompt", extra_positions=1)
        bs = self._layout.block_size
        hashes = self.hasher.hash_blocks(ids)
        # Always compute at least the last prompt token: its logits give the first token.
        reuse = self.pool.allocator.lookup_chain(hashes)[: (len(ids) - 1) // bs]
        need = math.ceil(len(ids) / bs) - len(reuse)
        self._reserve(need, pinned=reuse)
        self.pool.allocator.incref(reuse)
        blocks = reuse + self.pool.allocator.allocate(need)
        seq = SequenceState(
            request_id, ids, len(ids), sampling, blocks, len(reuse) * bs, hashes[: len(reuse)]
        )
        self._seqs[request_id] = seq
        try:
            logits = self._compute([seq], [ids[seq.kv_tokens :]], hashes)
        except BaseException:
            del self._seqs[request_id]
            self.pool.allocator.decref(blocks, uncache=frozenset(seq.own_cached))
            raise
        return self._sample([seq], logits)[0]

    def decode(self, request_ids: Sequence[str]) -> list[StepOutput]:
        if len(set(request_ids)) != len(request_ids):
            raise InvalidRequest("a request id appears twice in one decode batch")
        seqs = [self._live(r) for r in request_ids]
        for s in seqs:
            self._check_continuable(s)
            if not s.pending:
                raise InvalidRequest(f"request {s.request_id!r} has no pending token; call extend first")
            if len(s.tokens) >= self.max_positions:
                raise InvalidTokens(f"request {s.request_id!r} reached max_positions {self.max_positions}")
        if not seqs:
            return []
        logits = self._grow_and_compute(seqs, [[s.tokens[-1]] for s in seqs])
        return self._sample(seqs, logits)

    def extend(self, request_id: str, token_ids: Sequence[int]) -> StepOutput:
        seq = self._live(request_id)
        self._check_continuable(seq)
        ids = self._check_tokens(token_ids, "extend token_ids", extra_positions=0)
        if seq.pending and ids[0] != seq.tokens[-1]:
            raise InvalidTokens(
                f"extend must start with the pending token {seq.tokens[-1]} of {request_id!r}, got {ids[0]}"
            )
        appended = ids[1:] if seq.pending else ids
        new_len = len(seq.tokens) + len(appended)
        if new_len + 1 > self.max_positions:
            raise InvalidTokens(f"extend would pass max_positions {self.max_positions}")
        if new_len + 1 - seq.prompt_len > seq.sampling.max_tokens:
            raise InvalidTokens(f"extend would pass max_tokens {seq.sampling.max_tokens} of {request_id!r}")
        if set(appended) & set(seq.sampling.stop_token_ids):
            raise InvalidTokens("extend token_ids contain a stop token: that sequence had already finished")
        before = len(seq.tokens)
        seq.tokens.extend(appended)
        try:
            logits = self._grow_and_compute([seq], [ids])
        except BaseException:
            del seq.tokens[before:]
            raise
        return self._sample([seq], logits)[0]

    # -- contract: KV in and out ------------------------------------------------------------
    def import_kv(
        self,
        request_id: str,
        prompt: Sequence[int],
        blocks: Sequence[KVBlocks],
        sampling: SamplingParams,
        *,
        reuse_prefix_tokens: int = 0,
    ) -> None:
        self._check_new(request_id)
        ids = self._check_tokens(prompt, "prompt", extra_positions=1)
        bs = self._layout.block_size
        r = reuse_prefix_tokens
        if r < 0 or r % bs or r > len(ids):
            raise InvalidBlocks(f"reuse_prefix_tokens {r} must be a multiple of {bs} within the prompt")
        hashes = self.hasher.hash_blocks(ids)
        reuse = self.pool.allocator.lookup_chain(hashes[: r // bs])
        if len(reuse) * bs < r:
            raise InvalidBlocks(f"only {len(reuse) * bs} prefix tokens are cached here, not {r}")
        self._check_import_blocks(blocks, r, len(ids))
        need = math.ceil(len(ids) / bs) - len(reuse)
        self._reserve(need, pinned=reuse)
        self.pool.allocator.incref(reuse)
        fresh = self.pool.allocator.allocate(need)
        try:
            at = 0
            for kb in blocks:
                self.pool.write_blocks(fresh[at : at + kb.num_blocks], kb.data)
                at += kb.num_blocks
        except BaseException:
            self.pool.allocator.decref([*reuse, *fresh])
            raise
        seq = SequenceState(
            request_id, ids, len(ids), sampling, reuse + fresh, len(ids), hashes[: len(reuse)]
        )
        self._register_full_blocks(seq, hashes)
        self._seqs[request_id] = seq

    def export_kv(self, request_id: str, first_block: int = 0, num_blocks: int | None = None) -> KVBlocks:
        seq = self._live(request_id)
        bs = self._layout.block_size
        kv_blocks = math.ceil(seq.kv_tokens / bs)
        n = kv_blocks - first_block if num_blocks is None else num_blocks
        if first_block < 0 or n < 0 or first_block + n > kv_blocks:
            raise InvalidBlocks(
                f"blocks [{first_block}, {first_block + n}) outside {request_id!r}'s {kv_blocks} KV blocks"
            )
        num_tokens = max(0, min(seq.kv_tokens, (first_block + n) * bs) - first_block * bs)
        data = self.pool.read_blocks(seq.blocks[first_block : first_block + n], num_tokens)
        return KVBlocks(self._layout, first_block, n, num_tokens, data)

    def release(self, request_id: str, *, cache_prefix: bool = True) -> None:
        seq = self._live(request_id)
        del self._seqs[request_id]
        self._released.append(request_id)
        self._forget(seq)
        uncache = frozenset() if cache_prefix else frozenset(seq.own_cached)
        # Tail first: under pressure the LRU then evicts a chain's deepest blocks before its root.
        self.pool.allocator.decref(reversed(seq.blocks), uncache=uncache)

    def cached_prefix_tokens(self, prompt: Sequence[int]) -> int:
        ids = self._check_tokens(prompt, "prompt", extra_positions=0, allow_empty=True)
        return len(self.pool.allocator.lookup_chain(self.hasher.hash_blocks(ids))) * self._layout.block_size

    def evict_prefix_blocks(self, block_hashes: Sequence[int]) -> int:
        return self.pool.allocator.evict(block_hashes)

    def tokens(self, request_id: str) -> list[int]:
        return list(self._live(request_id).tokens)

    # -- beyond the contract ----------------------------------------------------------------
    def drain_evicted_hashes(self) -> list[int]:
        """Block hashes the pool evicted on its own (LRU, under pressure) since the last call."""
        return self.pool.allocator.drain_evicted()

    def is_finished(self, request_id: str) -> bool:
        return self._live(request_id).finished

    @property
    def live_requests(self) -> list[str]:
        return list(self._seqs)

    @property
    def free_blocks(self) -> int:
        """Blocks a new request could get (free plus evictable cached blocks)."""
        return self.pool.allocator.available()

    def state_digest(self) -> tuple[object, ...]:
        """A comparable picture of all bookkeeping: tests assert that bad input leaves it unchanged."""
        seqs = tuple(
            (s.request_id, tuple(s.tokens), s.kv_tokens, tuple(s.blocks), tuple(s.block_hashes), s.finished)
            for s in self._seqs.values()
        )
        return seqs, self.pool.allocator.snapshot()

    # -- internals --------------------------------------------------------------------------
    def _grow_and_compute(
        self, seqs: Sequence[SequenceState], new_tokens: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        bs = self._layout.block_size
        needs = [
            math.ceil((s.kv_tokens + len(t)) / bs) - len(s.blocks)
            for s, t in zip(seqs, new_tokens, strict=True)
        ]
        self._reserve(sum(needs))
        grown = [self.pool.allocator.allocate(n) if n else [] for n in needs]
        for s, g in zip(seqs, grown, strict=True):
            s.blocks.extend(g)
        try:
            return self._compute(seqs, new_tokens)
        except BaseException:
            for s, g in zip(seqs, grown, strict=True):
                if g:
                    del s.blocks[-len(g) :]
                    self.pool.allocator.decref(g)
            raise

    def _compute(
        self,
        seqs: Sequence[SequenceState],
        new_tokens: Sequence[Sequence[int]],
        prompt_hashes: Sequence[int] = (),
    ) -> torch.Tensor:
        starts = [s.kv_tokens for s in seqs]
        try:
            logits = self._run_in_chunks(seqs, new_tokens)
        except BaseException:
            for s, start in zip(seqs, starts, strict=True):
                s.kv_tokens = start
            raise
        for s, t, start in zip(seqs, new_tokens, starts, strict=True):
            s.kv_tokens = start + len(t)
            if s.kv_tokens // self._layout.block_size > len(s.block_hashes):
                self._register_full_blocks(s, prompt_hashes)
        return logits

    def _run_in_chunks(
        self, seqs: Sequence[SequenceState], new_tokens: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        """``_run``, with a long single-sequence pass split into ``chunk_tokens`` pieces (bounded memory),
        a prefill-like pass stretched by ``prefill_slowdown``."""
        started = time.perf_counter()
        if len(seqs) != 1 or len(new_tokens[0]) <= self.chunk_tokens:
            logits = self._run(seqs, new_tokens)
        else:
            seq, todo = seqs[0], new_tokens[0]
            for i in range(0, len(todo), self.chunk_tokens):
                piece = todo[i : i + self.chunk_tokens]
                logits = self._run([seq], [piece])
                seq.kv_tokens += len(piece)
        if self.prefill_slowdown > 1.0 and any(len(t) > 1 for t in new_tokens):
            time.sleep((self.prefill_slowdown - 1.0) * (time.perf_counter() - started))
        return logits

    def _register_full_blocks(self, seq: SequenceState, known: Sequence[int] = ()) -> None:
        """Hash newly full KV blocks (chained) and offer them to the prefix cache."""
        bs = self._layout.block_size
        done, full = len(seq.block_hashes), seq.kv_tokens // bs
        if full <= done:
            return
        if len(known) >= full:
            fresh = list(known[done:full])
        else:
            parent = seq.block_hashes[-1] if done else None
            fresh = self.hasher.hash_blocks(seq.tokens[done * bs : full * bs], parent=parent)
        for i, h in enumerate(fresh, start=done):
            if self.pool.allocator.register(seq.blocks[i], h):
                seq.own_cached.add(seq.blocks[i])
        seq.block_hashes.extend(fresh)

    def _sample(self, seqs: Sequence[SequenceState], logits: torch.Tensor) -> list[StepOutput]:
        positions = [len(s.tokens) for s in seqs]
        drawn = sample_tokens(logits, [s.sampling for s in seqs], positions)
        out = []
        for s, tok, pos in zip(seqs, drawn, positions, strict=True):
            s.tokens.append(tok)
            sp = s.sampling
            s.finished = len(s.tokens) - s.prompt_len >= sp.max_tokens or tok in sp.stop_token_ids
            out.append(StepOutput(s.request_id, tok, pos, s.finished))
        return out

    def _reserve(self, n: int, pinned: Sequence[int] = ()) -> None:
        have = self.pool.allocator.available(pinned)
        if n > have:
            raise PoolExhausted(f"KV pool has {have} blocks to give, {n} needed")

    def _live(self, request_id: str) -> SequenceState:
        seq = self._seqs.get(request_id)
        if seq is None:
            state = "was released" if request_id in self._released else "is unknown"
            raise UnknownRequest(f"request {request_id!r} {state}")
        return seq

    def _check_new(self, request_id: str) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest("request_id must be a non-empty string")
        if request_id in self._seqs:
            raise InvalidRequest(f"request {request_id!r} is already live")

    def _check_continuable(self, seq: SequenceState) -> None:
        if seq.finished:
            raise InvalidRequest(f"request {seq.request_id!r} has finished")

    def _check_tokens(
        self, token_ids: Sequence[int], what: str, *, extra_positions: int, allow_empty: bool = False
    ) -> list[int]:
        ids = [int(t) for t in token_ids]
        if not ids:
            if allow_empty:
                return ids
            raise InvalidTokens(f"{what} is empty")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self._vocab_size:
            bad = lo if lo < 0 else hi
            raise InvalidTokens(
                f"{what} holds token id {bad}, outside the vocabulary [0, {self._vocab_size})"
            )
        if len(ids) + extra_positions > self.max_positions:
            raise InvalidTokens(f"{what} of {len(ids)} tokens exceeds max_positions {self.max_positions}")
        return ids

    def _check_import_blocks(self, blocks: Sequence[KVBlocks], reuse: int, prompt_len: int) -> None:
        """Imported blocks must cover tokens ``[reuse, prompt_len)`` in order, with no gap or overlap."""
        covered = reuse
        for kb in blocks:
            if kb.layout != self._layout:
                raise LayoutMismatch(
                    f"imported KV layout {kb.layout} does not match this engine's {self._layout}"
                )
            if kb.first_block * self._layout.block_size != covered:
                raise InvalidBlocks(
                    f"imported blocks start at block {kb.first_block}; token {covered} comes next"
                )
            if kb.num_blocks and kb.num_tokens <= (kb.num_blocks - 1) * self._layout.block_size:
                raise InvalidBlocks("imported KV has trailing blocks without tokens")
            covered += kb.num_tokens
        if covered != prompt_len:
            raise InvalidBlocks(f"imported KV covers tokens up to {covered}, the prompt has {prompt_len}")
