"""The paged-KV attention kernel installed into each titan full-attention layer.

The titan ``Attention`` layer keeps its projections, q/k norms, rotary and output gate; this module
fills its ``kernel`` slot with vLLM's own ``Attention`` layer, so keys/values go to vLLM's paged KV
cache and the attention backend of the platform runs (CPU_ATTN on CPU, FlashAttention/Triton on GPU).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from titan_rl_ext.models.common.attention import KVState
from titan_rl_ext.models.common.batch import SeqBatch
from vllm_titan_plugin import compat


class VllmAttentionKernel(nn.Module):
    """``kernel(q_TNH, k_TKH, v_TKH, batch, state) -> (o_TNH, state)`` backed by vLLM's ``Attention``.

    vLLM keeps the cache and reads per-layer metadata from its forward context, keyed by the wrapped
    layer's ``prefix``; the titan ``SeqBatch`` and ``KVState`` are not needed and pass through.
    """

    def __init__(
        self,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        scale: float,
        *,
        cache_config: object,
        prefix: str,
    ) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        # prefix must be this module's path in the vLLM model: it keys the KV cache and metadata
        self.attn = compat.Attention(
            num_heads=n_heads,
            head_size=head_dim,
            scale=scale,
            num_kv_heads=n_kv_heads,
            cache_config=cache_config,
            prefix=f"{prefix}.attn",
        )

    def forward(
        self,
        q_TNH: torch.Tensor,
        k_TKH: torch.Tensor,
        v_TKH: torch.Tensor,
        batch: SeqBatch,
        state: KVState | None,
    ) -> tuple[torch.Tensor, KVState | None]:
        T = q_TNH.shape[0]
        o_TF = self.attn(q_TNH.reshape(T, -1), k_TKH.reshape(T, -1), v_TKH.reshape(T, -1))
        return o_TF.view(T, self.n_heads, self.head_dim), state
