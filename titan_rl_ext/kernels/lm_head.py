"""The fp32 LM head, and the sampled token's logprob without a ``[T, V]`` fp32 tensor.

``head_logits_fp32`` is the one function both sides call for fp32 logits (the generator's
``compute_logits``, the trainer through ``token_logprobs_fused``). With bf16/fp16 hidden states and
weights on CUDA it multiplies the 16-bit values on the tensor cores with fp32 accumulation and fp32
output: the products of two bf16 numbers are exact in fp32, so this is an fp32 head over the same
inputs, at bf16 speed (the older path widened both operands and ran an fp32 "ieee" GEMM, ~100x slower).
Batch invariant mode: the Triton BI GEMM; otherwise cuBLAS. Elsewhere (CPU, fp32 models): the operands
are widened to fp32 as before.

``token_logprobs_fused`` returns ``log_softmax(h @ W^T)[t, target_t]`` for every row, computed over
row chunks of at most ``CHUNK_BYTES`` of fp32 logits, bit for bit what vLLM's sampler gets from
``logits.log_softmax(-1)`` on the generator's logits (row by row, so chunking does not change a row's bits).
Those bits pin the forward to materialising the fp32 logits (a tiled online softmax would round differently
from the sampler's). On CUDA the log-softmax itself is not written: ``log_softmax_triton`` computes each row's
max and log-sum-exp in the order of torch's kernel and the target column with torch's epilogue (two reads of
the logits, against torch's three reads and a ``[T, V]`` fp32 write), checked against ``torch.log_softmax`` on
a probe once per device and vocabulary (a probe that differs: torch's kernel).
The backward reuses what the forward wrote: the logits (or, on torch's path, the log-softmax) are kept (up to
``SAVE_BYTES``, ``TITAN_HEAD_SAVE_GB``) and the backward forms ``g * (onehot - exp(lp))`` from them in one pass
(``lm_head_triton`` on CUDA, under the fused-kernel switch of ``kernels.rows``), with no second logits GEMM: 2 of
the 3 head GEMMs of a step instead of 3 of 4. Chunks past the budget recompute their logits. dgrad and wgrad are
16-bit GEMMs with fp32 accumulation (cuBLAS; gradients need not be batch invariant);
``tests/gpu/test_bi_kernels_cuda.py::test_fused_head_bits_and_gradient_error`` measures the gradient error
against float64.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple, Union

import torch
import torch.nn.functional as F

from titan_rl_ext import settings
from titan_rl_ext.kernels import batch_invariant as bi

logger = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 30  # fp32 logits per chunk (on torch's path as much again for its log-softmax)
SAVE_BYTES = settings.HEAD_SAVE_GB.get()
"""fp32 logits (or, on torch's path, log-softmax) the forward keeps for the backward (per call); 0: always
recompute the logits."""
_LOW = (torch.bfloat16, torch.float16)


class LogitRows(NamedTuple):
    """A chunk's fp32 logits with each row's max and log-sum-exp: ``(logits - max) - logsum`` is its
    log-softmax, bit for bit ``torch.log_softmax``."""

    logits: torch.Tensor
    row_max: torch.Tensor
    row_logsum: torch.Tensor


Rows = Union[LogitRows, torch.Tensor]  # or a chunk's log-softmax itself (torch's path)


def _low_precision_cuda(h: torch.Tensor, w: torch.Tensor) -> bool:
    return h.is_cuda and h.dtype in _LOW and w.dtype == h.dtype


def _mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of 16-bit CUDA operands with an fp32 result (cuBLAS, fp32 accumulation)."""
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):  # a torch without mm(out_dtype=)
        return torch.mm(a.float(), b.float())


def head_logits_fp32(h_TD: torch.Tensor, w_VD: torch.Tensor) -> torch.Tensor:
    """fp32 logits ``[T, V]`` of hidden states ``h`` under head weight ``w`` (see the module docstring).
    Differentiable through the BI GEMM and widened paths; use ``token_logprobs_fused`` to train."""
    if _low_precision_cuda(h_TD, w_VD):
        if bi.is_batch_invariant() and bi._triton() is not None:
            return bi._triton().bi_matmul(h_TD.contiguous(), w_VD.t(), out_dtype=torch.float32)
        return _mm_fp32_out(h_TD, w_VD.t())
    if bi.is_batch_invariant():
        # the BI GEMM takes the weight in its own dtype and widens it per tile (same bits as a cast)
        return bi.linear(h_TD.float(), w_VD)
    return F.linear(h_TD.float(), w_VD.float())


