"""The policy-gradient pass of a step, in loss chunks: forward, loss and backward over at most
``max_tokens`` tokens at a time (whole samples, in order), so long multi-turn samples fit in activation
memory. Each chunk's loss is normalised by the step's global count (``norm``: ``num_global_valid_tokens``
or ``num_global_seqs``), so the chunks' gradients add up to the one-pass gradient, up to float summation
order. The logprobs a chunk computes are bit-equal to the one-pass ones under batch invariance (a
row's bits do not depend on the rows packed with it), which keeps the parity metrics exact."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def loss_chunks(lengths: Sequence[int], max_tokens: int) -> list[tuple[int, int]]:
    """Consecutive ``[lo, hi)`` ranges of samples of at most ``max_tokens`` tokens each; a longer sample is a
    chunk of its own. ``max_tokens`` <= 0: one chunk."""
    if max_tokens <= 0 or not lengths:
        return [(0, len(lengths))]
    out, lo, size = [], 0, 0
    for i, n in enumerate(lengths):
        if i > lo and size + n > max_tokens:
            out.append((lo, i))
            lo, size = i, 0
        size += n
    out.append((lo, len(lengths)))
    return out


def forward_backward(model: torch.nn.Module, samples: Sequence[Any], adv_N: torch.Tensor, loss_fn: Any,
                     norm: dict[str, Any], max_tokens: int, old_logprobs: str = "generator", grad_scale: float = 1.0,
                     device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Backward of ``loss_fn`` over ``samples`` chunk by chunk (gradients accumulate in ``model``; each
    chunk's loss times ``grad_scale`` is what is backpropagated). ``adv_N``: one advantage per sample.
    Returns the detached logprobs ``[T]`` in ``pack_samples``' layout of all ``samples``, the summed loss
    and its metrics (token-weighted means over the chunks)."""
    from titan_rl_ext.models.common.batch import SeqBatch
    from titan_rl_ext.rl.advantages import broadcast_to_tokens
    from titan_rl_ext.rl.logprobs import token_logprobs
    from titan_rl_ext.rl.samples import pack_samples

    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    lps, loss, parts = [], torch.zeros((), device=device), []
    for lo, hi in loss_chunks(lengths, max_tokens):
        pk = pack_samples(samples[lo:hi], device=device)
        seqs = SeqBatch.from_lengths(pk.lengths, device=device)
        lp_new_T = token_logprobs(model, pk.tokens_T, seqs)
        adv_T = broadcast_to_tokens(adv_N[lo:hi], lengths=pk.lengths, mask_T=pk.loss_mask_T)
        lp_old_T = pk.gen_logprobs_T if old_logprobs == "generator" else lp_new_T.detach()
        chunk_loss, m = loss_fn(lp_new_T, lp_old_T, adv_T, pk.loss_mask_T, cu_seqlens=seqs.cu_seqlens,
                                lp_gen_T=pk.gen_logprobs_T, **norm)
        (chunk_loss * grad_scale).backward()
        lps.append(lp_new_T.detach())
        loss = loss + chunk_loss.detach()
        parts.append((int(pk.loss_mask_T.sum()), m))
    return torch.cat(lps), loss, _token_weighted(parts)


def _token_weighted(parts: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """The chunks' metrics as one pass's: ``num_tokens`` summed, every other one (a masked mean over the
    chunk's loss tokens) weighted by its chunk's loss tokens. One chunk: its metrics as they are."""
    if len(parts) == 1:
        return parts[0][1]
    total = max(1, sum(n for n, _ in parts))
    out: dict[str, Any] = {}
    for k in parts[0][1]:
        vals = [(n, m[k]) for n, m in parts if k in m]
        out[k] = sum(v for _, v in vals) if k == "num_tokens" else sum(n * v for n, v in vals) / total
    return out
