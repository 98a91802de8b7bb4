"""Causal attention over packed sequences (``cu_seqlens``), one call per step: the trainer's kernel.

- Batch invariant (CUDA): the forward is the Triton kernel of ``attention_triton`` (the generator runs
  the same kernel over its paged cache, so the trainer's logprob equals the generator's bit for bit);
  the backward need not be batch invariant and is FlashAttention's varlen backward (torch's bundled
  FA2, ``aten._flash_attention_backward``) at the same inputs, after a flash forward recompute that
  gives it its own log-sum-exp.
- Not batch invariant (CUDA): FlashAttention varlen forward and backward, one launch each.
- Elsewhere (CPU, or where torch's flash kernels refuse a dtype or head size): SDPA per sequence
  (``attention_bi`` per sequence in batch-invariant mode), as before.
GQA is native in all of them (key/value heads are not repeated).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from titan_rl_ext.kernels import batch_invariant as bi
from titan_rl_ext.kernels.attention import attention_bi

logger = logging.getLogger(__name__)

_flash_ok: dict[tuple[torch.dtype, int], bool] = {}  # (dtype, head_dim) -> torch's flash kernels ran


def _flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_s: int, scale: float
               ) -> tuple[torch.Tensor, ...]:
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, max_s, max_s, 0.0, True, False, scale=scale)
    return out, lse, rng, unused


def _flash_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_s: int,
               scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, lse, rng, unused = _flash_fwd(q, k, v, cu, max_s, scale)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        do.contiguous(), q, k, v, out, lse, cu, cu, max_s, max_s, 0.0, True, rng, unused, scale=scale)
    return dq, dk, dv


def flash_usable(q: torch.Tensor) -> bool:
    """Whether torch's FlashAttention kernels take this dtype and head size here (tried once per pair)."""
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    key = (q.dtype, q.shape[-1])
    if key not in _flash_ok:
        try:
            t = torch.randn(4, q.shape[1], q.shape[2], dtype=q.dtype, device=q.device)
            cu = torch.tensor([0, 4], dtype=torch.int32, device=q.device)
            _flash_fwd(t, t, t, cu, 4, 1.0)
            _flash_ok[key] = True
        except RuntimeError as e:
            logger.warning("torch FlashAttention unavailable for %s head_dim %d (%s): SDPA per sequence",
                           q.dtype, q.shape[-1], str(e).splitlines()[0])
            _flash_ok[key] = False
    return _flash_ok[key]


def _sdpa_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int], scale: float) -> torch.Tensor:
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e == s:
            continue
        o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1),
                                           is_causal=True, scale=scale, enable_gqa=True)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs, dim=0) if outs else q.new_zeros(0, q.shape[1], v.shape[-1])


class _PackedAttention(torch.autograd.Function):
    """Forward: the BI Triton kernel or flash; backward: flash (or SDPA autograd per sequence)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_s, scale, use_bi, use_flash):  # type: ignore[no-untyped-def]
        if use_bi:
            from titan_rl_ext.kernels.attention_triton import bi_attention_fwd

            o = bi_attention_fwd(q, k, v, cu, cu[1:] - cu[:-1], max_s, scale, k_start=cu[:-1])
        else:
            o = _flash_fwd(q, k, v, cu, max_s, scale)[0]
        ctx.save_for_backward(q, k, v, cu)
        ctx.max_s, ctx.scale, ctx.use_flash = max_s, scale, use_flash
        return o

    @staticmethod
    def backward(ctx, do):  # type: ignore[no-untyped-def]
        q, k, v, cu = ctx.saved_tensors
        if ctx.use_flash:
            dq, dk, dv = _flash_bwd(do, q, k, v, cu, ctx.max_s, ctx.scale)
        else:
            with torch.enable_grad():
                qi, ki, vi = (t.detach().requires_grad_(True) for t in (q, k, v))
                o = _sdpa_packed(qi, ki, vi, cu.tolist(), ctx.scale)
                dq, dk, dv = torch.autograd.grad(o, (qi, ki, vi), do)
        return dq, dk, dv, None, None, None, None, None


def packed_causal_attention(
    q_TNH: torch.Tensor, k_TKH: torch.Tensor, v_TKH: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention within each packed sequence: ``[T, N, H]`` queries, ``[T, K, H]`` keys/values."""
    use_bi = bi.is_batch_invariant()
    triton_bi = use_bi and q_TNH.is_cuda and bi._triton() is not None
    use_flash = flash_usable(q_TNH) and q_TNH.shape[-1] == v_TKH.shape[-1]
    if triton_bi or (not use_bi and use_flash):
        cu = cu_seqlens.to(device=q_TNH.device, dtype=torch.int32)
        q, k, v = q_TNH.contiguous(), k_TKH.contiguous(), v_TKH.contiguous()
        return _PackedAttention.apply(q, k, v, cu, max(int(max_seqlen), 1), scale, triton_bi, use_flash)
    bounds = cu_seqlens.tolist()
    if not use_bi:
        return _sdpa_packed(q_TNH, k_TKH, v_TKH, bounds, scale)
    outs = [attention_bi(q_TNH[s:e], k_TKH[s:e], v_TKH[s:e], 0, scale) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    return torch.cat(outs, dim=0) if outs else q_TNH.new_zeros(0, q_TNH.shape[1], v_TKH.shape[-1])
