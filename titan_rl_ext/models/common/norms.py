"""RMSNorm variants of the Qwen family. Statistics always in fp32; the math is in ``kernels.rows``."""

from __future__ import annotations

import torch
import torch.nn as nn

from titan_rl_ext.kernels import rows


class RMSNorm(nn.Module):
    """``zero_centered=True`` (Qwen3.5): ``(x_hat * (1 + w)).to(dtype)``, weight initialised to 0.
    ``zero_centered=False`` (Qwen3): ``w * x_hat.to(dtype)``, weight initialised to 1.
    The two casting orders differ in low precision; each mirrors its HF reference exactly."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight) if self.zero_centered else nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rows.rms_norm(x, self.weight, self.eps, self.zero_centered)

    def add_norm(self, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream's add and this norm: ``(x + h, norm(x + h))``, one kernel on CUDA."""
        return rows.add_rms_norm(x, h, self.weight, self.eps, self.zero_centered)

    def with_rotary(self, x_TND: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
        """The norm, then the rotate-half rotary embedding of its first ``R`` dims (the attention's q/k path), as
        one kernel on CUDA."""
        return rows.rms_norm_rotary(x_TND, self.weight, cos_TR, sin_TR, self.eps, self.zero_centered)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, zero_centered={self.zero_centered}"


class GatedRMSNorm(nn.Module):
    """GDN output norm: plain (not zero-centred) weight, then a SiLU gate; ``w * x_hat.to(dtype) * silu(z)``."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return rows.gated_rms_norm(x, gate, self.weight, self.eps)
