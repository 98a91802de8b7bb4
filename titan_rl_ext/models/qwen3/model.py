"""Qwen3 dense and Qwen3-MoE: plain GQA attention with q/k RMSNorm, full rotary."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from titan_rl_ext.models.common.decoder import DecoderConfig
from titan_rl_ext.models.common.hf_config import rope_settings, tie_embeddings
from titan_rl_ext.models.common.moe import MoEConfig


@dataclass
class Qwen3Config(DecoderConfig):
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Qwen3Config:
        if hf.get("use_sliding_window"):
            raise NotImplementedError("Qwen3 with use_sliding_window=true is not supported")
        theta, partial = rope_settings(hf, default_partial=1.0)
        moe = None
        # transformers 5 writes `num_local_experts`; older Qwen3-MoE configs say `num_experts`
        num_experts = hf.get("num_experts") or hf.get("num_local_experts")
        if num_experts:
            moe = MoEConfig(
                num_experts=num_experts,
                top_k=hf["num_experts_per_tok"],
                expert_ffn_dim=hf["moe_intermediate_size"],
                norm_topk_prob=hf.get("norm_topk_prob", False),
                sparse_step=hf.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            )
        return cls(
            vocab_size=hf["vocab_size"],
            dim=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf["num_key_value_heads"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            ffn_dim=hf.get("intermediate_size", 0) or 0,
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            partial_rotary_factor=partial,
            tie_embeddings=tie_embeddings(hf),
            attention_bias=hf.get("attention_bias", False),
            moe=moe,
        )
