"""Triton grouped GEMM for the MoE experts: rows sorted by expert, each row times its expert's weight,
``y[r] = x[r] @ w[e(r)]^T``, one launch for all experts, with no host read (the routing lives on the
device: a CUDA graph can hold it). References and dispatch: ``kernels.grouped_gemm``.

Tiles: programs over ``(row tiles, column tiles)``; the row tiles of expert ``e`` are the ``BLOCK_M``-row
blocks of its rows, and the grid has the static upper bound ``cdiv(N, BLOCK_M) + E`` of their number
(each expert adds at most one partial tile); a program finds its expert by a binary search over the
cumulative tile counts and idles past the last tile. Batch invariance: the tile configuration is fixed
(it depends on nothing at all), and a row's K reduction is laid out the same wherever the row sits in its
tile, so a row's bits depend on the row and its expert's weights only, not on how many rows each expert got.

Runs under the Triton interpreter (``TRITON_INTERPRET=1``) on CPU tensors (``tests/test_fused_triton_interp.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64


@triton.jit
def _grouped_mm_kernel(
    x_ptr, w_ptr, y_ptr, row_off_ptr, tile_end_ptr,
    E, N, K,
    s_xm, s_we, s_wn, s_wk, s_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOG2_E: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    total = tl.load(tile_end_ptr + E - 1)
    # the first expert whose cumulative tile count exceeds pid_m
    lo = pid_m * 0
    hi = lo + E - 1
    for _ in range(LOG2_E):
        mid = (lo + hi) // 2
        past = tl.load(tile_end_ptr + mid) > pid_m
        hi = tl.where(past, mid, hi)
        lo = tl.where(past, lo, mid + 1)
    e = tl.minimum(lo, E - 1).to(tl.int64)
    first_tile = tl.where(e > 0, tl.load(tile_end_ptr + tl.maximum(e - 1, 0)), 0)
    row0 = tl.load(row_off_ptr + e) + (pid_m - first_tile) * BLOCK_M
    row_end = tl.where(pid_m < total, tl.load(row_off_ptr + e + 1), row0)  # idle programs: no rows
    rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    m_ok = rows < row_end
    n_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(x_ptr + rows[:, None] * s_xm + (k0 + ks)[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + e * s_we + cols[None, :] * s_wn + (k0 + ks)[:, None] * s_wk,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's dot: fp32 operands (bf16 products are exact in fp32 anyway)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    tl.store(y_ptr + rows[:, None] * s_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def grouped_mm(x_NK: torch.Tensor, w_ENK: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """``y[r] = x[r] @ w[e]^T`` for the rows of each expert ``e`` (``counts_E[e]`` rows, in expert order);
    ``w`` is ``[E, N, K]`` (``F.linear``'s layout, any strides); output ``[rows, N]`` in ``x``'s dtype."""
    R, K = x_NK.shape
    E, N, K2 = w_ENK.shape
    if K != K2 or counts_E.shape != (E,):
        raise ValueError(f"grouped_mm: x {tuple(x_NK.shape)}, w {tuple(w_ENK.shape)}, counts {tuple(counts_E.shape)}")
    if x_NK.dtype != w_ENK.dtype:
        raise TypeError(f"grouped_mm: x is {x_NK.dtype}, w is {w_ENK.dtype}")
    x = x_NK.contiguous()
    y = torch.empty(R, N, dtype=x.dtype, device=x.device)
    if R == 0 or N == 0:
        return y
    counts = counts_E.to(torch.int64)
    row_off = torch.zeros(E + 1, dtype=torch.int64, device=x.device)
    row_off[1:] = counts.cumsum(0)
    tile_end = ((counts + BLOCK_M - 1) // BLOCK_M).cumsum(0)
    max_tiles = triton.cdiv(R, BLOCK_M) + E
    _grouped_mm_kernel[(max_tiles, triton.cdiv(N, BLOCK_N))](
        x, w_ENK, y, row_off, tile_end, E, N, K,
        x.stride(0), w_ENK.stride(0), w_ENK.stride(1), w_ENK.stride(2), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, LOG2_E=max(1, (E - 1).bit_length()),
        UPCAST=x.device.type != "cuda", num_warps=4, num_stages=3,
        # fp32 operands: full fp32 products, not tf32 (as the dense BI GEMM)
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )
    return y
