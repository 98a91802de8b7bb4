"""Qwen3.5 text model (dense and MoE): hybrid Gated DeltaNet + gated full attention."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from titan_rl_ext.kernels.gdn import GDNMode
from titan_rl_ext.models.common.decoder import FULL_ATTENTION, LINEAR_ATTENTION, DecoderConfig
from titan_rl_ext.models.common.hf_config import rope_settings, text_config, tie_embeddings
from titan_rl_ext.models.common.moe import MoEConfig
from titan_rl_ext.models.qwen3_5.gdn import GatedDeltaNet, GDNConfig


def hybrid_layer_types(n_layers: int, full_attention_interval: int) -> list[str]:
    return [FULL_ATTENTION if (i + 1) % full_attention_interval == 0 else LINEAR_ATTENTION for i in range(n_layers)]


@dataclass
class Qwen3_5Config(DecoderConfig):
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10_000_000.0
    attn_output_gate: bool = True
    zero_centered_norm: bool = True
    gdn: GDNConfig = field(default_factory=lambda: GDNConfig(16, 32, 128, 128, 4))
    # token-mixing kernel of the GDN layers: "chunk" (fast) or "recurrent" (reference / batch-invariant)
    gdn_mode: GDNMode = "chunk"

    def build_mixer(self, layer_idx: int) -> nn.Module:
        if self.layer_types[layer_idx] == LINEAR_ATTENTION:
            return GatedDeltaNet(self.dim, self.gdn, self.norm_eps, self.gdn_mode)
        return super().build_mixer(layer_idx)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Qwen3_5Config:
        tc = text_config(hf)
        n_layers = tc["num_hidden_layers"]
        layer_types = tc.get("layer_types") or hybrid_layer_types(n_layers, tc.get("full_attention_interval", 4))
        theta, partial = rope_settings(tc, default_partial=0.25)
        moe = None
        num_experts = tc.get("num_experts") or tc.get("num_local_experts")
        if num_experts:
            moe = MoEConfig(
                num_experts=num_experts,
                top_k=tc["num_experts_per_tok"],
                expert_ffn_dim=tc["moe_intermediate_size"],
                shared_ffn_dim=tc.get("shared_expert_intermediate_size", 0) or 0,
                norm_topk_prob=True,  # Qwen3.5-MoE always renormalises the top-k weights
            )
        return cls(
            vocab_size=tc["vocab_size"],
            dim=tc["hidden_size"],
            n_layers=n_layers,
            n_heads=tc["num_attention_heads"],
            n_kv_heads=tc["num_key_value_heads"],
            head_dim=tc.get("head_dim") or tc["hidden_size"] // tc["num_attention_heads"],
            ffn_dim=tc.get("intermediate_size", 0) or 0,
            norm_eps=tc.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            partial_rotary_factor=partial,
            tie_embeddings=tie_embeddings(hf),
            attention_bias=tc.get("attention_bias", False),
            layer_types=list(layer_types),
            moe=moe,
            gdn=GDNConfig(
                n_k_heads=tc["linear_num_key_heads"],
                n_v_heads=tc["linear_num_value_heads"],
                k_head_dim=tc["linear_key_head_dim"],
                v_head_dim=tc["linear_value_head_dim"],
                conv_kernel=tc.get("linear_conv_kernel_dim", 4),
            ),
        )
