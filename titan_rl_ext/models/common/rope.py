"""Rotary embedding tables with a partial rotary factor (rotate_half convention on the first dims; applied by
``kernels.rows.rms_norm_rotary`` together with the q/k norm).

Qwen3.5's multimodal RoPE interleaves t/h/w frequency sections; for text every token's t/h/w
positions are equal, which makes it identical to this 1-D rotary -- text serving needs nothing more.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from titan_rl_ext.kernels import ops


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, partial_rotary_factor: float = 1.0) -> None:
        super().__init__()
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        if self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise ValueError(f"rotary dim {self.rotary_dim} (head_dim {head_dim} x {partial_rotary_factor}) must be even and > 0")
        self.theta = theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        return 1.0 / (self.theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim))

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        # inv_freq stays fp32 under model.to(bf16): rounding it would shift every rotary angle.
        out = super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = self._inv_freq().to(self.inv_freq.device)
        return out

    def reset_parameters(self) -> None:
        # buffers created on the meta device need recomputing once materialised
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)

    def forward(self, positions_T: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[T, rotary_dim]``, computed in fp32 and cast to the activation dtype (as HF does)."""
        freqs = positions_T[:, None].float() * self.inv_freq.float()[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return ops.cos(emb).to(dtype), ops.sin(emb).to(dtype)
