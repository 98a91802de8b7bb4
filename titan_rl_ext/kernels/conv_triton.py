"""Triton causal depthwise conv1d over packed sequences with carried state: the CUDA path of
``titan_rl_ext.kernels.conv.causal_conv1d`` (reference: ``causal_conv1d_torch`` beside it).

Two launches: ``_conv_fwd_kernel`` writes every token's output (a ``BLOCK_T x BLOCK_C`` tile reads its
W shifted input rows; a tap before its sequence's start reads the sequence's initial state, or zero), and
``_conv_state_kernel`` writes each sequence's last ``W - 1`` inputs. Which sequence a token belongs to is
found by a binary search of ``cu_seqlens`` in the kernel: no host sync, nothing sized by the data, so a
decode step captures in a CUDA graph. The input may be a column slice of a wider buffer (row-strided).

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
