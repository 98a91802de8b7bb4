"""Batch-invariant causal flash attention (forward) in Triton, for packed and for paged keys/values, with
a split over keys that depends only on each row's own positions.

Definition of a row's output (query at absolute position ``p`` of a sequence, one query head):

1. keys ``0 .. p`` are cut into **splits** of ``SPLIT`` keys anchored at position 0 (split ``j`` holds
   positions ``j*SPLIT .. (j+1)*SPLIT - 1``), each split into blocks of ``BLOCK_N`` keys;
2. each split is reduced on its own by an online softmax over its blocks in ascending order (running max
   ``m``, running sum ``l``, fp32 accumulator ``a``; fresh state at the split's first block);
3. the splits' partials ``(m_j, l_j, a_j)`` are folded in ascending split order into ``(M, L, A)``
   (``merge``), and the output is ``A / L``.

Nothing in that definition depends on the launch (how many rows, sequences or query heads share it), so
it can be computed two ways with the same bits:

- **one program per query tile** (prefill chunks, the trainer's packed sequences): program ``(tile, seq,
  kv_head)`` walks the splits one after the other and folds each into its running ``(M, L, A)``;
- **split-parallel** (decode-sized launches, where every sequence's queries fit one tile): program ``(p,
  seq, kv_head)`` reduces splits ``p, p + P, p + 2P, ...`` and writes each partial to a workspace; a second
  kernel folds a row's partials in ascending order. ``P`` (programs per sequence and KV head) is chosen
  from the launch's size to fill the GPU; it changes which program computes a partial, never its bits.

Why both give the same bits: one tile configuration per head size (``CONFIGS``, the tensor-core dot
shape), never chosen from the launch; a tile's rows are a KV head's whole GQA group (``BLOCK_M // GQA``
queries x ``GQA`` heads), so keys are read once per group, and a row's arithmetic does not depend on which
rows share its tile; a block past a row's horizon is an exact no-op (``p = 0`` adds exact zeros, the
rescale factor is pinned to exactly 1 when the max does not move) and a split past it is skipped by the
fold (its ``m`` is ``-inf``); the fold is one ``@triton.jit`` function used by both kernels, and every
kernel is built without floating-point contraction (``enable_fp_fusion=False``), so an ``a*b + c`` rounds
the same wherever the compiler meets it.

Keys are addressed per position: ``k_start[seq] + j`` for packed keys (trainer), or
``block_table[seq, j // block_size] * block_size + j % block_size`` for vLLM's paged cache (generator).
Queries of sequence ``i`` are rows ``cu_q[i] .. cu_q[i+1]-1`` at absolute positions ``seq_lens[i] - n_q ..
seq_lens[i] - 1`` (a prefill chunk or a decode step continues a cached prefix).

Under the Triton interpreter (CPU tensors, ``TRITON_INTERPRET=1``) each dot runs in float64 and is rounded
once (numpy's BLAS rounds a row differently at different tile positions); the GPU kernel uses the tensor
cores. ``titan_rl_ext.kernels.attention.split_attention_reference`` is the plain-PyTorch form of the
definition above.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

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
    256: (64, 64, 8, 2),
}
# Keys per split. Part of every row's definition (trainer and generator alike); a multiple of every BLOCK_N.
# 512 keys of a 256-wide KV head are 512 KiB of bf16 K+V: a program's partial (a few KiB) is ~1 % of it,
# and a 64K-token sequence gives 128 splits per KV head to spread over the GPU.
SPLIT = 512
LOG2E = 1.4426950408889634
# The split-parallel path is taken only where the workspace of partials stays under this many bytes.
_WORKSPACE_CAP = 512 << 20
_MERGE_UNROLL = 8  # partials loaded per iteration of the fold (independent loads issued together)
# Split-parallel decode programs per multiprocessor (a launch choice: every split's partial is the same whichever
# program computes it). More programs than two a multiprocessor keep more key blocks in flight: at 32K contexts
# B = 8, 8 brought a call from 0.71 to 0.55 ms on an H100 (docs/gpu_runs.md §25).
PROGRAMS_PER_SM = 8


@dataclass(frozen=True)
class Launch:
    """How the kernel is launched, apart from what fixes the bits (``CONFIGS``, ``SPLIT``): software
    prefetch of the next key block, pipelining stages (None: the tile table's), per path. A decode tile of
    fewer rows than the table's would waste fewer tensor-core rows at GQA 4, but on the H100 a 16- or 32-row dot
    is another matrix instruction and rounds some rows differently (docs/gpu_runs.md §19, "Long contexts and full
    depth"): the tile's shape is part of the definition, not of the launch."""

    prefetch: int = 0
    stages: int | None = None
    # per-tile path only: rows of a query tile and warps (None: the table's). On Hopper a tile of 64 or more rows
    # is cut into 64-row warpgroup instructions, so a taller tile may keep every row's bits -- which a benchmark
    # checks against the table's tile before a launch may use it; the split path's tile is the table's.
    rows: int | None = None
    warps: int | None = None


# With key blocks of 64 at head size 256 neither path gains from loading the next block ahead in software (the
# split-parallel decode lost 5-12 % with it, the prefill 15 %): the table's pipelining stages alone.
# (The timings: docs/gpu_runs.md §19, "Long contexts and full depth".)
LAUNCH = {"tile": Launch(), "split": Launch()}
# Per-tile launches by padded head size where a taller tile was measured to keep the table's bits and run faster:
# at 256, 128 rows on 8 warps read each key block for twice the queries (the 32K prefill 1.64x faster on an H100,
# every row equal to the 64-row tile's). Other head sizes keep ``LAUNCH["tile"]`` until measured.
TILE_LAUNCH: dict[int, Launch] = {256: Launch(rows=128, warps=8)}


@triton.jit
def _merge(M, L, A, m, l, a):
    """Fold a split's partial ``(m, l, a)`` into the running ``(M, L, A)``. A split with no visible key for a
    row (``m == -inf``) leaves that row exactly as it was."""
    M_new = tl.maximum(M, m)
    alpha = tl.where(M_new == M, 1.0, tl.math.exp2(M - M_new))
    beta = tl.where(M_new == m, 1.0, tl.math.exp2(m - M_new))
    skip = m == float("-inf")
    L_out = tl.where(skip, L, L * alpha + l * beta)
    A_out = tl.where(skip[:, None], A, A * alpha[:, None] + a * beta[:, None])
    return tl.where(skip, M, M_new), L_out, A_out


@triton.jit
def _kv_tile(k_ptr, v_ptr, seq, kv_head, k_base, block_table_ptr, stride_bt, block_size,
             stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
             start_n, bound, offs_d, d_ok, BLOCK_N: tl.constexpr, PAGED: tl.constexpr):
    """Keys ``[BLOCK_D, BLOCK_N]`` and values ``[BLOCK_N, BLOCK_D]`` of positions ``start_n ..`` (zeros at and
    past ``bound``), and which of them exist."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < bound
    if PAGED:
        blk = tl.load(block_table_ptr + seq * stride_bt + offs_n // block_size, mask=n_ok, other=0).to(tl.int64)
        in_blk = (offs_n % block_size).to(tl.int64)
        k_row = blk * stride_kb + in_blk * stride_kp
        v_row = blk * stride_vb + in_blk * stride_vp
    else:
        k_row = (k_base + offs_n) * stride_kp
        v_row = (k_base + offs_n) * stride_vp
    k = tl.load(k_ptr + k_row[None, :] + kv_head * stride_kh + offs_d[:, None],
                mask=n_ok[None, :] & d_ok[:, None], other=0.0)
    v = tl.load(v_ptr + v_row[:, None] + kv_head * stride_vh + offs_d[None, :],
                mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    return k, v


@triton.jit
def _split_partial(
    q, k_ptr, v_ptr, seq, kv_head, k_base, block_table_ptr, stride_bt, block_size,
    stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
    pos_m, L, lo, hi, qk_scale, offs_d, d_ok,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PAGED: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Online softmax over keys ``lo .. hi-1`` (one split, or its part below the tile's horizon) from a fresh
    state: ``(m, l, acc)`` per row, ``m = -inf`` for a row that sees none of these keys. ``PREFETCH``: the next
    block's keys and values are loaded before this block is computed (the same values: speed only)."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if PREFETCH:
        k_nxt, v_nxt = _kv_tile(k_ptr, v_ptr, seq, kv_head, k_base, block_table_ptr, stride_bt, block_size,
                                stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
                                lo, tl.minimum(L, hi), offs_d, d_ok, BLOCK_N, PAGED)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < L
        if PREFETCH:
            k, v = k_nxt, v_nxt
            # keys past hi are never used: the last prefetch reads nothing
            k_nxt, v_nxt = _kv_tile(k_ptr, v_ptr, seq, kv_head, k_base, block_table_ptr, stride_bt, block_size,
                                    stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
                                    start_n + BLOCK_N, tl.minimum(L, hi), offs_d, d_ok, BLOCK_N, PAGED)
        else:
            k, v = _kv_tile(k_ptr, v_ptr, seq, kv_head, k_base, block_table_ptr, stride_bt, block_size,
                            stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
                            start_n, tl.minimum(L, hi), offs_d, d_ok, BLOCK_N, PAGED)
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
        # a row with no visible key yet subtracts 0, not -inf, so its p is exactly 0 (not NaN)
        p = tl.math.exp2(s - tl.where(m_new == float("-inf"), 0.0, m_new)[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        p_lo = p.to(v.dtype)
        if UPCAST:
            acc += tl.dot(p_lo.to(tl.float64), v.to(tl.float64)).to(tl.float32)
        else:
            acc = tl.dot(p_lo, v, acc, input_precision=INPUT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["block_size", "n_progs", "ws_splits"])
def _bi_attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, ws_acc_ptr, ws_ml_ptr,
    cu_q_ptr, seq_lens_ptr, k_start_ptr, block_table_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh, stride_bt,
    block_size, qk_scale, n_progs, ws_splits,
    N_HEADS: tl.constexpr, GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PAGED: tl.constexpr,
    UPCAST: tl.constexpr, INPUT_PRECISION: tl.constexpr, SPLIT_OUT: tl.constexpr, PREFETCH: tl.constexpr,
):
    """``SPLIT_OUT`` False: program ``(tile, seq, kv_head)`` folds every split of its tile and writes the
    output. True: program ``(p, seq, kv_head)`` writes the partials of splits ``p, p + n_progs, ...`` (the
    sequence's queries fit tile 0) to the workspace, indexed ``(token * N_HEADS + head) * ws_splits + j``."""
    pid = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    tile = 0 if SPLIT_OUT else pid
    QPT: tl.constexpr = BLOCK_M // GQA  # queries per tile: its rows are (query, head of the group) pairs
    q_beg = tl.load(cu_q_ptr + seq)
    n_q = tl.load(cu_q_ptr + seq + 1) - q_beg
    if tile * QPT < n_q:
        L = tl.load(seq_lens_ptr + seq)
        ctx = L - n_q
        offs_r = tl.arange(0, BLOCK_M)
        q_idx = tile * QPT + offs_r // GQA
        head = kv_head * GQA + offs_r % GQA
        row_ok = (offs_r < QPT * GQA) & (q_idx < n_q)
        pos_m = ctx + q_idx
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        rows_q = (q_beg + q_idx).to(tl.int64)
        q = tl.load(q_ptr + rows_q[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        # keys the tile's last real row may see: positions 0 .. ctx + last query
        hi = ctx + tl.minimum((tile + 1) * QPT, n_q)
        if PAGED:
            k_base = 0
        else:
            k_base = tl.load(k_start_ptr + seq).to(tl.int64)
        if SPLIT_OUT:
            n_split = tl.cdiv(hi, SPLIT)
            for j in range(pid, n_split, n_progs):
                lo = j * SPLIT
                m_j, l_j, a_j = _split_partial(
                    q, k_ptr, v_ptr, seq, kv_head, k_base, block_table_ptr, stride_bt, block_size,
                    stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
                    pos_m, L, lo, tl.minimum(lo + SPLIT, hi), qk_scale, offs_d, d_ok,
                    BLOCK_M, BLOCK_N, BLOCK_D, PAGED, UPCAST, INPUT_PRECISION, PREFETCH)
                ws = (rows_q * N_HEADS + head) * ws_splits + j
                tl.store(ws_ml_ptr + ws * 2, m_j, mask=row_ok)
                tl.store(ws_ml_ptr + ws * 2 + 1, l_j, mask=row_ok)
                tl.store(ws_acc_ptr + ws[:, None] * BLOCK_D + offs_d[None, :], a_j,
                         mask=row_ok[:, None] & (offs_d < BLOCK_D)[None, :])
        else:
            M = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            Ls = tl.zeros([BLOCK_M], dtype=tl.float32)
            A = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            for lo in range(0, hi, SPLIT):
                m_j, l_j, a_j = _split_partial(
                    q, k_ptr, v_ptr, seq, kv_head, k_base, block_table_ptr, stride_bt, block_size,
                    stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
                    pos_m, L, lo, tl.minimum(lo + SPLIT, hi), qk_scale, offs_d, d_ok,
                    BLOCK_M, BLOCK_N, BLOCK_D, PAGED, UPCAST, INPUT_PRECISION, PREFETCH)
                M, Ls, A = _merge(M, Ls, A, m_j, l_j, a_j)
            o = A / Ls[:, None]
            tl.store(o_ptr + rows_q[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["ws_splits"])
def _bi_attn_merge_kernel(
    o_ptr, ws_acc_ptr, ws_ml_ptr, cu_q_ptr, seq_lens_ptr, stride_ot, stride_oh, ws_splits,
    N_HEADS: tl.constexpr, GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, SPLIT: tl.constexpr, UNROLL: tl.constexpr,
):
    """Program ``(seq, kv_head)``: fold the partials of the group's rows (the sequence's queries x the
    group's heads, at most ``BLOCK_R``) in ascending split order, then write ``A / L``."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_beg = tl.load(cu_q_ptr + seq)
    n_q = tl.load(cu_q_ptr + seq + 1) - q_beg
    if n_q > 0:
        L = tl.load(seq_lens_ptr + seq)
        offs_r = tl.arange(0, BLOCK_R)
        q_idx = offs_r // GQA
        head = kv_head * GQA + offs_r % GQA
        row_ok = q_idx < n_q
        offs_d = tl.arange(0, BLOCK_D)
        rows_q = (q_beg + q_idx).to(tl.int64)
        ws_row = (rows_q * N_HEADS + head) * ws_splits
        n_split = tl.cdiv(L, SPLIT)
        M = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
        Ls = tl.zeros([BLOCK_R], dtype=tl.float32)
        A = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        for j0 in range(0, n_split, UNROLL):
            for u in tl.static_range(UNROLL):
                ok = row_ok & ((j0 + u + offs_r * 0) < n_split)
                ws = ws_row + j0 + u
                # a partial past the sequence's splits reads as m = -inf: the fold skips it
                m_j = tl.load(ws_ml_ptr + ws * 2, mask=ok, other=float("-inf"))
                l_j = tl.load(ws_ml_ptr + ws * 2 + 1, mask=ok, other=0.0)
                a_j = tl.load(ws_acc_ptr + ws[:, None] * BLOCK_D + offs_d[None, :],
                              mask=ok[:, None] & (offs_d < BLOCK_D)[None, :], other=0.0)
                M, Ls, A = _merge(M, Ls, A, m_j, l_j, a_j)
        o = A / Ls[:, None]
        tl.store(o_ptr + rows_q[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_d < HEAD_DIM)[None, :])


def config_for(head_dim: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_D, BLOCK_M, BLOCK_N, num_warps, num_stages) for a head size."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    if block_d not in CONFIGS:
        raise ValueError(f"batch-invariant attention supports head sizes up to 256; got {head_dim}")
    return (block_d, *CONFIGS[block_d])


def group_problem(n_heads: int, n_kv_heads: int, head_dim: int) -> str | None:
    """Why this kernel cannot serve these heads (None if it can): a tile holds whole GQA groups."""
    try:
        bm = config_for(head_dim)[1]
    except ValueError as e:
        return str(e)
    if n_kv_heads <= 0 or n_heads % n_kv_heads:
        return f"query heads ({n_heads}) must be a multiple of key/value heads ({n_kv_heads})"
    if n_heads // n_kv_heads > bm:
        return f"batch-invariant attention takes at most {bm} query heads per key/value head; got {n_heads // n_kv_heads}"
    return None


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def split_programs(n_seqs: int, n_kv: int, max_splits: int, device: torch.device,
                   per_sm: int = PROGRAMS_PER_SM) -> int:
    """Programs per (sequence, KV head) for a split-parallel launch: enough for about ``per_sm`` programs per
    multiprocessor over the whole launch (a function of the launch's shape alone, never of its data, so a CUDA
    graph captures it). 1 means the per-tile path."""
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) if device.type == "cuda" else 8
    return max(1, min(max_splits, triton.cdiv(per_sm * sms, max(1, n_seqs * n_kv))))


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
    split_programs_override: int | None = None,
    launch: Launch | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries ``[T, N, H]`` (``cu_q`` ``[S+1]``, ``seq_lens`` ``[S]`` keys per
    sequence, ``max_q`` a bound on queries per sequence). Keys/values either packed ``[R, K, H]`` with
    sequence ``i`` at rows ``k_start[i]..`` or paged ``[num_blocks, block_size, K, H]`` (any strides,
    last dim contiguous) through ``block_table`` ``[S, max_blocks]``. Returns ``[T, N, H]`` in q's dtype.

    Launches whose sequences each fit one query tile (decode steps) reduce the splits in parallel
    programs; ``split_programs_override`` fixes the programs per (sequence, KV head) (1: the per-tile path),
    for tests: the bits are the same for every value, as for ``launch`` (default: ``LAUNCH`` of the path taken)."""
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
        max_keys = block_table.shape[1] * block_size
    else:
        if k.dim() != 3 or v.shape[:2] != k.shape[:2]:
            raise ValueError(f"packed k/v must be [R, K, H]; got {tuple(k.shape)}, {tuple(v.shape)}")
        block_size, n_kv = 1, k.shape[1]
        stride_kb, stride_kp, stride_kh = 0, k.stride(0), k.stride(1)
        stride_vb, stride_vp, stride_vh = 0, v.stride(0), v.stride(1)
        max_keys = k.shape[0]
    if k.shape[-1] != H or v.shape[-1] != H:
        raise ValueError(f"q/k/v head sizes differ: {H}, {k.shape[-1]}, {v.shape[-1]}")
    if (problem := group_problem(N, n_kv, H)) is not None:
        raise ValueError(problem)
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
    gqa = N // n_kv
    how_split = launch or LAUNCH["split"]
    max_splits = triton.cdiv(max(max_keys, 1), SPLIT)
    if split_programs_override is not None:
        n_progs = max(1, min(int(split_programs_override), max_splits))
    else:
        n_progs = split_programs(S, n_kv, max_splits, q_TNH.device)
    split_out = (max_q * gqa <= bm and n_progs > 1
                 and T * N * max_splits * (block_d + 2) * 4 <= _WORKSPACE_CAP)
    if split_out:
        ws_acc = torch.empty(T * N * max_splits, block_d, dtype=torch.float32, device=q_TNH.device)
        ws_ml = torch.empty(T * N * max_splits, 2, dtype=torch.float32, device=q_TNH.device)
        grid = (n_progs, S, n_kv)
        how = how_split
    else:
        ws_acc = ws_ml = o  # unused pointer arguments still need a tensor
        how = launch or TILE_LAUNCH.get(block_d, LAUNCH["tile"])
        if how.rows is not None:
            if how.rows < bm or how.rows & (how.rows - 1):
                raise ValueError(f"a query tile of {how.rows} rows: must be a power of two >= the table's {bm}")
            bm = how.rows
        warps = how.warps or warps
        grid = (triton.cdiv(max_q, bm // gqa), S, n_kv)
    dummy = cu_q
    common = dict(N_HEADS=N, GQA=gqa, HEAD_DIM=H, BLOCK_D=block_d, SPLIT=SPLIT)
    # no contraction of a*b + c into fma: the fold must round alike in both kernels (see the module doc)
    fusion = {} if q_TNH.device.type != "cuda" else {"enable_fp_fusion": False}
    _bi_attn_fwd_kernel[grid](
        q_TNH, k, v, o, ws_acc, ws_ml,
        cu_q, seq_lens, k_start if k_start is not None else dummy, block_table if paged else dummy,
        q_TNH.stride(0), q_TNH.stride(1), o.stride(0), o.stride(1),
        stride_kb, stride_kp, stride_kh, stride_vb, stride_vp, stride_vh,
        block_table.stride(0) if paged else 0,
        block_size, scale * LOG2E, n_progs, max_splits,
        **common, BLOCK_M=bm, BLOCK_N=bn, PAGED=paged, UPCAST=q_TNH.device.type != "cuda",
        INPUT_PRECISION="ieee" if q_TNH.dtype == torch.float32 else "tf32",  # fp32: full-precision dots
        SPLIT_OUT=split_out, PREFETCH=how.prefetch, num_warps=warps, num_stages=how.stages or stages, **fusion,
    )
    if split_out:
        _bi_attn_merge_kernel[(S, n_kv)](
            o, ws_acc, ws_ml, cu_q, seq_lens, o.stride(0), o.stride(1), max_splits,
            **common, BLOCK_R=max(2, triton.next_power_of_2(max_q * gqa)), UNROLL=_MERGE_UNROLL,
            num_warps=4, **fusion,
        )
    return o
