"""The gated delta rule on a chunk grid anchored at each sequence's first token: a long prompt's prefill (and the
trainer's forward) without a token-long serial chain, computed one way whatever the batch.

Why: the recurrent kernel (``kernels.gdn_triton``) steps a sequence token by token, ~0.7 us a token whatever its
layout, so a 32K-token prompt costs ~22 ms per GDN layer however many programs share it (docs/benchmarks.md, "Long
contexts and full depth", item 3). This form cuts the chain at every ``CHUNK`` tokens:

1. **boundary states**: the state entering chunk ``c + 1`` is the chunk (WY) form's update of the state entering
   chunk ``c`` over the chunk's tokens -- one fixed-shape matrix step per chunk instead of ``CHUNK`` token steps:
   with ``G_j`` the chunk's cumulative log decay up to token ``j``, ``A[j, l] = beta_j exp(G_j - G_l) k_j . k_l``
   (``l < j``), ``T = (I + A)^-1``, the chunk's state change is ``S' = exp(G_last) S + (exp(G_last - G) k)^T D``
   with ``D = T (beta v) - T (beta exp(G) k) S`` (``kernels.gdn.chunk_gated_delta_rule_torch`` derives the same);
2. **outputs**: every chunk's tokens are stepped by the recurrent kernel from the chunk's boundary state -- all
   chunks in parallel, each a 64-token chain.

The state at a chunk boundary therefore differs (by rounding) from the token-by-token state: an engine that follows
this definition must replace its running state at each boundary by (1) computed from the chunk's inputs, which it
keeps for that purpose (docs/benchmarks.md has the design). This module is the prefill half of that definition and
what it costs; nothing serves it yet.

``T`` comes from the nilpotent series ``(I + A)^-1 = (I - A)(I + A^2)(I + A^4)...(I + A^32)`` (``A`` is strictly
lower triangular, so ``A^64 = 0``): six matrix products of fixed shape, the same in every program. Every product
runs in fp32 at full precision (no TF32) and every kernel is built without floating-point contraction, so a
chunk's numbers depend on its own tokens and its entering state alone.

Layouts as ``kernels.gdn``: q/k ``[T, H, K]`` (already L2-normalised), v ``[T, HV, V]``, g/beta ``[T, HV]``,
``cu_seqlens [N+1]``, states ``[., HV, K, V]`` fp32. ``boundary_states_torch`` is the plain-PyTorch form of (1).
"""

from __future__ import annotations

import itertools
import math

import torch
import triton
import triton.language as tl

CHUNK = 64
BV_CHAIN = 32  # value columns per chain program: 4 programs per head at the 9B's V = 128


def chunk_bounds(cu_seqlens: list[int], chunk: int = CHUNK) -> tuple[list[int], list[int]]:
    """``(cu_chunks, seq_of_chunk)``: every sequence cut into chunks of ``chunk`` tokens anchored at its first
    token (the last one shorter), as offsets into the packed tokens, and each chunk's sequence."""
    cu, seq = [0], []
    for n, (s, e) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        for b in range(s, e, chunk):
            cu.append(min(b + chunk, e))
            seq.append(n)
    return cu, seq


def _chunk_update(S_KV: torch.Tensor, k_CK: torch.Tensor, v_CV: torch.Tensor, g_C: torch.Tensor,
                  beta_C: torch.Tensor) -> torch.Tensor:
    """One chunk's WY update of the state ``S [K, V]`` (any float dtype, computed in it)."""
    G = torch.cumsum(g_C, 0)
    decay_CC = torch.exp(G[:, None] - G[None, :])
    A = torch.tril(beta_C[:, None] * decay_CC * (k_CK @ k_CK.t()), diagonal=-1)
    T = torch.linalg.inv(torch.eye(len(g_C), dtype=S_KV.dtype, device=S_KV.device) + A)
    D = T @ (beta_C[:, None] * v_CV - ((beta_C * torch.exp(G))[:, None] * k_CK) @ S_KV)
    return torch.exp(G[-1]) * S_KV + (torch.exp(G[-1] - G)[:, None] * k_CK).t() @ D


