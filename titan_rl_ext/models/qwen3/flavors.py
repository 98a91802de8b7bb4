"""Qwen3 flavors: published dense/MoE dimensions and debug sizes."""

from __future__ import annotations

from titan_rl_ext.models.common.moe import MoEConfig
from titan_rl_ext.models.qwen3.model import Qwen3Config


def qwen3_flavors() -> dict[str, Qwen3Config]:
    return {
        "qwen3-0.6b": Qwen3Config(
            vocab_size=151_936, dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128,
            ffn_dim=3072, rope_theta=1e6, tie_embeddings=True,
        ),
        "qwen3-8b": Qwen3Config(
            vocab_size=151_936, dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128,
            ffn_dim=12288, rope_theta=1e6,
        ),
        "qwen3-30b-a3b": Qwen3Config(
            vocab_size=151_936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
            ffn_dim=6144, rope_theta=1e6,
            moe=MoEConfig(num_experts=128, top_k=8, expert_ffn_dim=768, norm_topk_prob=True),
        ),
        "qwen3-debug": Qwen3Config(
            vocab_size=512, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
        ),
    }
