"""Batch-invariant causal flash attention (forward) in Triton, for packed and for paged keys/values.

One launch covers every sequence of a step: program ``(tile, seq, head)`` takes ``BLOCK_M`` queries of
one sequence and one query head, and walks that sequence's keys in ``BLOCK_N`` blocks, in ascending
order, with an online softmax (running max ``m``, running sum ``l``, fp32 accumulator). Why each row's
bits depend on that row alone (its query, its keys, its position) and not on the launch:

- one tile configuration per head size (``CONFIGS``): never chosen from the number of rows or sequences;
- no split over keys: a row's keys are reduced by one program, block by block, in one order;
- a tile walks the key blocks up to the horizon of its *last* row; for an earlier row the blocks past
  its own horizon are fully masked, and a fully masked block is an exact no-op (``p = 0`` adds exact
  zeros, the rescale factor is pinned to exactly 1 when the max does not move), so a row gets the same
  bits whether it sits in a 64-query prefill tile or is a lone decode query;
- keys are addressed per position: ``k_start[seq] + j`` for packed keys (trainer), or
  ``block_table[seq, j // block_size] * block_size + j % block_size`` for vLLM's paged cache
  (generator). The tile loaded is the same either way, so packed and paged give the same bits.

Queries of sequence ``i`` are rows ``cu_q[i] .. cu_q[i+1]-1`` at absolute positions
``seq_lens[i] - n_q .. seq_lens[i] - 1`` (a prefill chunk or a decode step continues a cached prefix).

Under the Triton interpreter (CPU tensors, ``TRITON_INTERPRET=1``) each dot runs in float64 and is
rounded once (numpy's BLAS rounds a row differently at different tile positions); the GPU kernel uses
the tensor cores. ``titan_rl_ext.kernels.attention.attention_bi`` is the plain-PyTorch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# head_dim (padded to a power of two) -> (BLOCK_M, BLOCK_N, num_warps, num_stages). Fixed per head size:
# the bits of a row depend on these, so the trainer and every generator must use the same table.
CONFIGS: dict[int, tuple[int, int, int, int]] = {
    16: (64, 64, 4, 2),
    32: (64, 64, 4, 2),
    64: (64, 64, 4, 3),
    128: (64, 64, 4, 3),
    256: (64, 32, 8, 2),
}
LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["block_size"])
def _bi_attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,
    cu_q_ptr, seq_lens_ptr, k_start_ptr, block_table_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh, stride_bt,
    block_size, qk_scale,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, UPCAST: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GQA
    q_beg = tl.load(cu_q_ptr + seq)
    n_q = tl.load(cu_q_ptr + seq + 1) - q_beg
    if tile * BLOCK_M < n_q:
        L = tl.load(seq_lens_ptr + seq)
        ctx = L - n_q
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < n_q
        pos_m = ctx + offs_m
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        rows_q = (q_beg + offs_m).to(tl.int64)
        q = tl.load(q_ptr + rows_q[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # keys the tile's last real row may see: positions 0 .. ctx + last_row
        hi = ctx + tl.minimum((tile + 1) * BLOCK_M, n_q)
        if PAGED:
            k_base = 0
        else:
            k_base = tl.load(k_start_ptr + seq).to(tl.int64)
        for start_n in range(0, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            n_ok = offs_n < L
            if PAGED:
                blk = tl.load(block_table_ptr + seq * stride_bt + offs_n // block_size, mask=n_ok, other=0).to(tl.int64)
                in_blk = (offs_n % block_size).to(tl.int64)
                k_row = blk * stride_kb + in_blk * stride_kp
                v_row = blk * stride_vb + in_blk * stride_vp
            else:
                k_row = (k_base + offs_n) * stride_kp
                v_row = (k_base + offs_n) * stride_vp
            k = tl.load(k_ptr + k_row[None, :] + kv_head * stride_kh + offs_d[:, None],
                        mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
            if UPCAST:
                s = tl.dot(q.to(tl.float64), k.to(tl.float64)).to(tl.float32)
            else:
                s = tl.dot(q, k, input_precision=INPUT_PRECISION)
            s = s * qk_scale
            visible = (offs_n[None, :] <= pos_m[:, None]) & n_ok[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # exactly 1 when the max does not move (a masked block must be a no-op), else 2^(m - m_new)
            alpha = tl.where(m_new == m_i, 1.0, tl.math.exp2(m_i - m_new))
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            v = tl.load(v_ptr + v_row[:, None] + kv_head * stride_vh + offs_d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
            p_lo = p.to(v.dtype)
            if UPCAST:
                acc += tl.dot(p_lo.to(tl.float64), v.to(tl.float64)).to(tl.float32)
            else:
                acc = tl.dot(p_lo, v, acc, input_precision=INPUT_PRECISION)
            m_i = m_new
        o = acc / l_i[:, None]
        tl.store(o_ptr + rows_q[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def config_for(head_dim: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_D, BLOCK_M, BLOCK_N, num_warps, num_stages) for a head size."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if block_d not in CONFIGS:
        raise ValueError(f"batch-invariant attention supports head sizes up to 256; got {head_dim}")
    return (block_d, *CONFIGS[block_d])


def bi_attention_fwd(
    q_TNH: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    seq_lens: torch.Tensor,
    max_q: int,
    scale: float,
    *,
    k_start: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries ``[T, N, H]`` (``cu_q`` ``[S+1]``, ``seq_lens`` ``[S]`` keys per
    sequence, ``max_q`` a bound on queries per sequence). Keys/values either packed ``[R, K, H]`` with
    sequence ``i`` at rows ``k_start[i]..`` or paged ``[num_blocks, block_size, K, H]`` (any strides,
    last dim contiguous) through ``block_table`` ``[S, max_blocks]``. Returns ``[T, N, H]`` in q's dtype."""
    if q_TNH.dim() != 3:
        raise ValueError(f"q must be [T, N, H]; got {tuple(q_TNH.shape)}")
    T, N, H = q_TNH.shape
    paged = block_table is not None
    if paged == (k_start is not None):
        raise ValueError("pass exactly one of k_start (packed keys) and block_table (paged keys)")
    if paged:
        if k.dim() != 4 or v.shape[:3] != k.shape[:3]:
            raise ValueError(f"paged k/v must be [num_blocks, block_size, K, H]; got {tuple(k.shape)}, {tuple(v.shape)}")
        block_size, n_kv = k.shape[1], k.shape[2]
        stride_kb, stride_kp, stride_kh = k.stride(0), k.stride(1), k.stride(2)
        stride_vb, stride_vp, stride_vh = v.stride(0), v.stride(1), v.stride(2)
    else:
        if k.dim() != 3 or v.shape[:2] != k.shape[:2]:
            raise ValueError(f"packed k/v must be [R, K, H]; got {tuple(k.shape)}, {tuple(v.shape)}")
        block_size, n_kv = 1, k.shape[1]
        stride_kb, stride_kp, stride_kh = 0, k.stride(0), k.stride(1)
        stride_vb, stride_vp, stride_vh = 0, v.stride(0), v.stride(1)
    if k.shape[-1] != H or v.shape[-1] != H:
        raise ValueError(f"q/k/v head sizes differ: {H}, {k.shape[-1]}, {v.shape[-1]}")
    if N % n_kv:
        raise ValueError(f"query heads ({N}) must be a multiple of key/value heads ({n_kv})")
    if q_TNH.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q/k/v need a contiguous last (head) dim")
    if k.dtype != q_TNH.dtype or v.dtype != q_TNH.dtype:
        raise TypeError(f"q/k/v dtypes differ: {q_TNH.dtype}, {k.dtype}, {v.dtype}")
    S = seq_lens.numel()
    if cu_q.numel() != S + 1:
        raise ValueError(f"cu_q has {cu_q.numel()} entries for {S} sequences")
    o = torch.empty_like(q_TNH)
    if T == 0 or S == 0 or max_q == 0:
        return o
    block_d, bm, bn, warps, stages = config_for(H)
    dummy = cu_q  # an unused pointer argument still needs a tensor
    grid = (triton.cdiv(max_q, bm), S, N)
    _bi_attn_fwd_kernel[grid](
        q_TNH, k, v, o,
        cu_q, seq_lens, k_start if k_start is not None else dummy, block_table if paged else dummy,
        q_TNH.stride(0), q_TNH.stride(1), o.stride(0), o.stride(1),
        stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
        block_table.stride(0) if paged else 0,
        block_size, scale * LOG2E,
        GQA=N // n_kv, HEAD_DIM=H, BLOCK_D=block_d, BLOCK_M=bm, BLOCK_N=bn,
        PAGED=paged, UPCAST=q_TNH.device.type != "cuda",
        INPUT_PRECISION="ieee" if q_TNH.dtype == torch.float32 else "tf32",  # fp32: full-precision dots
        num_warps=warps, num_stages=stages,
    )
    return o
