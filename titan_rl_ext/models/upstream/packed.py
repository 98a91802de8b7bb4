"""The trainer side of an upstream torchtitan model: packed sequences in, per-token logprobs out.

``PackedAttention`` fills each attention module's ``inner_attention``: torchtitan hands it q/k/v as
``[1, T, N, H]`` after its projections, norms and rotary, with ``attention_masks`` passed through from
``model(tokens, positions=..., attention_masks=...)``: here a ``SeqBatch`` (sequence bounds). Each sequence
attends causally to itself through the trainer's ``packed_causal_attention`` (under batch invariance the
kernels the plugin runs over vLLM's paged cache: same bits; otherwise FlashAttention varlen or SDPA).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn as nn

from titan_rl_ext.kernels import batch_invariant as bi
from titan_rl_ext.kernels.lm_head import torch_log_softmax
from titan_rl_ext.kernels.varlen_attention import packed_causal_attention
from titan_rl_ext.models.common.batch import SeqBatch
from titan_rl_ext.models.upstream.bi_ops import BatchInvariantOps
from titan_rl_ext.models.upstream.build import attention_modules


class PackedAttention(nn.Module):
    def __init__(self, head_dim: int, scale: float | None) -> None:
        super().__init__()
        self.scale = head_dim**-0.5 if scale is None else scale

    def forward(self, q_BTNH: torch.Tensor, k_BTKH: torch.Tensor, v_BTKH: torch.Tensor, *,
                attention_masks: SeqBatch | None = None, scale: float | None = None, enable_gqa: bool = False,
                **_: Any) -> torch.Tensor:
        if q_BTNH.shape[0] != 1 or not isinstance(attention_masks, SeqBatch):
            raise ValueError("PackedAttention takes one packed row [1, T, N, H] and the SeqBatch as attention_masks")
        s = self.scale if scale is None else scale
        out = packed_causal_attention(q_BTNH[0], k_BTKH[0], v_BTKH[0], attention_masks.cu_seqlens,
                                      attention_masks.max_seqlen, s)
        return out[None]


def install_packed_attention(model: nn.Module) -> nn.Module:
    """Fill every ``inner_attention`` slot of a torchtitan model with ``PackedAttention``."""
    for _, m in attention_modules(model):
        m.inner_attention = PackedAttention(m.head_dim, getattr(m, "scaling", None))
    return model


def token_logprobs(model: nn.Module, tokens_T: torch.Tensor, batch: SeqBatch) -> torch.Tensor:
    """``lp[t] = log p(tokens[t] | the tokens of its sequence before t)``, NaN at each sequence's first
    token; fp32 logits and the log-softmax call vLLM's sampler makes, as ``rl.logprobs.token_logprobs``."""
    with BatchInvariantOps() if bi.is_batch_invariant() else contextlib.nullcontext():
        logits = model(tokens_T[None], positions=batch.positions[None], attention_masks=batch)[0]
    lp_TV = torch_log_softmax(logits.float())
    return batch.rows_to_next_tokens(lp_TV.gather(1, tokens_T.roll(-1)[:, None]).squeeze(1))


def load_hf(model_dir: str, spec: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> nn.Module:
    """The trainer's copy of an HF checkpoint in torchtitan's definition: weights through the spec's
    adapter (strict), ``PackedAttention`` in every attention module."""
    from titan_rl_ext.models.hf import read_config, read_safetensors
    from titan_rl_ext.models.upstream.build import build, check_architecture, spec_name

    hf = read_config(model_dir)
    name = spec_name(spec)
    check_architecture(name, (hf.get("architectures") or ["?"])[0])
    model, adapter = build(name, hf)
    sd = {k: v for k, v in adapter.from_hf(read_safetensors(model_dir)).items() if v is not None}
    model.load_state_dict(sd, strict=True)
    model.to(device=device)
    for p in model.parameters():  # not Module.to(dtype): that would cast the complex rotary cache to real
        p.data = p.data.to(dtype)
    return install_packed_attention(model).eval()
