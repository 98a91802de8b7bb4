"""Triton causal depthwise conv1d over packed sequences with carried state: the CUDA path of
``titan_rl_ext.kernels.conv.causal_conv1d`` (reference: ``causal_conv1d_torch`` beside it).

Forward, two launches: ``_conv_fwd_kernel`` writes every token's output (a ``BLOCK_T x BLOCK_C`` tile reads its
W shifted input rows; a tap before its sequence's start reads the sequence's initial state, or zero), and
``_conv_state_kernel`` writes each sequence's last ``W - 1`` inputs. Which sequence a token belongs to is
found by a binary search of ``cu_seqlens`` in the kernel: no host sync, nothing sized by the data, so a
decode step captures in a CUDA graph. The input may be a column slice of a wider buffer (row-strided).
Backward (the trainer's case: no initial state, no bias): ``_conv_bwd_kernel``, one launch for dx and
per-tile dw partials, instead of differentiating the torch reference (~20 GB of fp32 elementwise traffic
per layer at T = 8192 of the 9B shape, against ~0.4 GB here).

Arithmetic per output: ``acc = sum_j x[t - W + 1 + j] * w[:, j]`` in fp32, taps in ascending j, then bias
and SiLU in fp32, one rounding to the output dtype. Each output depends only on its own W inputs, in a fixed
order: a prefill split across steps (state carried between them) gives the same bits as in one step, and
a token's bits do not depend on the other sequences of the step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _seq_of(cu_ptr, t, N, SEARCH_STEPS: tl.constexpr):
    """Largest n < N with cu[n] <= t (cu non-decreasing; empty sequences are skipped over)."""
    n = tl.zeros_like(t)
    step = 1 << (SEARCH_STEPS - 1)
    for _ in tl.static_range(SEARCH_STEPS):
        cand = n + step
        ok = cand < N
        start = tl.load(cu_ptr + cand, mask=ok, other=0)
        n = tl.where(ok & (start <= t), cand, n)
        step = step // 2
    return n


@triton.jit(do_not_specialize=["T", "N"])
def _conv_fwd_kernel(
    x_ptr, w_ptr, b_ptr, s_ptr, cu_ptr, y_ptr,
    T, C, N, stride_x,
    W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    HAS_STATE: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_t = offs_t < T
    mask_c = offs_c < C
    n = _seq_of(cu_ptr, offs_t, N, SEARCH_STEPS)
    start = tl.load(cu_ptr + n, mask=mask_t, other=0)
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(W):
        r = offs_t - start - (W - 1) + j  # tap position relative to the sequence start (< 0: the state)
        in_x = mask_t & (r >= 0)
        xv = tl.load(
            x_ptr + (offs_t - (W - 1) + j).to(tl.int64)[:, None] * stride_x + offs_c[None, :],
            mask=in_x[:, None] & mask_c[None, :], other=0.0,
        ).to(tl.float32)
        if HAS_STATE:
            sv = tl.load(
                s_ptr + (n.to(tl.int64) * (W - 1) + (W - 1) + r)[:, None] * C + offs_c[None, :],
                mask=(mask_t & (r < 0))[:, None] & mask_c[None, :], other=0.0,
            ).to(tl.float32)
            xv = tl.where(in_x[:, None], xv, sv)
        wj = tl.load(w_ptr + offs_c * W + j, mask=mask_c, other=0.0).to(tl.float32)
        acc += xv * wj[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(
        y_ptr + offs_t.to(tl.int64)[:, None] * C + offs_c[None, :],
        acc.to(y_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_c[None, :],
    )


@triton.jit
def _conv_state_kernel(
    x_ptr, s_ptr, cu_ptr, out_ptr, C, stride_x,
    W: tl.constexpr, BLOCK_C: tl.constexpr, HAS_STATE: tl.constexpr,
):
    seq = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < C
    start = tl.load(cu_ptr + seq)
    L = tl.load(cu_ptr + seq + 1) - start
    for s in tl.static_range(W - 1):
        # position of final-state row s relative to the sequence start, per lane (masks stay vectors)
        r = L - (W - 1) + s + tl.zeros_like(offs_c)
        v = tl.load(x_ptr + (start + r).to(tl.int64) * stride_x + offs_c, mask=mask_c & (r >= 0), other=0.0)
        if HAS_STATE:
            sv = tl.load(s_ptr + (seq.to(tl.int64) * (W - 1) + (W - 1) + r) * C + offs_c,
                         mask=mask_c & (r < 0), other=0.0)
            v = tl.where(r >= 0, v, sv)
        tl.store(out_ptr + (seq.to(tl.int64) * (W - 1) + s) * C + offs_c, v.to(out_ptr.dtype.element_ty), mask=mask_c)


@triton.jit(do_not_specialize=["T", "N"])
def _conv_bwd_kernel(
    x_ptr, w_ptr, cu_ptr, dy_ptr, dx_ptr, dw_part_ptr,
    T, C, N, stride_x,
    W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, SEARCH_STEPS: tl.constexpr, SILU: tl.constexpr,
):
    """Backward of the conv without initial state or bias, for one ``BLOCK_T x BLOCK_C`` tile of input rows r:

        dz[t] = dy[t] * silu'(z[t])                 z[t] recomputed from its W inputs, as the forward does
        dx[r] = sum_j dz[r + W - 1 - j] * w[:, j]   only outputs t of r's own sequence
        dw_part[tile, j] = sum_{t in tile} dz[t] * x[t - W + 1 + j]

    Each dz a tile needs (rows r .. r + W - 1) is recomputed here rather than stored: W^2 loads of rows that
    overlap (cache hits) instead of an fp32 [T, C] round trip. dx accumulates in fp32 and is rounded once;
    the dw partials are summed over tiles in a fixed order by the caller."""
    pid_t = tl.program_id(0)
    offs_r = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_r = offs_r < T
    mask_c = offs_c < C
    n = _seq_of(cu_ptr, offs_r, N, SEARCH_STEPS)
    start = tl.load(cu_ptr + n, mask=mask_r, other=0)
    end = tl.load(cu_ptr + n + 1, mask=mask_r, other=0)
    dx = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for k in tl.static_range(W):
        t = offs_r + k  # an output of r's sequence that reads x[r] through tap W - 1 - k
        t_ok = mask_r & (t < end)
        z = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for i in tl.static_range(W):
            p = t - (W - 1) + i
            xv = tl.load(x_ptr + p.to(tl.int64)[:, None] * stride_x + offs_c[None, :],
                         mask=(t_ok & (p >= start))[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
            z += xv * tl.load(w_ptr + offs_c * W + i, mask=mask_c, other=0.0).to(tl.float32)[None, :]
        dz = tl.load(dy_ptr + t.to(tl.int64)[:, None] * C + offs_c[None, :],
                     mask=t_ok[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
        if SILU:
            sig = tl.sigmoid(z)
            dz = dz * (sig + z * sig * (1.0 - sig))
        dx += dz * tl.load(w_ptr + offs_c * W + (W - 1 - k), mask=mask_c, other=0.0).to(tl.float32)[None, :]
        if k == 0:  # t = r: this tile's own outputs give its share of dw
            for j in tl.static_range(W):
                p = offs_r - (W - 1) + j
                xv = tl.load(x_ptr + p.to(tl.int64)[:, None] * stride_x + offs_c[None, :],
                             mask=(t_ok & (p >= start))[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
                tl.store(dw_part_ptr + (pid_t * W + j).to(tl.int64) * C + offs_c, tl.sum(dz * xv, axis=0), mask=mask_c)
    tl.store(dx_ptr + offs_r.to(tl.int64)[:, None] * C + offs_c[None, :], dx.to(dx_ptr.dtype.element_ty),
             mask=mask_r[:, None] & mask_c[None, :])


def causal_conv1d_backward_triton(
    x_TC: torch.Tensor, weight_CW: torch.Tensor, cu_seqlens: torch.Tensor, dy_TC: torch.Tensor,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx [T, C] in x's dtype, dw [C, W] in the weight's dtype)`` of ``causal_conv1d_triton`` without initial
    state or bias, given the output's gradient ``dy``. dx sums its W contributions in fp32 and rounds once; dw
    sums each tile's fp32 partial, then the tiles in order (no atomics: the same bits every run)."""
    if activation not in (None, "silu"):
        raise ValueError(f"unsupported activation {activation!r}")
    T, C = x_TC.shape
    W = weight_CW.shape[1]
    N = cu_seqlens.numel() - 1
    if dy_TC.shape != (T, C):
        raise ValueError(f"dy must be [T, C]={[T, C]}; got {tuple(dy_TC.shape)}")
    if x_TC.stride(1) != 1:
        x_TC = x_TC.contiguous()
    w = weight_CW.contiguous()
    dy = dy_TC.contiguous()
    cu = cu_seqlens.to(device=x_TC.device, dtype=torch.int32).contiguous()
    dx = torch.empty(T, C, dtype=x_TC.dtype, device=x_TC.device)
    BLOCK_C = 128
    BLOCK_T = 32 if T >= 32 else triton.next_power_of_2(max(T, 1))
    n_t = triton.cdiv(T, BLOCK_T)
    dw_part = torch.empty(n_t, W, C, dtype=torch.float32, device=x_TC.device)
    if T > 0:
        _conv_bwd_kernel[(n_t, triton.cdiv(C, BLOCK_C))](
            x_TC, w, cu, dy, dx, dw_part, T, C, N, x_TC.stride(0),
            W=W, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, SEARCH_STEPS=max(1, N.bit_length()), SILU=activation == "silu",
            num_warps=4,
        )
    return dx, dw_part.sum(0).t().to(weight_CW.dtype)


