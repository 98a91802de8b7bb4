from __future__ import annotations

import torch
import torch.nn as nn

from titan_rl_ext.kernels import ops


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)`` (w1 = gate_proj, w3 = up_proj, w2 = down_proj)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = ops.Linear(dim, hidden_dim, bias=False)
        self.w2 = ops.Linear(hidden_dim, dim, bias=False)
        self.w3 = ops.Linear(dim, hidden_dim, bias=False)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.w2(ops.silu(self.w1(x_TD)) * self.w3(x_TD))