def boundary_states_torch(
    k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor, beta_TH: torch.Tensor, cu_seqlens: list[int],
    initial_state: torch.Tensor | None = None, chunk: int = CHUNK, dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(1) in plain PyTorch, in ``dtype``: ``(states [chunks, HV, K, V], final [N, HV, K, V])``, the state entering
    each chunk of ``chunk_bounds`` and each sequence's state after its last token."""
    _, H, K = k_THK.shape
    HV, V = v_THV.shape[1:]
    N = len(cu_seqlens) - 1
    k = k_THK.to(dtype).repeat_interleave(HV // H, dim=1)
    v, g, beta = v_THV.to(dtype), g_TH.to(dtype), beta_TH.to(dtype)
    S = (torch.zeros(N, HV, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype)).clone()
    cu, seq = chunk_bounds(cu_seqlens, chunk)
    states = torch.empty(len(seq), HV, K, V, dtype=dtype)
    for c, n in enumerate(seq):
        lo, hi = cu[c], cu[c + 1]
        states[c] = S[n]
        for h in range(HV):
            S[n, h] = _chunk_update(S[n, h], k[lo:hi, h], v[lo:hi, h], g[lo:hi, h], beta[lo:hi, h])
    return states, S


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    # interpreter (CPU tensors): numpy's BLAS rounds a row differently at different tile positions; a float64
    # dot rounded once is position-independent. GPU: fp32 at full precision (no TF32)
    if UPCAST:
        return tl.dot(a.to(tl.float64), b.to(tl.float64)).to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _load_chunk_k(k_ptr, lo, hi, h, sk_t, sk_h, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr):
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BK)
    rows = (lo + offs_c).to(tl.int64)
    mask = (rows < hi)[:, None] & (offs_k < K)[None, :]
    return tl.load(k_ptr + rows[:, None] * sk_t + h * sk_h + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _chunk_t_kernel(
    k_ptr, g_ptr, beta_ptr, cu_ptr, t_ptr, gc_ptr,
    sk_t, sk_h, sg_t, sb_t,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr, LOG_C: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Program ``(chunk, value head)``: the chunk's cumulative log decay ``G [C]`` (padding rows repeat the last
    token's, so ``G[C-1]`` is the chunk's total) and ``T = (I + A)^-1 [C, C]``."""
    c = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    h = hv // (HV // H)
    lo = tl.load(cu_ptr + c).to(tl.int64)
    hi = tl.load(cu_ptr + c + 1).to(tl.int64)
    offs_c = tl.arange(0, C)
    valid = lo + offs_c < hi
    kk = _load_chunk_k(k_ptr, lo, hi, h, sk_t, sk_h, K, BK, C)
    g = tl.load(g_ptr + (lo + offs_c) * sg_t + hv, mask=valid, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + (lo + offs_c) * sb_t + hv, mask=valid, other=0.0).to(tl.float32)
    G = tl.cumsum(g, 0)
    lower = offs_c[:, None] > offs_c[None, :]
    diff = tl.where(lower, G[:, None] - G[None, :], 0.0)
    N = tl.where(lower, -(beta[:, None] * tl.exp(diff)) * _dot(kk, tl.trans(kk), UPCAST), 0.0)
    eye = tl.where(offs_c[:, None] == offs_c[None, :], 1.0, 0.0)
    T = eye + N
    P = N
    for _ in tl.static_range(LOG_C - 1):  # (I + N)(I + N^2)(I + N^4)...: every power below C
        P = _dot(P, P, UPCAST)
        T = _dot(T, eye + P, UPCAST)
    base = (c * HV + hv) * C
    tl.store(t_ptr + (base + offs_c[:, None]) * C + offs_c[None, :], T)
    tl.store(gc_ptr + base + offs_c, G)


@triton.jit
def _chain_kernel(
    k_ptr, v_ptr, beta_ptr, cu_ptr, first_ptr, t_ptr, gc_ptr, h0_ptr, states_ptr, final_ptr,
    sk_t, sk_h, sv_t, sv_h, sb_t,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    C: tl.constexpr, UPCAST: tl.constexpr,
):
    """Program ``(sequence, value head, column block)``: walks the sequence's chunks in order, storing the state
    entering each and stepping it by the chunk's WY update; stores the state after the last chunk."""
    n = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    i_v = tl.program_id(2)
    h = hv // (HV // H)
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_s = (offs_k < K)[:, None] & (offs_v < V)[None, :]
    p_s = hv * K * V + offs_k[:, None] * V + offs_v[None, :]
    S = tl.load(h0_ptr + n * HV * K * V + p_s, mask=mask_s, other=0.0)
    c_beg = tl.load(first_ptr + n).to(tl.int64)
    c_end = tl.load(first_ptr + n + 1).to(tl.int64)
    for c64 in range(c_beg, c_end):
        tl.store(states_ptr + c64 * HV * K * V + p_s, S, mask=mask_s)
        lo = tl.load(cu_ptr + c64).to(tl.int64)
        hi = tl.load(cu_ptr + c64 + 1).to(tl.int64)
        rows = lo + offs_c
        valid = rows < hi
        kk = _load_chunk_k(k_ptr, lo, hi, h, sk_t, sk_h, K, BK, C)
        vv = tl.load(v_ptr + rows[:, None] * sv_t + hv * sv_h + offs_v[None, :],
                     mask=valid[:, None] & (offs_v < V)[None, :], other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + rows * sb_t + hv, mask=valid, other=0.0).to(tl.float32)
        base = (c64 * HV + hv) * C
        T = tl.load(t_ptr + (base + offs_c[:, None]) * C + offs_c[None, :])
        G = tl.load(gc_ptr + base + offs_c)
        g_last = tl.sum(tl.where(offs_c == C - 1, G, 0.0), axis=0)
        X = _dot(kk * (beta * tl.exp(G))[:, None], S, UPCAST)
        D = _dot(T, beta[:, None] * vv - X, UPCAST)
        S = tl.exp(g_last) * S + _dot(tl.trans(kk * tl.exp(g_last - G)[:, None]), D, UPCAST)
    tl.store(final_ptr + n * HV * K * V + p_s, S, mask=mask_s)


def boundary_states(
    k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor, beta_TH: torch.Tensor, cu_seqlens: list[int],
    initial_state: torch.Tensor | None = None, chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(1) by the Triton kernels: ``(states [chunks, HV, K, V], final [N, HV, K, V], cu_chunks [chunks + 1])``,
    all fp32 on the inputs' device; ``boundary_states_torch``'s numbers up to rounding."""
    T_, H, K = k_THK.shape
    HV, V = v_THV.shape[1:]
    N = len(cu_seqlens) - 1
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 16 (a tensor-core dot's side); got {chunk}")
    if HV % H:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({H})")
    dev = v_THV.device
    cu, seq = chunk_bounds(cu_seqlens, chunk)
    per_seq = [0] * N
    for n in seq:
        per_seq[n] += 1
    first = list(itertools.accumulate(per_seq, initial=0))  # each sequence's first chunk (chunks are in order)
    n_chunks = len(seq)
    cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)
    first_t = torch.tensor(first, dtype=torch.int32, device=dev)
    k = k_THK if k_THK.stride(-1) == 1 else k_THK.contiguous()
    v = v_THV if v_THV.stride(-1) == 1 else v_THV.contiguous()
    h0 = (torch.zeros(N, HV, K, V, dtype=torch.float32, device=dev) if initial_state is None
          else initial_state.float().contiguous())
    states = torch.empty(n_chunks, HV, K, V, dtype=torch.float32, device=dev)
    final = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev)
    if n_chunks == 0:
        return states, final.copy_(h0), cu_t
    t_buf = torch.empty(n_chunks, HV, chunk, chunk, dtype=torch.float32, device=dev)
    gc = torch.empty(n_chunks, HV, chunk, dtype=torch.float32, device=dev)
    upcast = dev.type != "cuda"
    fusion = {} if upcast else {"enable_fp_fusion": False}
    BK = triton.next_power_of_2(K)
    _chunk_t_kernel[(n_chunks, HV)](
        k, g_TH, beta_TH, cu_t, t_buf, gc, k.stride(0), k.stride(1), g_TH.stride(0), beta_TH.stride(0),
        H=H, HV=HV, K=K, BK=BK, C=chunk, LOG_C=int(math.log2(chunk)), UPCAST=upcast, num_warps=4, **fusion,
    )
    BV = min(BV_CHAIN, triton.next_power_of_2(V))
    _chain_kernel[(N, HV, triton.cdiv(V, BV))](
        k, v, beta_TH, cu_t, first_t, t_buf, gc, h0, states, final,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), beta_TH.stride(0),
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV, C=chunk, UPCAST=upcast, num_warps=4, **fusion,
    )
    return states, final, cu_t


def gated_delta_rule_chunk_grid(
    q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor, beta_TH: torch.Tensor,
    cu_seqlens: list[int], scale: float, initial_state: torch.Tensor | None = None, chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [T, HV, V], final [N, HV, K, V])`` by the chunk-grid definition: boundary states by the chain, then
    every chunk's tokens by the recurrent kernel from its boundary state, all chunks at once."""
    from titan_rl_ext.kernels.gdn_triton import gated_delta_rule_recurrent

    states, final, cu_chunks = boundary_states(k_THK, v_THV, g_TH, beta_TH, cu_seqlens, initial_state, chunk)
    o, _ = gated_delta_rule_recurrent(q_THK, k_THK, v_THV, g_TH, beta_TH, cu_chunks, scale, initial_state=states)
    return o, final
