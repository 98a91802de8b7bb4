"""Batch-invariant causal attention for one sequence: fixed query tiles and fixed KV blocks, no split-KV.

A query's output must not depend on how many other queries share the call (prefill vs decode, how a
prefill was chunked) or on how many keys exist beyond its causal horizon. So:
- queries go in tiles of exactly ``Q_TILE`` rows and keys in blocks of exactly ``KV_BLOCK``: every
  matmul has one shape;
- two passes: the row max over all keys (max is exact in any order), then the KV blocks in ascending
  order, each adding ``exp(s - max)`` sums and ``p @ v`` into running fp32 accumulators. Blocks past
  a query's horizon are fully masked and add exact zeros, so a decode step that sees fewer blocks
  gets the same bits as the prefill that saw more.
The trainer (packed causal attention) and the engine (KV from its cache) both call this function on CPU.

``split_attention_reference`` is the plain-PyTorch form of the GPU kernel's definition
(``attention_triton``): splits of a fixed number of keys anchored at position 0, an online softmax over
each split's blocks, the splits' partials folded in ascending order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from titan_rl_ext.kernels.batch_invariant import elementwise

Q_TILE = 32
KV_BLOCK = 64
LOG2E = 1.4426950408889634


def attention_bi(
    q_TNH: torch.Tensor, k_SKH: torch.Tensor, v_SKH: torch.Tensor, q_start: int, scale: float
) -> torch.Tensor:
    """Causal attention of queries at absolute positions ``q_start .. q_start+T-1`` over keys
    ``0 .. S-1`` of one sequence (``S >= q_start + T``). GQA: query head h uses KV head h // (N // K).
    Returns ``[T, N, Hv]`` in the query dtype; math in fp32."""
    T, N, H = q_TNH.shape
    S, Kh, Hv = v_SKH.shape
    if k_SKH.shape[:2] != (S, Kh) or N % Kh:
        raise ValueError(f"bad shapes q {tuple(q_TNH.shape)} k {tuple(k_SKH.shape)} v {tuple(v_SKH.shape)}")
    if S < q_start + T:
        raise ValueError(f"{S} keys cannot cover queries up to position {q_start + T - 1}")
    if T == 0:
        return q_TNH.new_zeros(0, N, Hv)
    rep = N // Kh
    k = k_SKH.float().repeat_interleave(rep, dim=1).transpose(0, 1)  # [N, S, H]
    v = v_SKH.float().repeat_interleave(rep, dim=1).transpose(0, 1)  # [N, S, Hv]
    s_pad = (-S) % KV_BLOCK
    if s_pad:
        k = F.pad(k, (0, 0, 0, s_pad))
        v = F.pad(v, (0, 0, 0, s_pad))
    n_blocks = k.shape[1] // KV_BLOCK
    q = q_TNH.float().transpose(0, 1) * scale  # [N, T, H]
    t_pad = (-T) % Q_TILE
    if t_pad:
        q = F.pad(q, (0, 0, 0, t_pad))
    key_pos = torch.arange(k.shape[1], device=q.device)
    # Every bmm operand is made contiguous: GEMM libraries may pick another algorithm (and summation
    # order) for the same shape when batch strides differ, and slices of a longer or shorter sequence
    # have different strides.
    k_blocks = [k[:, b * KV_BLOCK : (b + 1) * KV_BLOCK].transpose(1, 2).contiguous() for b in range(n_blocks)]
    v_blocks = [v[:, b * KV_BLOCK : (b + 1) * KV_BLOCK].contiguous() for b in range(n_blocks)]
    outs = []
    for t0 in range(0, q.shape[1], Q_TILE):
        q_tile = q[:, t0 : t0 + Q_TILE].contiguous()  # [N, Q_TILE, H]
        # padded query rows reuse the last real position so no row is fully masked
        pos = (q_start + torch.arange(t0, t0 + Q_TILE, device=q.device)).clamp(max=q_start + T - 1)
        scores = []
        for b in range(n_blocks):
            s = torch.bmm(q_tile, k_blocks[b])  # [N, Q_TILE, KV_BLOCK]
            visible = key_pos[None, b * KV_BLOCK : (b + 1) * KV_BLOCK] <= pos[:, None]
            scores.append(s.masked_fill(~visible, float("-inf")))
        m = torch.stack([s.amax(dim=-1) for s in scores]).amax(dim=0)  # [N, Q_TILE]
        l_sum = torch.zeros_like(m)
        acc = q_tile.new_zeros(N, Q_TILE, Hv)
        for b, s in enumerate(scores):
            p = elementwise(torch.exp, s - m[..., None])
            l_sum = l_sum + p.sum(dim=-1)
            acc = acc + torch.bmm(p.contiguous(), v_blocks[b])
        outs.append(acc / l_sum[..., None])
    o = torch.cat(outs, dim=1)[:, :T]  # [N, T, Hv]
    return o.transpose(0, 1).to(q_TNH.dtype)


def causal_attention_reference(
    q_TNH: torch.Tensor, k_TKH: torch.Tensor, v_TKH: torch.Tensor, lengths: list[int], scale: float,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """Causal attention within each packed sequence, computed in ``dtype`` (float64: the reference the
    kernel checks measure errors against). Differentiable; GQA by repeating key/value heads."""
    rep = q_TNH.shape[1] // k_TKH.shape[1]
    outs, s = [], 0
    for n in lengths:
        q = q_TNH[s : s + n].to(dtype).transpose(0, 1)
        k = k_TKH[s : s + n].to(dtype).repeat_interleave(rep, 1).transpose(0, 1)
        v = v_TKH[s : s + n].to(dtype).repeat_interleave(rep, 1).transpose(0, 1)
        outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1))
        s += n
    return torch.cat(outs) if outs else q_TNH.new_zeros(0, *q_TNH.shape[1:], dtype=dtype)


def split_attention_reference(
    q_TNH: torch.Tensor, k_SKH: torch.Tensor, v_SKH: torch.Tensor, q_start: int, scale: float, *, split: int,
    block_n: int,
) -> torch.Tensor:
    """The split-KV definition of ``attention_triton`` in plain PyTorch, for queries at positions ``q_start ..
    q_start+T-1`` of one sequence over its keys ``0 .. S-1``: per split of ``split`` keys (anchored at 0) an
    online softmax over blocks of ``block_n`` keys from a fresh state, then the partials folded in ascending
    split order. Dots in float64 rounded to fp32 (as the kernel under the Triton interpreter), the rest in
    fp32, ``p`` rounded to the value dtype before ``p @ v``. Returns ``[T, N, Hv]`` in q's dtype."""
    T, N, _ = q_TNH.shape
    S, Kh, Hv = v_SKH.shape
    if split % block_n:
        raise ValueError(f"a split ({split}) must be a whole number of blocks ({block_n})")
    rep = N // Kh
    q = q_TNH.double()
    k = k_SKH.double().repeat_interleave(rep, dim=1)  # [S, N, H]
    v = v_SKH.repeat_interleave(rep, dim=1)  # [S, N, Hv]
    pos = q_start + torch.arange(T)
    neg = float("-inf")
    M, L = torch.full((T, N), neg), torch.zeros(T, N)
    A = torch.zeros(T, N, Hv)
    for lo in range(0, q_start + T, split):
        m, l_sum = torch.full((T, N), neg), torch.zeros(T, N)
        a = torch.zeros(T, N, Hv)
        for b in range(lo, min(lo + split, q_start + T), block_n):
            e = min(b + block_n, S)
            s = torch.einsum("tnh,jnh->tnj", q, k[b:e]).float() * (scale * LOG2E)
            s = s.masked_fill(~(torch.arange(b, e)[None, :] <= pos[:, None])[:, None, :], neg)
            m_new = torch.maximum(m, s.amax(-1))
            alpha = torch.where(m_new == m, 1.0, torch.exp2(m - m_new))
            p = torch.exp2(s - torch.where(m_new == neg, 0.0, m_new)[..., None])
            l_sum = l_sum * alpha + p.sum(-1)
            pv = torch.einsum("tnj,jnh->tnh", p.to(v.dtype).double(), v[b:e].double()).float()
            a = a * alpha[..., None] + pv
            m = m_new
        M_new = torch.maximum(M, m)
        alpha = torch.where(M_new == M, 1.0, torch.exp2(M - M_new))
        beta = torch.where(M_new == m, 1.0, torch.exp2(m - M_new))
        skip = m == neg
        L = torch.where(skip, L, L * alpha + l_sum * beta)
        A = torch.where(skip[..., None], A, A * alpha[..., None] + a * beta[..., None])
        M = torch.where(skip, M, M_new)
    return (A / L[..., None]).to(q_TNH.dtype)
