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
        out_TD = torch.zeros_like(x_TD)
        # Visit experts in ascending id order and accumulate with index_add_: a fixed summation order
        # per token, independent of which other tokens share the batch.
        for e in torch.unique(top_i).tolist():
            tok, slot = torch.where(top_i == e)
            h = x_TD[tok]
            h = ops.silu(ops.linear(h, self.w1[e])) * ops.linear(h, self.w3[e])
            h = ops.linear(h, self.w2[e]) * top_w[tok, slot, None]
            out_TD.index_add_(0, tok, h.to(out_TD.dtype))
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
