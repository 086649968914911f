"""The torch reference engine: ``PagedLlama`` driven by the shared paged request lifecycle.

Construction picks a preset (``tiny`` .. ``llama-1b``), a dtype (float32, bfloat16, float64), a
device (cpu, cuda) and a pool (``block_size`` tokens per block, ``num_blocks`` blocks), and takes
weights either from ``seed`` (deterministic) or from a Llama-format safetensors checkpoint
(``weights_path``: a file or a directory of shards; with ``preset=None`` the shapes come from the
checkpoint's ``config.json``, e.g. a downloaded Llama-3.2-1B directory).

Threads. torch uses every core by default. When several engines share a machine (the demo runs
three on two cores), call ``torch.set_num_threads(1)`` once at the process entry point (the
sidecar does; this class never changes global torch state): the tiny preset's steps are too small
to gain from intra-op threads, and oversubscribed threads spin and slow every engine down. An
engine alone on a machine may use more (``pddlink bench engine --threads 0``); extend and prefill
gain from threads, single decode steps of small models hardly do.

Speed. A decode step costs about a millisecond for ``tiny`` on one core: fused q/k/v and
gate/up weights, no Python loop over blocks or tokens, gathers into preallocated buffers, and a
decode workspace (``workspace_bytes``, see ``workspace``) that keeps a repeating batch's KV
contiguous instead of regathering it every step. Long prefills run in ``chunk_tokens`` pieces.

Exactness. float32 results depend slightly on batch composition (matmul blocking); use float64
when comparing token streams across instances (see DESIGN.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from engines_adapter.base import KVLayout, SamplingParams
from engines_adapter.torch_ref.batch import PagedBatch
from engines_adapter.torch_ref.kv_pool import TORCH_DTYPES
from engines_adapter.torch_ref.model import PagedLlama
from engines_adapter.torch_ref.paged_engine import PagedEngine, SequenceState
from engines_adapter.torch_ref.presets import ModelConfig, resolve_preset
from engines_adapter.torch_ref.weights import (
    StateDict,
    checkpoint_config,
    load_safetensors,
    random_state_dict,
)
from engines_adapter.torch_ref.workspace import DecodeWorkspace
from pddlink.errors import ConfigError, Unavailable


class TorchRefEngine(PagedEngine):
    """The reference ``EngineAdapter``: a Llama-style decoder over a paged KV pool."""

    def __init__(
        self,
        preset: str | ModelConfig | None = "tiny",
        *,
        dtype: str = "float32",
        device: str = "cpu",
        block_size: int = 16,
        num_blocks: int = 4096,
        seed: int = 0,
        weights_path: str | Path | None = None,
        state_dict: StateDict | None = None,
        model_id: str | None = None,
        chunk_tokens: int = 2048,
        workspace_bytes: int = 256 * 2**20,
        prefill_slowdown: float = 1.0,
        **model_overrides: Any,
    ) -> None:
        if preset is None:  # the checkpoint says what it is
            if weights_path is None:
                raise ConfigError("preset=None needs weights_path: a Llama checkpoint with its config.json")
            preset = checkpoint_config(weights_path)
        config = resolve_preset(preset, **model_overrides)
        if dtype not in TORCH_DTYPES:
            raise ConfigError(f"dtype {dtype!r} is not one of {sorted(TORCH_DTYPES)}")
        dev = _device(device)
        if state_dict is None:
            state_dict = (
                load_safetensors(weights_path, config) if weights_path else random_state_dict(config, seed)
            )
        if model_id is None:
            source = f"file:{Path(weights_path).name}" if weights_path else f"seed{seed}"
            model_id = f"torch_ref/{config.name}/{source}"
        layout = KVLayout(
            model_id, config.num_layers, config.num_kv_heads, config.head_dim, dtype, block_size
        )
        super().__init__(
            layout=layout,
            vocab_size=config.vocab_size,
            max_positions=config.max_positions,
            num_blocks=num_blocks,
            device=dev,
            chunk_tokens=chunk_tokens,
            prefill_slowdown=prefill_slowdown,
        )
        self.config = config
        self.model = PagedLlama(config, state_dict, TORCH_DTYPES[dtype], dev)
        # Decode steps of a repeating batch read a contiguous copy of its KV (0 disables it).
        self.workspace_bytes = workspace_bytes
        self._workspace: DecodeWorkspace | None = None
        self._last_members: tuple[SequenceState, ...] = ()
        self.workspace_builds = 0  # how often a decode batch changed (a gather of its whole context)

    @torch.inference_mode()
    def _run(self, seqs: Sequence[SequenceState], new_tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        batch = self._batch(seqs, new_tokens)
        workspace = self._workspace_for(seqs, batch) if len(new_tokens[0]) == 1 else None
        try:
            logits = self.model.forward(self.pool, batch, workspace=workspace)
        except BaseException:
            self._workspace = None
            raise
        if workspace is not None:
            workspace.advance()
        return logits

    def _forget(self, seq: SequenceState) -> None:
        if self._workspace is not None and any(m is seq for m in self._workspace.members):
            self._workspace = None  # its memory goes now, not at the next decode step
        self._last_members = ()

    def _workspace_for(self, seqs: Sequence[SequenceState], batch: PagedBatch) -> DecodeWorkspace | None:
        """The decode workspace of this batch: kept while the batch continues, built when the same
        members come back a second step in a row (a rotating batch never pays for building one)."""
        kv_tokens = [s.kv_tokens for s in seqs]
        ws = self._workspace
        if ws is not None and ws.fits(seqs, kv_tokens):
            return ws
        self._workspace = None  # free the old one before building another
        previous, self._last_members = self._last_members, tuple(seqs)
        repeated = len(previous) == len(seqs) and all(a is b for a, b in zip(previous, seqs, strict=True))
        if (
            not repeated
            or DecodeWorkspace.nbytes_for(self.pool, len(seqs), max(kv_tokens)) > self.workspace_bytes
        ):
            return None
        self._workspace = DecodeWorkspace(self.pool, seqs, kv_tokens, batch.block_tables)
        self.workspace_builds += 1
        return self._workspace

    def _batch(self, seqs: Sequence[SequenceState], new_tokens: Sequence[Sequence[int]]) -> PagedBatch:
        """Index tensors for one forward pass; every sequence adds the same number of tokens."""
        n = len(new_tokens[0])
        if any(len(t) != n for t in new_tokens):
            raise ValueError("a batched forward needs the same number of new tokens per sequence")
        bs, dev = self.layout.block_size, self.device
        width = max(len(s.blocks) for s in seqs)
        tables = torch.tensor(
            [s.blocks + [s.blocks[0]] * (width - len(s.blocks)) for s in seqs], dtype=torch.long
        )
        if n == 1:  # decode: a single small tensor carries token, position, slot block and slot offset
            rows = [
                (t[0], s.kv_tokens, s.blocks[s.kv_tokens // bs], s.kv_tokens % bs)
                for s, t in zip(seqs, new_tokens, strict=True)
            ]
            meta = torch.tensor(rows, dtype=torch.long).to(dev)
            return PagedBatch(meta[:, :1], meta[:, 1:2], meta[:, 2], meta[:, 3], tables.to(dev))
        starts = torch.tensor([s.kv_tokens for s in seqs], dtype=torch.long)
        positions = starts.unsqueeze(1) + torch.arange(n).unsqueeze(0)
        return PagedBatch(
            token_ids=torch.tensor(new_tokens, dtype=torch.long).to(dev),
            positions=positions.to(dev),
            slot_blocks=torch.gather(tables, 1, positions // bs).reshape(-1).to(dev),
            slot_offsets=(positions % bs).reshape(-1).to(dev),
            block_tables=tables.to(dev),
            no_past=all(s.kv_tokens == 0 for s in seqs),
        )

    def prompt_logits(self, prompt: Sequence[int]) -> torch.Tensor:
        """Logits ``[len(prompt), vocab]`` at every prompt position, on scratch blocks freed afterwards.

        For cross-checks against other implementations; no request is created, no cache is touched.
        """
        ids = self._check_tokens(prompt, "prompt", extra_positions=0)
        n_blocks = -(-len(ids) // self.layout.block_size)
        self._reserve(n_blocks)
        blocks = self.pool.allocator.allocate(n_blocks)
        try:
            scratch = SequenceState("", ids, len(ids), _GREEDY, blocks, 0, [])
            batch = self._batch([scratch], [ids])
            return self.model.forward(self.pool, batch, all_logits=True)[0]
        finally:
            self.pool.allocator.decref(blocks)


def _device(name: str) -> torch.device:
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise Unavailable("device cuda was asked for but torch sees no CUDA device here")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {name!r}: only cpu and cuda are supported")
    return dev


_GREEDY = SamplingParams()
