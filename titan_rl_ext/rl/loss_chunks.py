"""The policy-gradient pass of a step, in loss chunks: forward, loss and backward over at most
``max_tokens`` tokens at a time (whole samples, in order), so long multi-turn samples fit in activation
memory. Each chunk's loss is normalised by the step's global count (``norm``: ``num_global_valid_tokens``
or ``num_global_seqs``), so the chunks' gradients add up to the one-pass gradient, up to float summation
order. The logprobs a chunk computes are bit-equal to the one-pass ones under batch invariance (a
row's bits do not depend on the rows packed with it), which keeps the parity metrics exact."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
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


def packed_chunks(packed: Any, max_tokens: int) -> Iterator[tuple[int, int, slice, Any]]:
    """Per loss chunk of ``packed`` (``pack_samples``): ``(lo, hi, token slice, SeqBatch)`` -- its samples'
    range, their tokens' range in ``packed``'s layout and the chunk's sequence bounds on ``packed``'s device."""
    from titan_rl_ext.models.common.batch import SeqBatch

    starts = list(itertools.accumulate(packed.lengths, initial=0))
    for lo, hi in loss_chunks(packed.lengths, max_tokens):
        yield lo, hi, slice(starts[lo], starts[hi]), SeqBatch.from_lengths(packed.lengths[lo:hi],
                                                                           device=packed.tokens_T.device)


def forward_backward(model: torch.nn.Module, packed: Any, adv_N: torch.Tensor, loss_fn: Any, norm: dict[str, Any],
                     max_tokens: int, old_logprobs: str = "generator",
                     grad_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Backward of ``loss_fn`` over the samples of ``packed`` (``pack_samples``) chunk by chunk, each chunk a
    slice of it (gradients accumulate in ``model``; each chunk's loss times ``grad_scale`` is what is
    backpropagated). ``adv_N``: one advantage per sample. Returns the detached logprobs ``[T]`` in
    ``packed``'s layout, the summed loss and its metrics (token-weighted means over the chunks)."""
    from titan_rl_ext.rl.advantages import broadcast_to_tokens
    from titan_rl_ext.rl.logprobs import token_logprobs

    lps, loss, parts = [], torch.zeros((), device=packed.tokens_T.device), []
    for lo, hi, t, seqs in packed_chunks(packed, max_tokens):
        lengths = packed.lengths[lo:hi]
        tokens_T, mask_T, lp_gen_T = packed.tokens_T[t], packed.loss_mask_T[t], packed.gen_logprobs_T[t]
        lp_new_T = token_logprobs(model, tokens_T, seqs)
        adv_T = broadcast_to_tokens(adv_N[lo:hi], lengths=lengths, mask_T=mask_T)
        lp_old_T = lp_gen_T if old_logprobs == "generator" else lp_new_T.detach()
        chunk_loss, m = loss_fn(lp_new_T, lp_old_T, adv_T, mask_T, cu_seqlens=seqs.cu_seqlens, lp_gen_T=lp_gen_T,
                                **norm)
        (chunk_loss * grad_scale).backward()
        lps.append(lp_new_T.detach())
        loss = loss + chunk_loss.detach()
        parts.append((int(mask_T.sum()), m))
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
