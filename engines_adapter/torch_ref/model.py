"""The reference decoder's forward pass over the paged KV pool.

A Llama-style decoder: RMSNorm, rotary position embedding ("rotate half", as in Hugging Face
checkpoints), grouped-query attention and a SwiGLU MLP. Weights are fused at load time (q/k/v in
one matrix, gate/up in another) so a step is a handful of large ops per layer.

One ``forward`` serves prefill, extend and batched decode: a batch of ``B`` sequences each adds
``n`` new tokens (decode: ``n == 1``; prefill and extend: ``B == 1``). Per layer, the new tokens'
K/V are written into the pool at their slots first, then each sequence's blocks are gathered with
one ``index_select`` and attention runs under a causal mask by absolute position, which also hides
padding blocks and the unwritten tail of the last block. No Python loop runs over blocks or tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engines_adapter.torch_ref.kv_pool import KVPool
from engines_adapter.torch_ref.presets import ModelConfig
from engines_adapter.torch_ref.weights import StateDict, check_state_dict

_LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, slots=True)
class _Layer:
    attn_norm: torch.Tensor
    w_qkv: torch.Tensor
    w_o: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """Where a forward pass reads and writes: ``B`` sequences, ``n`` new tokens each.

    ``positions[b, j]`` is the absolute position of new token ``j``; ``slot_blocks``/``slot_offsets``
    (``B * n``, row-major) name the pool slot that receives its K/V; ``block_tables`` (``[B, max_blocks]``,
    padded with any valid block id) list each sequence's blocks covering every position up to its
    last new token.
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    block_tables: torch.Tensor


class PagedLlama:
    """Fused weights plus RoPE tables on one device and dtype; stateless apart from the pool it is given."""

    def __init__(
        self, config: ModelConfig, state: StateDict, dtype: torch.dtype, device: torch.device
    ) -> None:
        check_state_dict(state, config)
        self.config = config
        self.dtype = dtype

        def w(name: str) -> torch.Tensor:
            return state[name].to(device=device, dtype=dtype).contiguous()

        def cat(*names: str) -> torch.Tensor:
            return torch.cat([state[n] for n in names]).to(device=device, dtype=dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                _Layer(
                    attn_norm=w(p + "input_layernorm.weight"),
                    w_qkv=cat(
                        p + "self_attn.q_proj.weight",
                        p + "self_attn.k_proj.weight",
                        p + "self_attn.v_proj.weight",
                    ),
                    w_o=w(p + "self_attn.o_proj.weight"),
                    mlp_norm=w(p + "post_attention_layernorm.weight"),
                    w_gate_up=cat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    w_down=w(p + "mlp.down_proj.weight"),
                )
            )
        self.norm = w("model.norm.weight")
        self.lm_head = self.embed if config.tie_word_embeddings else w("lm_head.weight")
        self.cos, self.sin = _rope_tables(config, dtype, device)

    @torch.inference_mode()
    def forward(self, pool: KVPool, batch: PagedBatch, *, all_logits: bool = False) -> torch.Tensor:
        """Logits ``[B, vocab]`` of each sequence's last new token (``[B, n, vocab]`` with ``all_logits``)."""
        cfg = self.config
        bsz, n = batch.token_ids.shape
        hq, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bs = pool.layout.block_size
        max_blocks = batch.block_tables.shape[1]
        ctx = max_blocks * bs
        table = batch.block_tables.reshape(-1)
        cos = self.cos[batch.positions].unsqueeze(2)  # [B, n, 1, hd]
        sin = self.sin[batch.positions].unsqueeze(2)
        key_pos = torch.arange(ctx, device=table.device)
        mask = key_pos.view(1, 1, 1, ctx) <= batch.positions.view(bsz, 1, n, 1)
        x = F.embedding(batch.token_ids, self.embed)
        for li, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
            q, k, v = F.linear(h, layer.w_qkv).split((hq * hd, hkv * hd, hkv * hd), dim=-1)
            q = _rope(q.view(bsz, n, hq, hd), cos, sin)
            k = _rope(k.view(bsz, n, hkv, hd), cos, sin)
            k_pool, v_pool = pool.layer_kv(li)
            k_pool[batch.slot_blocks, :, batch.slot_offsets] = k.reshape(bsz * n, hkv, hd)
            v_pool[batch.slot_blocks, :, batch.slot_offsets] = v.reshape(bsz * n, hkv, hd)
            keys = _gather(k_pool, table, bsz, max_blocks, ctx)
            values = _gather(v_pool, table, bsz, max_blocks, ctx)
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True
            )
            x = x + F.linear(attn.transpose(1, 2).reshape(bsz, n, hq * hd), layer.w_o)
            gate, up = F.linear(_rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps), layer.w_gate_up).chunk(
                2, dim=-1
            )
            x = x + F.linear(F.silu(gate) * up, layer.w_down)
        if not all_logits:
            x = x[:, -1]
        return F.linear(_rms_norm(x, self.norm, cfg.rms_norm_eps), self.lm_head)


def _gather(
    layer_pool: torch.Tensor, table: torch.Tensor, bsz: int, max_blocks: int, ctx: int
) -> torch.Tensor:
    """``[B, kv_heads, max_blocks * block_size, head_dim]`` from a layer's ``[blocks, kv_heads, bs, hd]``."""
    _, hkv, bs, hd = layer_pool.shape
    blocks = layer_pool.index_select(0, table).view(bsz, max_blocks, hkv, bs, hd)
    return blocks.transpose(1, 2).reshape(bsz, hkv, ctx, hd)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype in _LOW_PRECISION:  # normalise in float32, as Llama does, then scale in the model dtype
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rope_tables(
    config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position, computed in float64 and then cast."""
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    freqs = torch.outer(torch.arange(config.max_positions, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)
