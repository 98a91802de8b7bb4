"""Top-k routed mixture of SwiGLU experts, with an optional sigmoid-gated shared expert (Qwen3.5-MoE)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from titan_rl_ext.kernels import ops
from titan_rl_ext.models.common.mlp import FeedForward


@dataclass
class MoEConfig:
    num_experts: int
    top_k: int
    expert_ffn_dim: int
    shared_ffn_dim: int = 0  # 0: no shared expert (Qwen3-MoE)
    norm_topk_prob: bool = True
    # which layers are sparse: layer i is MoE iff i not in mlp_only_layers and (i + 1) % sparse_step == 0
    sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.sparse_step == 0


class TopKRouter(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.gate = ops.Linear(dim, num_experts, bias=False)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (weights [T, k] in the activation dtype, expert ids [T, k]). Softmax in fp32."""
        logits_TE = self.gate(x_TD)
        probs_TE = F.softmax(logits_TE, dim=-1, dtype=torch.float)
        top_w, top_i = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_w.to(logits_TE.dtype), top_i


class GroupedExperts(nn.Module):
    """Expert weights stacked: ``w1``/``w3`` ``[E, I, D]`` (gate/up), ``w2`` ``[E, D, I]`` (down)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def reset_parameters(self, std: float = 0.02) -> None:
        for w in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(w, std=std)

    def forward(self, x_TD: torch.Tensor, top_w: torch.Tensor, top_i: torch.Tensor) -> torch.Tensor:
        """Every (token, slot) pair through its expert in one grouped GEMM per weight (``kernels.grouped_gemm``):
        pairs sorted by expert, the routing kept on the device (no host read: a decode step can be a CUDA
        graph). A token's expert outputs are then summed in ascending expert id, in the activation dtype,
        starting from the first: a fixed order per token, independent of which other tokens share the batch
        (the same sums, in the same order, as the per-expert loop this replaced)."""
        from titan_rl_ext.kernels.grouped_gemm import grouped_mm

        T, k = top_i.shape
        D = x_TD.shape[1]
        flat_e = top_i.reshape(-1)
        order = torch.argsort(flat_e, stable=True)  # pairs by expert, then by (token, slot)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x_TD.device)
        counts.scatter_add_(0, flat_e, torch.ones_like(flat_e))  # bincount would read its size on the host
        x_PD = x_TD[order // k]
        h = ops.silu(grouped_mm(x_PD, self.w1, counts)) * grouped_mm(x_PD, self.w3, counts)
        h = grouped_mm(h, self.w2, counts) * top_w.reshape(-1)[order, None]
        pairs = torch.empty_like(h).index_copy(0, order, h).view(T, k, D)  # back to (token, slot) order
        by_expert = torch.argsort(top_i, dim=1, stable=True)  # each token's slots in ascending expert id
        h_TkD = pairs.gather(1, by_expert[:, :, None].expand(T, k, D)).to(x_TD.dtype)
        out_TD = h_TkD[:, 0]
        for j in range(1, k):
            out_TD = out_TD + h_TkD[:, j]
        return out_TD


class MoE(nn.Module):
    def __init__(self, dim: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.router = TopKRouter(dim, cfg.num_experts, cfg.top_k, cfg.norm_topk_prob)
        self.experts = GroupedExperts(dim, cfg.expert_ffn_dim, cfg.num_experts)
        self.shared_expert = FeedForward(dim, cfg.shared_ffn_dim) if cfg.shared_ffn_dim else None
        self.shared_gate = ops.Linear(dim, 1, bias=False) if cfg.shared_ffn_dim else None

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        top_w, top_i = self.router(x_TD)
        out_TD = self.experts(x_TD, top_w, top_i)
        if self.shared_expert is not None:
            out_TD = out_TD + ops.sigmoid(self.shared_gate(x_TD)) * self.shared_expert(x_TD)
        return out_TD
