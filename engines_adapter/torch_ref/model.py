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

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engines_adapter.torch_ref.batch import PagedBatch
from engines_adapter.torch_ref.kv_pool import KVPool
from engines_adapter.torch_ref.presets import Llama3RopeScaling, ModelConfig
from engines_adapter.torch_ref.weights import StateDict, check_state_dict
from engines_adapter.torch_ref.workspace import DecodeWorkspace, KVAccess, PoolGather

_LOW_PRECISION = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, slots=True)
class _Layer:
    attn_norm: torch.Tensor
    w_qkv: torch.Tensor
    w_o: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor


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
        kv_width = config.num_kv_heads * config.head_dim
        self._qkv_split = [config.num_heads * config.head_dim + kv_width, kv_width]  # (q and k), v

    @torch.inference_mode()
    def forward(
        self,
        pool: KVPool,
        batch: PagedBatch,
        *,
        all_logits: bool = False,
        workspace: DecodeWorkspace | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, vocab]`` of each sequence's last new token (``[B, n, vocab]`` with ``all_logits``).

        With a ``workspace`` (decode steps of a repeating batch) the context is read from it instead
        of being gathered from the pool's blocks.
        """
        cfg = self.config
        bsz, n = batch.token_ids.shape
        hq, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kv: KVAccess = workspace.step(pool, batch) if workspace is not None else PoolGather(pool, batch)
        ctx = kv.context_len
        cos = self.cos[batch.positions].unsqueeze(2)  # [B, n, 1, hd]
        sin = self.sin[batch.positions].unsqueeze(2)
        attend = _Attention(cfg, batch.positions, ctx, self.dtype, from_start=batch.no_past)
        x = F.embedding(batch.token_ids, self.embed)
        for li, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
            qk, v = F.linear(h, layer.w_qkv).split_with_sizes(self._qkv_split, dim=-1)
            q, k = _rope(qk.view(bsz, n, hq + hkv, hd), cos, sin).split_with_sizes([hq, hkv], dim=2)
            kv.write(li, k.reshape(bsz * n, hkv, hd), v.reshape(bsz * n, hkv, hd))
            keys, values = kv.read(li)
            x = x + F.linear(attend(q, keys, values), layer.w_o)
            gate, up = F.linear(_rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps), layer.w_gate_up).chunk(
                2, dim=-1
            )
            x = x + F.linear(F.silu(gate) * up, layer.w_down)
        if not all_logits:
            x = x[:, -1]
        return F.linear(_rms_norm(x, self.norm, cfg.rms_norm_eps), self.lm_head)


class _Attention:
    """Grouped-query attention of ``n`` new tokens per sequence over gathered ``[kv_heads, B, ctx, hd]``.

    Few new tokens (decode, short extends): batched matmuls with the kv head as the outer batch
    dimension, so the gathered keys are read in place and never repeated per query head. Many new
    tokens (prefill, long extends): torch's fused attention, which tiles and never forms the full
    score matrix.
    """

    FUSED_FROM_TOKENS = 64

    def __init__(
        self,
        cfg: ModelConfig,
        positions: torch.Tensor,
        ctx: int,
        dtype: torch.dtype,
        *,
        from_start: bool,
    ) -> None:
        bsz, n = positions.shape
        self.bsz, self.n = bsz, n
        self.hkv, self.group, self.hd = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        self.scale = self.hd**-0.5
        self.fused = n >= self.FUSED_FROM_TOKENS
        # A single sequence with no past (a cold prefill): plain causal attention over its own tokens.
        self.causal = self.fused and bsz == 1 and from_start
        bias = None
        if not self.causal:  # additive mask by absolute position, built once per pass (not per layer)
            key_pos = torch.arange(ctx, device=positions.device)
            hidden = key_pos.view(1, 1, ctx) > positions.view(bsz, n, 1)  # [B, n, ctx]
            bias = torch.zeros(hidden.shape, dtype=dtype, device=positions.device).masked_fill_(
                hidden, -torch.inf
            )
        if self.fused:
            self.mask = None if bias is None else bias.unsqueeze(1)  # [B, 1, n, ctx]
        elif bias is not None:
            self.mask = bias.unsqueeze(1).expand(bsz, self.group, n, -1).reshape(1, bsz, self.group * n, -1)

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``q`` ``[B, n, heads, hd]`` (rotated) -> ``[B, n, heads * hd]``."""
        bsz, n, hkv, g, hd = self.bsz, self.n, self.hkv, self.group, self.hd
        if self.fused:
            keys, values = keys.transpose(0, 1), values.transpose(0, 1)  # [B, kv_heads, ctx, hd]
            if self.causal:
                keys, values = keys[:, :, :n], values[:, :, :n]
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=self.mask, is_causal=self.causal, enable_gqa=True
            )
            return out.transpose(1, 2).reshape(bsz, n, hkv * g * hd)
        qh = (q * self.scale).view(bsz, n, hkv, g, hd).permute(2, 0, 3, 1, 4).reshape(hkv, bsz, g * n, hd)
        scores = torch.matmul(qh, keys.transpose(-1, -2))
        if self.mask is not None:
            scores.add_(self.mask)
        out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [hkv, B, g * n, hd]
        return out.view(hkv, bsz, g, n, hd).permute(1, 3, 0, 2, 4).reshape(bsz, n, hkv * g * hd)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype in _LOW_PRECISION:  # normalise in float32, as Llama does, then scale in the model dtype
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return F.rms_norm(x, weight.shape, weight, eps)


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
    if config.rope_scaling is not None:
        inv_freq = _llama3_scaled(inv_freq, config.rope_scaling)
    freqs = torch.outer(torch.arange(config.max_positions, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), emb.sin().to(device=device, dtype=dtype)


def _llama3_scaled(inv_freq: torch.Tensor, rs: Llama3RopeScaling) -> torch.Tensor:
    """Llama 3.1 RoPE: long wavelengths slowed by ``factor``, short ones kept, a linear blend between."""
    wavelen = 2 * math.pi / inv_freq
    long_wave = rs.original_max_positions / rs.low_freq_factor
    short_wave = rs.original_max_positions / rs.high_freq_factor
    blend = (rs.original_max_positions / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    blended = (1 - blend) * inv_freq / rs.factor + blend * inv_freq
    out = torch.where(wavelen > long_wave, inv_freq / rs.factor, blended)
    return torch.where(wavelen < short_wave, inv_freq, out)
