from __future__ import annotations

import torch
import torch.nn as nn

from titan_rl_ext.kernels import ops, rows


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(gate x) * up x)``. ``w13`` holds gate_proj and up_proj as one GEMM (parts
    ``[hidden, hidden]``); ``w2`` is down_proj."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w13 = ops.MergedLinear(dim, [hidden_dim, hidden_dim], bias=False)
        self.w2 = ops.Linear(hidden_dim, dim, bias=False)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        gate_TF, up_TF = self.w13.split(self.w13(x_TD))
        return self.w2(rows.silu_mul(gate_TF, up_TF))
