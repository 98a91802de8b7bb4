"""The handful of ops whose bits can depend on batch composition, behind the batch-invariance switch.

Layers call these instead of the torch functions. With batch invariance off they are the stock torch
ops; with it on (``titan_rl_ext.kernels.batch_invariant.set_batch_invariant(True)``) they route to
the batch-invariant versions. Exact ops (add, mul, gather, topk, index_add in a fixed order) need
no wrapper: IEEE rounding makes them independent of what else is in the tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_rl_ext.kernels import batch_invariant as bi


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return bi.linear(x, weight, bias) if bi.is_batch_invariant() else F.linear(x, weight, bias)


def _pointwise(fn):  # transcendental ops: vector and scalar-tail code paths round differently on CPU
    def op(x: torch.Tensor) -> torch.Tensor:
        if bi.is_batch_invariant() and not x.is_cuda:
            return bi.elementwise(fn, x)
        return fn(x)

    op.__name__ = getattr(fn, "__name__", "op")
    return op


def mean_sq(x: torch.Tensor) -> torch.Tensor:
    """``x.float().pow(2).mean(-1, keepdim=True)`` (RMSNorm statistics). BI mode: one fixed-order
    reduction per row (Triton on CUDA, where torch's reduction strategy depends on the row count)."""
    if bi.is_batch_invariant():
        return bi.row_mean_sq(x).unsqueeze(-1)
    return x.float().pow(2).mean(-1, keepdim=True)


def sum_sq(x: torch.Tensor) -> torch.Tensor:
    """``(x * x).sum(-1, keepdim=True)`` in fp32 (l2norm); batch invariant like ``mean_sq``."""
    if bi.is_batch_invariant():
        return bi.row_sum_sq(x).unsqueeze(-1)
    xf = x.float()
    return (xf * xf).sum(dim=-1, keepdim=True)


silu = _pointwise(F.silu)
sigmoid = _pointwise(torch.sigmoid)
softplus = _pointwise(F.softplus)
rsqrt = _pointwise(torch.rsqrt)
exp = _pointwise(torch.exp)
cos = _pointwise(torch.cos)
sin = _pointwise(torch.sin)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and names) whose matmul honours the batch-invariance switch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of one input as one GEMM (one launch, one read of the input): the output columns
    are the parts back to back, ``split`` cuts them apart. Each part keeps its own checkpoint tensor: the
    state-dict adapter concatenates HF's split weights into this one and splits it back (``parts``). In
    batch-invariant mode a column's bits do not depend on the columns beside it, so merging changes none."""

    def __init__(self, in_features: int, parts: Sequence[int], bias: bool = False) -> None:
        if not parts or any(n <= 0 for n in parts):
            raise ValueError(f"MergedLinear needs positive part sizes, got {list(parts)}")
        super().__init__(in_features, sum(parts), bias=bias)
        self.parts = tuple(int(n) for n in parts)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.split(y, self.parts, dim=-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, parts={self.parts}"
