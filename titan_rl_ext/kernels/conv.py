"""Causal depthwise conv1d over packed sequences, with an optional carried state.

Layout: x ``[T, C]`` packed, weight ``[C, W]``, ``cu_seqlens`` ``[N+1]``; the state of a sequence is
its last ``W - 1`` inputs, ``[N, W-1, C]`` (time-major, like vLLM's conv cache). With no initial
state a sequence starts from zeros -- the same as left zero padding, which is what HF does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_torch(
    x_TC: torch.Tensor,
    weight_CW: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bias_C: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    if x_TC.dim() != 2 or weight_CW.dim() != 2 or weight_CW.shape[0] != x_TC.shape[1]:
        raise ValueError(f"expected x [T, C] and weight [C, W]; got {tuple(x_TC.shape)}, {tuple(weight_CW.shape)}")
    T, C = x_TC.shape
    W = weight_CW.shape[1]
    bounds = cu_seqlens.tolist()
    N = len(bounds) - 1
    if bounds[-1] != T:
        raise ValueError(f"cu_seqlens ends at {bounds[-1]}, expected T={T}")
    if initial_state is not None and initial_state.shape != (N, W - 1, C):
        raise ValueError(f"conv state must be [N, W-1, C]={[N, W - 1, C]}; got {tuple(initial_state.shape)}")
    ys, states = [], []
    for n in range(N):
        xs = x_TC[bounds[n] : bounds[n + 1]]
        prefix = (
            initial_state[n].to(x_TC.dtype)
            if initial_state is not None
            else x_TC.new_zeros(W - 1, C)
        )
        full = torch.cat([prefix, xs], dim=0)  # [W-1+L, C]
        y = F.conv1d(full.t().unsqueeze(0), weight_CW.unsqueeze(1), bias_C, groups=C)  # [1, C, L]
        ys.append(y[0].t())
        states.append(full[full.shape[0] - (W - 1) :])
    y_TC = torch.cat(ys, dim=0) if ys else x_TC.new_zeros(0, C)
    if activation == "silu":
        y_TC = F.silu(y_TC)
    elif activation is not None:
        raise ValueError(f"unsupported activation {activation!r}")
    final = torch.stack(states) if states else x_TC.new_zeros(0, W - 1, C)
    return y_TC, final