def torch_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """The call vLLM's sampler makes for raw logprobs: what the head's logprobs must equal bit for bit."""
    return logits.log_softmax(dim=-1, dtype=torch.float32)


def _lse_variant(logits: torch.Tensor) -> dict[str, bool] | None:
    """The ``log_softmax_triton`` build variant that stands in for ``torch.log_softmax`` on these logits, or None
    (torch's kernel)."""
    from titan_rl_ext.kernels.rows import fused_available

    if not fused_available(logits):
        return None
    from titan_rl_ext.kernels.log_softmax import replicates

    return _probe_variant(logits.device, logits.shape[1]) if replicates(logits) else None


@functools.lru_cache(maxsize=None)
def _probe_variant(device: torch.device, V: int) -> dict[str, bool] | None:
    """The first build variant (``log_softmax_triton.VARIANTS``) whose kernel gives ``torch.log_softmax``'s bits on
    every column of probe rows of this width (logit-like spreads, a spike, a row whose exponentials underflow past
    the denormals); None if none does, or the kernel fails to build: torch's kernel then, with a warning, instead
    of shifted bits."""
    from titan_rl_ext.kernels import log_softmax_triton as lst

    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(8, V, device=device, generator=g) * torch.tensor([0.5, 2, 4, 8, 4, 4, 4, 30], device=device)[:, None]
    x[4, V // 3] = 60.0
    x[5, : V // 2] -= 95.0
    want = torch_log_softmax(x)
    for variant in lst.VARIANTS:
        try:
            _, m, logsum = lst.log_softmax_stats(x, **variant)
        except Exception:  # a Triton that cannot build it here: torch's kernel, the path that always works
            logger.exception("titan head: the log-softmax kernel failed on %s; using torch's kernel", device)
            return None
        if torch.equal((x - m[:, None]) - logsum[:, None], want):
            return variant
    logger.warning("titan head: no build of the log-softmax kernel gives torch.log_softmax's bits on this torch "
                   "(V=%d, %s); using torch's kernel", V, torch.__version__)
    return None


def _rows_of(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, Rows]:
    """``(lp at targets [T], what the backward needs)`` of a chunk's fp32 logits."""
    variant = _lse_variant(logits)
    if variant is not None:
        from titan_rl_ext.kernels.log_softmax_triton import log_softmax_stats

        lp_t, m, logsum = log_softmax_stats(logits, targets, **variant)
        return lp_t, LogitRows(logits, m, logsum)
    lp = torch_log_softmax(logits)
    return lp.gather(1, targets[:, None]).squeeze(1), lp


def chunk_rows(V: int) -> int:
    """The most rows of fp32 logits a chunk holds (``CHUNK_BYTES``)."""
    return max(1, CHUNK_BYTES // (4 * max(V, 1)))


def chunk_bounds(T: int, V: int) -> list[tuple[int, int]]:
    """Row ranges of the head's chunks: as few as ``chunk_rows`` allows, balanced, each a multiple of 128 rows where
    that fits (the 9B slice's T = 8192: 2 x 4096, not 4323 + 3869 -- ragged GEMM tiles in every head GEMM)."""
    if T <= 0:
        return []
    cap = chunk_rows(V)
    per = -(-T // -(-T // cap))
    if per > 128:
        per = min(cap, -(-per // 128) * 128)
    return [(r0, min(T, r0 + per)) for r0 in range(0, T, per)]


def head_grad_reference(lp_TV: torch.Tensor, g_T: torch.Tensor, tgt_T: torch.Tensor, out_dtype: torch.dtype,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """``g * (onehot(tgt) - exp(lp))`` in ``out_dtype``, reusing ``lp``'s memory (it is consumed); into ``out``
    when given."""
    grad = lp_TV.exp_()
    grad.mul_(-g_T[:, None])
    grad.scatter_add_(1, tgt_T[:, None], g_T[:, None])
    if out is not None:
        return out.copy_(grad)
    return grad if out_dtype == grad.dtype else grad.to(out_dtype)


def _head_grad(rows: Rows, g_T: torch.Tensor, tgt_T: torch.Tensor, out_dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    from titan_rl_ext.kernels.rows import fused_available

    if isinstance(rows, LogitRows):  # only made where the kernels run
        from titan_rl_ext.kernels.lm_head_triton import head_grad

        return head_grad(rows.logits, g_T, tgt_T, out_dtype, out=out, row_max=rows.row_max,
                         row_logsum=rows.row_logsum)
    if fused_available(rows):  # CUDA, triton, TITAN_FUSED_KERNELS not "0": the layers' fused-kernel switch
        from titan_rl_ext.kernels.lm_head_triton import head_grad

        return head_grad(rows, g_T, tgt_T, out_dtype, out=out)
    return head_grad_reference(rows, g_T, tgt_T, out_dtype, out=out)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TD, w_VD, targets_T, keep):  # type: ignore[no-untyped-def]
        T, V = h_TD.shape[0], w_VD.shape[0]
        out = torch.empty(T, dtype=torch.float32, device=h_TD.device)
        kept: list[Rows] = []  # the first chunks' logits or log-softmax, within SAVE_BYTES (only for a backward)
        for i, (r0, r1) in enumerate(chunk_bounds(T, V)):
            out[r0:r1], rows = _rows_of(head_logits_fp32(h_TD[r0:r1], w_VD), targets_T[r0:r1])
            if keep and i == len(kept) and r1 * V * 4 <= SAVE_BYTES:
                kept.append(rows)
            del rows
        ctx.save_for_backward(h_TD, w_VD, targets_T)
        ctx.kept_lp = kept
        return out

    @staticmethod
    def backward(ctx, g_T):  # type: ignore[no-untyped-def]
        h, w, tgt = ctx.saved_tensors
        kept, ctx.kept_lp = ctx.kept_lp, []
        T, V = h.shape[0], w.shape[0]
        low = _low_precision_cuda(h, w)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.empty_like(h) if need_h else None
        grad_dtype = h.dtype if low else torch.float32
        # The whole [T, V] gradient within the head's budget: the chunks write into one buffer and the weight
        # gradient is one GEMM over all T rows. Otherwise one GEMM per chunk, summed into an fp32 [V, D] --
        # at the 9B slice's T = 8192 that was a zero fill and two 4 GB fp32 adds (~6.5 ms of the step).
        whole = need_w and T * V * torch.finfo(grad_dtype).bits // 8 <= SAVE_BYTES
        grad_TV = torch.empty(T, V, dtype=grad_dtype, device=h.device) if whole else None
        dw32 = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w and not whole else None
        g_T = g_T.float()
        for i, (r0, r1) in enumerate(chunk_bounds(T, V)):
            h_c, g_c = h[r0:r1], g_T[r0:r1]
            if i < len(kept):  # what the forward kept: no second logits GEMM
                rows, kept[i] = kept[i], None  # type: ignore[call-overload]
            else:
                _, rows = _rows_of(_mm_fp32_out(h_c, w.t()) if low else F.linear(h_c.float(), w.float()), tgt[r0:r1])
            grad = _head_grad(rows, g_c, tgt[r0:r1], grad_dtype, out=grad_TV[r0:r1] if whole else None)
            del rows
            if need_h:
                dh[r0:r1] = grad @ w if low else (grad @ w.float()).to(h.dtype)
            if dw32 is not None:
                dw32 += _mm_fp32_out(grad.t(), h_c) if low else grad.t() @ h_c.float()
            del grad
        dw = None
        if whole:
            # One GEMM over all T rows, 16-bit output like every other weight gradient of the model (cuBLAS
            # accumulates in fp32 and rounds in its epilogue): no fp32 [V, D] result (4 GB at the 9B head)
            # written and read back for a cast. tests/gpu/test_bi_kernels_cuda.py bounds its error vs float64.
            dw = torch.mm(grad_TV.t(), h) if low else (grad_TV.t() @ h.float()).to(w.dtype)
            del grad_TV
        elif need_w:
            dw = dw32.to(w.dtype)
        return dh, dw, None, None


def token_logprobs_fused(h_TD: torch.Tensor, w_VD: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
    """``lp[t] = log_softmax(fp32 logits of h[t])[targets[t]]``, fp32 ``[T]``, differentiable in ``h`` and
    ``w``; never holds more than one chunk of logits. Bits equal ``head_logits_fp32`` + ``log_softmax``."""
    if h_TD.dim() != 2 or w_VD.dim() != 2 or h_TD.shape[1] != w_VD.shape[1]:
        raise ValueError(f"expected h [T, D] and w [V, D]; got {tuple(h_TD.shape)} and {tuple(w_VD.shape)}")
    if targets_T.shape != (h_TD.shape[0],):
        raise ValueError(f"targets must be [T={h_TD.shape[0]}]; got {tuple(targets_T.shape)}")
    # under no_grad nothing is kept (ctx.needs_input_grad would still say True there)
    keep = torch.is_grad_enabled() and (h_TD.requires_grad or w_VD.requires_grad)
    return _TokenLogprobs.apply(h_TD, w_VD, targets_T.long(), keep)
