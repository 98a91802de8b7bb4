"""Qwen3.5 flavors: the published text dimensions, and debug sizes for tests and CPU runs."""

from __future__ import annotations

from titan_rl_ext.models.common.moe import MoEConfig
from titan_rl_ext.models.qwen3_5.gdn import GDNConfig
from titan_rl_ext.models.qwen3_5.model import Qwen3_5Config, hybrid_layer_types

QWEN3_5_VOCAB = 248_320


def qwen3_5_flavors() -> dict[str, Qwen3_5Config]:
    return {
        # text part of Qwen/Qwen3.5-9B: 8 x [3 GDN + 1 gated full attention]
        "qwen3_5-9b": Qwen3_5Config(
            vocab_size=QWEN3_5_VOCAB, dim=4096, n_layers=32, n_heads=16, n_kv_heads=4, head_dim=256,
            ffn_dim=12288, rope_theta=1e7, partial_rotary_factor=0.25,
            layer_types=hybrid_layer_types(32, 4), gdn=GDNConfig(16, 32, 128, 128, 4),
        ),
        # text part of Qwen/Qwen3.5-35B-A3B: 256 experts top-8 + gated shared expert, every layer MoE
        "qwen3_5-35b-a3b": Qwen3_5Config(
            vocab_size=QWEN3_5_VOCAB, dim=2048, n_layers=40, n_heads=16, n_kv_heads=2, head_dim=256,
            ffn_dim=0, rope_theta=1e7, partial_rotary_factor=0.25,
            layer_types=hybrid_layer_types(40, 4), gdn=GDNConfig(16, 32, 128, 128, 4),
            moe=MoEConfig(num_experts=256, top_k=8, expert_ffn_dim=512, shared_ffn_dim=512),
        ),
        "qwen3_5-debug": Qwen3_5Config(
            vocab_size=512, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=128,
            layer_types=hybrid_layer_types(4, 2), gdn=GDNConfig(2, 4, 16, 16, 4),
        ),
        "qwen3_5-moe-debug": Qwen3_5Config(
            vocab_size=512, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=0,
            layer_types=hybrid_layer_types(4, 2), gdn=GDNConfig(2, 4, 16, 16, 4),
            moe=MoEConfig(num_experts=8, top_k=2, expert_ffn_dim=32, shared_ffn_dim=48),
        ),
    }
