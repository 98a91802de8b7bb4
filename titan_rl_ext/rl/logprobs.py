"""The trainer's per-token logprobs of rollouts -- the function the RL losses use.

It is bit-compatible with what vLLM reports for sampled tokens when both sides run the titan model
in batch-invariant mode: same model code, fp32 LM head, and the same log-softmax call vLLM's sampler
makes for raw logprobs (``logits.log_softmax(dim=-1, dtype=torch.float32)``).
"""

from __future__ import annotations

import torch

from titan_rl_ext.models.common.batch import SeqBatch
from titan_rl_ext.models.common.decoder import Decoder


def logprobs_from_logits(logits_TV: torch.Tensor) -> torch.Tensor:
    return logits_TV.log_softmax(dim=-1, dtype=torch.float32)


def token_logprobs(model: Decoder, tokens_T: torch.Tensor, batch: SeqBatch, fp32_head: bool = True) -> torch.Tensor:
    """``lp[t] = log p(tokens[t] | tokens of its sequence before t)`` for packed sequences ``[T]``;
    the first token of every sequence has no context and gets NaN. Differentiable."""
    lp_TV = logprobs_from_logits(model.packed_logits(tokens_T, batch, fp32=fp32_head))
    T = tokens_T.shape[0]
    out = torch.full((T,), float("nan"), dtype=torch.float32, device=tokens_T.device)
    if T == 0:
        return out
    # position t is predicted by the logits at t-1 of the same sequence
    prev = torch.arange(T, device=tokens_T.device) - 1
    is_first = torch.zeros(T, dtype=torch.bool, device=tokens_T.device)
    is_first[batch.cu_seqlens[:-1].long().clamp(max=T - 1)] = True
    has_prev = ~is_first
    idx = prev[has_prev]
    out = out.index_put((has_prev.nonzero().flatten(),), lp_TV[idx, tokens_T[has_prev]])
    return out
