"""The trainer's per-token logprobs of rollouts -- the function the RL losses use.

It is bit-compatible with what vLLM reports for sampled tokens when both sides run the titan model
in batch-invariant mode: same model code, fp32 LM head (``kernels.lm_head.head_logits_fp32``), and the
same log-softmax call vLLM's sampler makes for raw logprobs (``logits.log_softmax(dim=-1,
dtype=torch.float32)``), applied row chunk by row chunk so no ``[T, V]`` fp32 tensor exists.
"""

from __future__ import annotations

import torch

from titan_rl_ext.kernels.lm_head import torch_log_softmax
from titan_rl_ext.models.common.batch import SeqBatch
from titan_rl_ext.models.common.decoder import Decoder


def logprobs_from_logits(logits_TV: torch.Tensor) -> torch.Tensor:
    return torch_log_softmax(logits_TV)


def token_logprobs(model: Decoder, tokens_T: torch.Tensor, batch: SeqBatch, fp32_head: bool = True) -> torch.Tensor:
    """``lp[t] = log p(tokens[t] | tokens of its sequence before t)`` for packed sequences ``[T]``;
    the first token of every sequence has no context and gets NaN. Differentiable.

    With the fp32 head (the default, and what parity needs) the logprobs come from
    ``Decoder.packed_token_logprobs``: bit for bit ``log_softmax(fp32 logits)[token]``, without a
    ``[T, V]`` tensor."""
    if tokens_T.shape[0] == 0:
        return torch.zeros(0, dtype=torch.float32, device=tokens_T.device)
    targets_T = tokens_T.roll(-1)  # row t scores the token after it; rows ending a sequence are unused
    if fp32_head:
        lp_rows = model.packed_token_logprobs(tokens_T, batch, targets_T)
    else:
        lp_TV = logprobs_from_logits(model.packed_logits(tokens_T, batch, fp32=False))
        lp_rows = lp_TV.gather(1, targets_T[:, None]).squeeze(1)
    return batch.rows_to_next_tokens(lp_rows)
