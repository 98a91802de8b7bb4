"""The MoE experts' GEMM over rows sorted by expert: ``y[r] = x[r] @ w[e(r)]^T``.

CUDA: one launch and no host read, so the expert dispatch can sit inside a CUDA graph. Batch invariant:
the Triton grouped GEMM (``grouped_gemm_triton``: a fixed tile, a row's bits independent of the other
rows); otherwise torch's ``_grouped_mm`` where it takes the operands (bf16 on Hopper or newer), else the same
Triton kernel. CPU: ``grouped_mm_reference``, expert by expert through ``ops.linear`` (it reads the counts on the
host, which is fine where there are no graphs; the bits are those of the per-expert loop the MoE ran before).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from titan_rl_ext.kernels import batch_invariant as bi
from titan_rl_ext.kernels import ops


def expert_rows(counts_E: torch.Tensor) -> Iterator[tuple[int, slice]]:
    """``(expert, its rows)`` for every expert with rows, in order (reads the counts on the host)."""
    start = 0
    for e, c in enumerate(counts_E.tolist()):
        if c:
            yield e, slice(start, start + c)
        start += c


def grouped_mm_reference(x_NK: torch.Tensor, w_ENK: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """Expert by expert: ``ops.linear`` of each expert's rows (batch invariant when the switch is on)."""
    y = x_NK.new_empty(x_NK.shape[0], w_ENK.shape[1])
    for e, rows in expert_rows(counts_E):
        y[rows] = ops.linear(x_NK[rows], w_ENK[e])
    return y


def _takes_torch_grouped_mm(x_NK: torch.Tensor, w_ENK: torch.Tensor) -> bool:
    """Whether torch's ``_grouped_mm`` takes these operands: decided from static properties, never by trying
    (a failed launch inside a CUDA graph capture would spoil the capture)."""
    return (hasattr(torch, "_grouped_mm") and x_NK.dtype == w_ENK.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x_NK.device) >= (9, 0)
            and x_NK.shape[1] % 8 == 0 and w_ENK.shape[1] % 8 == 0)  # 16-byte rows of bf16


class _TritonGroupedMM(torch.autograd.Function):
    """The Triton kernel forward; the backward (not batch invariant, not in a graph): dx through the same
    kernel on the transposed weights, dw expert by expert."""

    @staticmethod
    def forward(ctx, x_NK, w_ENK, counts_E):  # type: ignore[no-untyped-def]
        from titan_rl_ext.kernels.grouped_gemm_triton import grouped_mm as triton_grouped_mm

        ctx.save_for_backward(x_NK, w_ENK, counts_E)
        return triton_grouped_mm(x_NK, w_ENK, counts_E)

    @staticmethod
    def backward(ctx, dy_NN):  # type: ignore[no-untyped-def]
        from titan_rl_ext.kernels.grouped_gemm_triton import grouped_mm as triton_grouped_mm

        x, w, counts = ctx.saved_tensors
        dy = dy_NN.contiguous()
        dx = triton_grouped_mm(dy, w.transpose(1, 2), counts) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = torch.zeros_like(w)
            for e, rows in expert_rows(counts):
                dw[e] = (dy[rows].t().float() @ x[rows].float()).to(w.dtype)
        return dx, dw, None


def grouped_mm(x_NK: torch.Tensor, w_ENK: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """``[rows, N]``: rows of ``x`` grouped by expert (``counts_E[e]`` rows for expert ``e``, in order), each
    times its expert's ``w[e]`` (``[E, N, K]``, ``F.linear``'s layout)."""
    if x_NK.dim() != 2 or w_ENK.dim() != 3 or x_NK.shape[1] != w_ENK.shape[2] or counts_E.shape != (w_ENK.shape[0],):
        raise ValueError(f"grouped_mm: x [rows, K], w [E, N, K], counts [E]; got {tuple(x_NK.shape)}, "
                         f"{tuple(w_ENK.shape)}, {tuple(counts_E.shape)}")
    if not x_NK.is_cuda:
        return grouped_mm_reference(x_NK, w_ENK, counts_E)
    if not bi.is_batch_invariant() and _takes_torch_grouped_mm(x_NK, w_ENK):
        return torch._grouped_mm(x_NK.contiguous(), w_ENK.transpose(1, 2), offs=counts_E.cumsum(0).to(torch.int32))
    return _TritonGroupedMM.apply(x_NK, w_ENK.to(x_NK.dtype), counts_E)