def causal_conv1d_triton(
    x_TC: torch.Tensor,
    weight_CW: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bias_C: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``causal_conv1d_torch``: ``y [T, C]`` (x's dtype, contiguous) and the final states
    ``[N, W-1, C]`` (x's dtype). ``x`` needs a unit column stride; its rows may be strided."""
    if activation not in (None, "silu"):
        raise ValueError(f"unsupported activation {activation!r}")
    T, C = x_TC.shape
    W = weight_CW.shape[1]
    N = cu_seqlens.numel() - 1
    if x_TC.stride(1) != 1:
        x_TC = x_TC.contiguous()
    w = weight_CW.contiguous()
    cu = cu_seqlens.to(device=x_TC.device, dtype=torch.int32).contiguous()
    state = None if initial_state is None else initial_state.to(x_TC.dtype).contiguous()
    y = torch.empty(T, C, dtype=x_TC.dtype, device=x_TC.device)
    final = torch.empty(N, W - 1, C, dtype=x_TC.dtype, device=x_TC.device)
    dummy = w  # stands in for absent pointers (never read: the constexpr flags drop those loads)
    BLOCK_C = 128
    if T > 0:
        BLOCK_T = 32 if T >= 32 else triton.next_power_of_2(T)
        _conv_fwd_kernel[(triton.cdiv(T, BLOCK_T), triton.cdiv(C, BLOCK_C))](
            x_TC, w, bias_C if bias_C is not None else dummy, state if state is not None else dummy, cu, y,
            T, C, N, x_TC.stride(0),
            W=W, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, SEARCH_STEPS=max(1, N.bit_length()),
            HAS_STATE=state is not None, HAS_BIAS=bias_C is not None, SILU=activation == "silu", num_warps=4,
        )
    if N > 0 and W > 1:
        _conv_state_kernel[(N, triton.cdiv(C, BLOCK_C))](
            x_TC, state if state is not None else dummy, cu, final, C, x_TC.stride(0),
            W=W, BLOCK_C=BLOCK_C, HAS_STATE=state is not None, num_warps=4,
        )
    return y, final
