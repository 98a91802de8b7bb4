"""Triton kernel of the fp32 head's backward (``kernels.lm_head``): the gradient of the sampled tokens'
logprobs with respect to the logits, ``g_t * (onehot(target_t) - exp(lp_t))``, from the log-softmax rows
the forward kept, written once in the GEMMs' dtype. It replaces torch's chain of ``exp``, ``mul_``,
``scatter_add_`` and a cast, each a pass over ``[T, V]`` in fp32 (a 9B-vocabulary chunk is ~4 GiB per
pass). Same operations in the same order as the reference (``lm_head.head_grad_reference``); gradients
need not be batch invariant, so the only difference allowed is ``exp``'s last ulp. With ``row_max`` and
``row_logsum`` (``log_softmax_triton.log_softmax_stats``) it reads the fp32 logits instead and rebuilds each
log-softmax value with torch's epilogue, ``(x - max) - logsum``: the same ``lp`` bits, so the same gradient.

Runs under the Triton interpreter (``TRITON_INTERPRET=1``) on CPU tensors
(``tests/test_fused_triton_interp.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 4096


@triton.jit
def _head_grad_kernel(lp_ptr, max_ptr, logsum_ptr, g_ptr, tgt_ptr, out_ptr, V, s_lp, s_out, BLOCK: tl.constexpr,
                      OUT_DTYPE: tl.constexpr, FROM_LOGITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    g = tl.load(g_ptr + row)
    tgt = tl.load(tgt_ptr + row)
    lp = tl.load(lp_ptr + row * s_lp + cols, mask=mask, other=float("-inf"))
    if FROM_LOGITS:  # lp_ptr holds the logits: torch's log-softmax epilogue, (x - max) - logsum
        lp = (lp - tl.load(max_ptr + row)) - tl.load(logsum_ptr + row)
    x = tl.exp(lp)
    x = x * (-g)
    x = tl.where(cols == tgt, x + g, x)
    tl.store(out_ptr + row * s_out + cols, x.to(OUT_DTYPE), mask=mask)


_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def head_grad(lp_TV: torch.Tensor, g_T: torch.Tensor, tgt_T: torch.Tensor, out_dtype: torch.dtype,
              out: torch.Tensor | None = None, row_max: torch.Tensor | None = None,
              row_logsum: torch.Tensor | None = None) -> torch.Tensor:
    """``[T, V]`` in ``out_dtype``: ``g * (onehot(tgt) - exp(lp))`` row by row (``lp`` fp32, unit stride in V);
    written into ``out`` when given (``[T, V]`` of ``out_dtype``, unit stride in V: a row slice of a buffer).
    With ``row_max`` and ``row_logsum`` ([T] fp32), ``lp_TV`` holds the logits and ``lp = (x - max) - logsum``."""
    T, V = lp_TV.shape
    from_logits = row_max is not None
    if from_logits != (row_logsum is not None) or (from_logits and (row_max.shape != (T,) or row_logsum.shape != (T,))):
        raise ValueError("row_max and row_logsum come together, each [T] fp32")
    if lp_TV.dtype != torch.float32 or lp_TV.stride(1) != 1:
        raise ValueError(f"lp must be fp32 with unit stride along V, got {lp_TV.dtype}, strides {lp_TV.stride()}")
    if g_T.shape != (T,) or tgt_T.shape != (T,):
        raise ValueError(f"g and targets must be [T={T}], got {tuple(g_T.shape)} and {tuple(tgt_T.shape)}")
    if out is None:
        out = torch.empty(T, V, dtype=out_dtype, device=lp_TV.device)
    elif out.shape != (T, V) or out.dtype != out_dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{T}, {V}] {out_dtype} with unit stride along V, got {tuple(out.shape)} "
                         f"{out.dtype}, strides {out.stride()}")
    if T:
        stats = (row_max.float().contiguous(), row_logsum.float().contiguous()) if from_logits else (lp_TV, lp_TV)
        _head_grad_kernel[(T, triton.cdiv(V, BLOCK_V))](lp_TV, *stats, g_T.float().contiguous(), tgt_T.contiguous(),
                                                         out, V, lp_TV.stride(0), out.stride(0), BLOCK=BLOCK_V,
                                                         OUT_DTYPE=_TL[out_dtype], FROM_LOGITS=from_logits,
                                                         num_warps=8)
    return out
