"""The norms', SwiGLU's and the output gate's backward kernels beside their torch references, as (reference, inputs, backward)
triples, for the CPU interpreter checks and the GPU test alike. Each backward returns one gradient per input."""

from __future__ import annotations

from typing import Any, Callable

import torch

Case = tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...], Callable[..., tuple[torch.Tensor, ...]]]


def row_grad_cases(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor) -> dict[str, Case]:
    from titan_rl_ext.kernels import rows
    from titan_rl_ext.kernels import rows_triton as rt

    def gated_bwd(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> tuple[Any, ...]:
        dx, dw, dz = rt.norm_rows_backward(x, w, 1e-6, 2, dy, gate=z)
        return dx, dz, dw

    return {
        "rms_zc": (lambda x, w: rows.rms_norm_torch(x, w, 1e-6, True), (x, w),
                   lambda x, w, dy: rt.norm_rows_backward(x, w, 1e-6, 1, dy)[:2]),
        "rms": (lambda x, w: rows.rms_norm_torch(x, w, 1e-6, False), (x, w),
                lambda x, w, dy: rt.norm_rows_backward(x, w, 1e-6, 0, dy)[:2]),
        "gated": (lambda x, z, w: rows.gated_rms_norm_torch(x, z, w, 1e-6), (x, z, w), gated_bwd),
        "l2": (lambda x: rows.l2norm_torch(x), (x,), lambda x, dy: rt.norm_rows_backward(x, None, 1e-6, 3, dy)[:1]),
        "silu_mul": (rows.silu_mul_torch, (x, z), rt.silu_mul_backward),
        "sigmoid_mul": (rows.sigmoid_mul_torch, (x, z), rt.sigmoid_mul_backward),
    }


def reference_grads(ref: Callable[..., torch.Tensor], ins: tuple[torch.Tensor, ...], dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Autograd of ``ref`` at ``ins`` (every input differentiated)."""
    leaves = [t.detach().requires_grad_(True) for t in ins]
    return torch.autograd.grad(ref(*leaves), leaves, dy)
