"""Full (softmax) attention layer of Qwen3 / Qwen3.5, with its kernel in an explicit slot.

The layer owns the projections, q/k norms, rotary and the optional output gate; ``self.kernel``
turns rotated q/k/v into per-head outputs. The trainer's kernel attends causally within each packed
sequence; an inference engine installs its own kernel (e.g. vLLM's paged attention) without touching
this layer's math. A kernel receives the layer's ``KVState`` (or None) and returns the new one, so an
engine that keeps its own cache simply passes None through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_rl_ext.kernels import batch_invariant as bi
from titan_rl_ext.kernels.attention import attention_bi
from titan_rl_ext.kernels import ops, rows
from titan_rl_ext.kernels.varlen_attention import packed_causal_attention
from titan_rl_ext.models.common.batch import SeqBatch
from titan_rl_ext.models.common.norms import RMSNorm


@dataclass(frozen=True)
class KVState:
    """Per-sequence key/value history of one layer: ``k[n]``/``v[n]`` are ``[S_n, n_kv_heads, head_dim]``."""

    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]

    @classmethod
    def empty(cls, num_seqs: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> KVState:
        z = torch.zeros(0, n_kv_heads, head_dim, dtype=dtype, device=device)
        return cls(tuple(z for _ in range(num_seqs)), tuple(z for _ in range(num_seqs)))

    def cached_lengths(self) -> list[int]:
        return [t.shape[0] for t in self.k]


class AttentionKernel(Protocol):
    def __call__(
        self,
        q_TNH: torch.Tensor,
        k_TKH: torch.Tensor,
        v_TKH: torch.Tensor,
        batch: SeqBatch,
        state: KVState | None,
    ) -> tuple[torch.Tensor, KVState | None]: ...


class TorchAttentionKernel(nn.Module):
    """Causal attention within each packed sequence (``packed_causal_attention``: one flash launch, or the
    batch-invariant Triton kernel), or over a cached prefix and the new tokens when given a ``KVState``
    (inference without an engine: the Triton kernel over the state's keys in one launch on CUDA, per
    sequence on CPU)."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(
        self,
        q_TNH: torch.Tensor,
        k_TKH: torch.Tensor,
        v_TKH: torch.Tensor,
        batch: SeqBatch,
        state: KVState | None,
    ) -> tuple[torch.Tensor, KVState | None]:
        if state is None:  # the trainer: one launch over all packed sequences
            return packed_causal_attention(q_TNH, k_TKH, v_TKH, batch.cu_seqlens, batch.max_seqlen, self.scale), None
        bounds = batch.cu_seqlens.tolist()
        if len(state.k) != batch.num_seqs:
            raise ValueError(f"KV state holds {len(state.k)} sequences, batch has {batch.num_seqs}")
        new_k = [torch.cat([state.k[n], k_TKH[s:e]], dim=0) for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))]
        new_v = [torch.cat([state.v[n], v_TKH[s:e]], dim=0) for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:]))]
        new_state = KVState(tuple(new_k), tuple(new_v))
        if q_TNH.is_cuda and bi._triton() is not None:
            # the kernel the trainer and the generator run in BI mode, over this state's keys laid end to
            # end: one launch for every sequence. Non-BI mode takes it too -- it is the fastest path the
            # project has here (the per-sequence SDPA loop below cost 256 launches at a 256-sequence decode)
            from titan_rl_ext.kernels.attention_triton import bi_attention_fwd

            lens = [t.shape[0] for t in new_k]
            dev = q_TNH.device
            k_start = torch.tensor([0] + lens[:-1], device=dev).cumsum(0).to(torch.int32)
            o = bi_attention_fwd(
                q_TNH.contiguous(), torch.cat(new_k).contiguous(), torch.cat(new_v).contiguous(),
                batch.cu_seqlens.to(device=dev, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32, device=dev),
                max(batch.max_seqlen, 1), self.scale, k_start=k_start,
            )
            return o, new_state
        outs = []
        for n, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            if e == s:
                continue
            q, k, v = q_TNH[s:e], new_k[n], new_v[n]
            prefix = k.shape[0] - (e - s)
            if bi.is_batch_invariant():
                outs.append(attention_bi(q, k, v, prefix, self.scale))
                continue
            if prefix:
                # query i sits at absolute position prefix + i and may see keys 0..prefix+i
                mask = torch.arange(k.shape[0], device=q.device)[None, :] <= (
                    prefix + torch.arange(e - s, device=q.device)[:, None]
                )
                o = F.scaled_dot_product_attention(
                    q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                    attn_mask=mask, scale=self.scale, enable_gqa=True,
                )
            else:
                o = F.scaled_dot_product_attention(
                    q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                    is_causal=True, scale=self.scale, enable_gqa=True,
                )
            outs.append(o.transpose(0, 1))
        o_TNH = torch.cat(outs, dim=0) if outs else q_TNH.new_zeros(0, *q_TNH.shape[1:-1], v_TKH.shape[-1])
        return o_TNH, new_state


class Attention(nn.Module):
    """GQA attention. Qwen3.5 (``output_gate=True``): the q part of ``wqkv`` yields per head ``[q; gate]`` and the
    output is multiplied by ``sigmoid(gate)`` before ``wo``; q/k norms are zero-centred there."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        norm_eps: float,
        *,
        output_gate: bool,
        zero_centered_norm: bool,
        bias: bool = False,
    ) -> None:
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.output_gate = output_gate
        # q_proj (per head [q; gate] with the output gate), k_proj, v_proj as one GEMM
        q_out, kv_out = n_heads * head_dim * (2 if output_gate else 1), n_kv_heads * head_dim
        self.wqkv = ops.MergedLinear(dim, [q_out, kv_out, kv_out], bias=bias)
        self.wo = ops.Linear(n_heads * head_dim, dim, bias=bias)
        self.q_norm = RMSNorm(head_dim, norm_eps, zero_centered=zero_centered_norm)
        self.k_norm = RMSNorm(head_dim, norm_eps, zero_centered=zero_centered_norm)
        self.kernel: nn.Module = TorchAttentionKernel(scale=head_dim**-0.5)

    def forward(
        self,
        x_TD: torch.Tensor,
        batch: SeqBatch,
        rope: tuple[torch.Tensor, torch.Tensor],
        state: KVState | None = None,
    ) -> tuple[torch.Tensor, KVState | None]:
        T = x_TD.shape[0]
        q, k, v = self.wqkv.split(self.wqkv(x_TD))
        if self.output_gate:
            q_gate = q.view(T, self.n_heads, 2 * self.head_dim)
            q, gate_TNH = q_gate[..., : self.head_dim], q_gate[..., self.head_dim :]
        cos, sin = rope
        q_TNH = self.q_norm.with_rotary(q.reshape(T, self.n_heads, self.head_dim), cos, sin)
        k_TKH = self.k_norm.with_rotary(k.reshape(T, self.n_kv_heads, self.head_dim), cos, sin)
        v_TKH = v.reshape(T, self.n_kv_heads, self.head_dim)
        o_TNH, state = self.kernel(q_TNH, k_TKH, v_TKH, batch, state)
        if self.output_gate:
            # the gate read where the projection wrote it (a head view), one launch on CUDA
            o_TNH = rows.sigmoid_mul(gate_TNH, o_TNH)
        return self.wo(o_TNH.reshape(T, self.n_heads * self.head_dim)), state
