"""Group-relative advantages (GRPO family) and their broadcast to packed tokens.

For a prompt sampled G times with rewards ``r_1..r_G`` (one group)::

    A_i = r_i - mean_g(r)                              (Dr.GRPO: no std, ``normalize_std=False``)
    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)         (GRPO: ``normalize_std=True``)

``std_g`` is the unbiased (Bessel, ``/(G-1)``) standard deviation by default, as in DeepSeekMath's
GRPO and the common open implementations; ``unbiased_std=False`` gives the population one.
A group whose rewards are all equal gets exactly zero advantage (no learning signal, no NaN): its
deviations are set to 0 explicitly, because ``r - mean`` of equal floats is not always exactly 0
(``mean(0.1, 0.1, 0.1) != 0.1`` in floating point) and dividing that rounding residue by ``eps``
would invent a large advantage. A group of one sample likewise gets 0.

Tokens: ``broadcast_to_tokens`` repeats each sequence's advantage over its tokens (packed layout of
``SeqBatch.cu_seqlens``) and zeroes it outside the loss mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["group_ids_from_size", "group_advantages", "zero_variance_groups", "broadcast_to_tokens"]


def group_ids_from_size(num_samples: int, group_size: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[N]`` group index for the contiguous layout (samples ``g*G .. g*G+G-1`` share a prompt)."""
    if group_size <= 0 or num_samples % group_size:
        raise ValueError(f"{num_samples} samples do not split into groups of {group_size}")
    return torch.arange(num_samples, device=device) // group_size


def _group_ids(rewards_N: torch.Tensor, group_size: int | None, group_ids_N: torch.Tensor | None) -> torch.Tensor:
    if (group_size is None) == (group_ids_N is None):
        raise ValueError("give exactly one of group_size (contiguous groups) or group_ids_N")
    if group_ids_N is None:
        assert group_size is not None
        return group_ids_from_size(rewards_N.numel(), group_size, rewards_N.device)
    if tuple(group_ids_N.shape) != tuple(rewards_N.shape):
        raise ValueError(f"group_ids_N shape {tuple(group_ids_N.shape)} != rewards_N shape {tuple(rewards_N.shape)}")
    return group_ids_N.to(device=rewards_N.device, dtype=torch.long)


def group_advantages(
    rewards_N: torch.Tensor,
    group_size: int | None = None,
    *,
    group_ids_N: torch.Tensor | None = None,
    normalize_std: bool = True,
    eps: float = 1e-6,
    unbiased_std: bool = True,
) -> torch.Tensor:
    """Per-sample advantages ``[N]`` (float32 at least) from per-sample rewards ``[N]``.

    Groups are either contiguous blocks of ``group_size`` or given by ``group_ids_N`` (any ints;
    groups may differ in size). ``A = r - mean_g``; with ``normalize_std`` also ``/ (std_g + eps)``.
    Groups whose rewards are all equal (including groups of one) get ``A = 0`` exactly.
    """
    if rewards_N.dim() != 1:
        raise ValueError(f"rewards_N must be 1-D, got shape {tuple(rewards_N.shape)}")
    r_N = rewards_N.detach().to(torch.promote_types(rewards_N.dtype, torch.float32))
    if r_N.numel() == 0:
        return r_N.clone()
    gid_N = _group_ids(r_N, group_size, group_ids_N)
    # compact arbitrary ids to 0..K-1 so the segment sums below are dense
    _, gid_N = torch.unique(gid_N, return_inverse=True)
    K = int(gid_N.max()) + 1

    cnt_K = r_N.new_zeros(K).index_add(0, gid_N, torch.ones_like(r_N))
    mean_K = r_N.new_zeros(K).index_add(0, gid_N, r_N) / cnt_K
    dev_N = r_N - mean_K[gid_N]

    # all-equal groups: exact zero (see module docstring); compared on the raw rewards, not on dev
    max_K = r_N.new_full((K,), float("-inf")).scatter_reduce(0, gid_N, r_N, "amax")
    min_K = r_N.new_full((K,), float("inf")).scatter_reduce(0, gid_N, r_N, "amin")
    flat_N = (max_K == min_K)[gid_N]
    dev_N = torch.where(flat_N, 0, dev_N)
    if not normalize_std:
        return dev_N

    ddof = 1 if unbiased_std else 0
    var_K = r_N.new_zeros(K).index_add(0, gid_N, dev_N * dev_N) / (cnt_K - ddof).clamp(min=1)
    std_N = var_K.sqrt()[gid_N]
    return dev_N / (std_N + eps)


def zero_variance_groups(
    rewards_N: torch.Tensor, group_size: int | None = None, *, group_ids_N: torch.Tensor | None = None
) -> torch.Tensor:
    """``[N]`` bool: the sample's group has all-equal rewards (zero advantage, no gradient signal).

    DAPO's dynamic sampling drops these groups and samples more prompts; the fraction is also a
    useful metric of how saturated (all right / all wrong) the batch is."""
    r_N = rewards_N.detach()
    if r_N.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=r_N.device)
    _, gid_N = torch.unique(_group_ids(r_N, group_size, group_ids_N), return_inverse=True)
    K = int(gid_N.max()) + 1
    rf_N = r_N.to(torch.promote_types(r_N.dtype, torch.float32))
    max_K = rf_N.new_full((K,), float("-inf")).scatter_reduce(0, gid_N, rf_N, "amax")
    min_K = rf_N.new_full((K,), float("inf")).scatter_reduce(0, gid_N, rf_N, "amin")
    return (max_K == min_K)[gid_N]


def broadcast_to_tokens(
    adv_N: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    *,
    lengths: Sequence[int] | torch.Tensor | None = None,
    mask_T: torch.Tensor | None = None,
) -> torch.Tensor:
    """``adv_T[t] = adv_N[seq(t)]`` for packed sequences, 0 where ``mask_T`` is False.

    Sequences are given by ``cu_seqlens`` ``[N+1]`` (``SeqBatch.cu_seqlens``) or ``lengths`` ``[N]``;
    sequence i covers tokens ``cu_seqlens[i] .. cu_seqlens[i+1]-1`` (prompt and completion)."""
    if (cu_seqlens is None) == (lengths is None):
        raise ValueError("give exactly one of cu_seqlens or lengths")
    if lengths is None:
        assert cu_seqlens is not None
        cu = cu_seqlens.to(device=adv_N.device, dtype=torch.long)
        lengths_N = cu[1:] - cu[:-1]
    else:
        lengths_N = torch.as_tensor(lengths, dtype=torch.long, device=adv_N.device)
    if lengths_N.numel() != adv_N.numel():
        raise ValueError(f"{adv_N.numel()} advantages for {lengths_N.numel()} sequences")
    adv_T = torch.repeat_interleave(adv_N, lengths_N)
    if mask_T is not None:
        if tuple(mask_T.shape) != tuple(adv_T.shape):
            raise ValueError(f"mask_T shape {tuple(mask_T.shape)} != token count {adv_T.numel()}")
        adv_T = torch.where(mask_T.to(torch.bool), adv_T, 0)
    return adv_T
