"""Triton kernels of the chunk-grid gated delta rule (``kernels.gdn_chunk_grid`` has the definition, the layouts and
the public API; this module only launches).

How the bits are made the same in every kernel: no kernel here uses ``tl.sum``/``tl.dot`` for a real sum. Every
sum of the definition is an explicit loop (over the K index, over earlier rows ``l`` or ``j``) of element-wise
fp32 ``acc = acc + a * b`` on vectors or tiles, starting from zeros, with contraction off (``enable_fp_fusion``),
and the same association of every product in every kernel. Element-wise fp32 arithmetic is correctly rounded
whatever the layout, the tile shape or the number of warps the compiler picks, so the prefill kernels (tiles of
rows) and the decode kernel (one row) round alike. The only reductions are one-hot extractions
(``tl.reduce(tl.where(idx == l, x, 0), axis, add)``): one non-zero term, exact in any order. Operands a loop
needs element by element come from memory; a value a program wrote and then reads back crosses a
``tl.debug_barrier`` (its threads hold different parts of a tile).

Speed: a loop whose every iteration loads from memory runs ``UNROLL`` iterations per trip (an inner
``tl.static_range``, masked past a runtime trip count) so that their loads are independent instructions the GPU
issues ahead of the arithmetic chain; loops over registers only (the substitution's and the outputs' one-hot picks)
stay plain loops. Unrolling everything instead cost minutes of compilation and spilled (ptxas, sm_90a).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ``tl.sum``'s own combine, passed to ``tl.reduce`` directly: the same reduction on a GPU, and the interpreter
# recognises it (numpy's sum) without the per-call cost of ``tl.sum``, a jitted helper (about half the
# interpreter tests' time went there)
_ADD = getattr(tl.standard, "_sum_combine", None)
if _ADD is None:  # pragma: no cover - older/newer Triton without the private name

    @triton.jit
    def _ADD(a, b):  # type: ignore[no-redef]
        return a + b


UNROLL = tl.constexpr(8)  # iterations per trip of the loops that load (K, V, C: multiples of it)

@triton.jit
def _fold(S, rows_ptr, g_last, n_rows, offs_k, offs_v, R: tl.constexpr, OFF_K: tl.constexpr, OFF_D: tl.constexpr,
          OFF_G: tl.constexpr):
    """``exp(G_last) S + sum_{j < n_rows} (exp(G_last - G_j) k_j) delta_j^T``, j in order (a chunk folded into its
    entering state; ``S`` a [K, BV] block, ``offs_v`` its delta columns)."""
    acc = tl.exp(g_last) * S
    zk = offs_k * 0  # vector masks element-wise (the interpreter rejects a scalar bool & a block)
    zv = offs_v * 0
    p_k = rows_ptr + OFF_K + offs_k
    p_d = rows_ptr + OFF_D + offs_v
    for j0 in range(0, n_rows, UNROLL):
        for dj in tl.static_range(UNROLL):
            j = j0 + dj
            # rows past n_rows (stale) are masked off as they load, then left out of the sum
            k_j = tl.load(p_k + j * R, mask=(zk + j) < n_rows, other=0.0)
            g_j = tl.load(rows_ptr + j * R + OFF_G, mask=j < n_rows, other=0.0)
            d_j = tl.load(p_d + j * R, mask=(zv + j) < n_rows, other=0.0)
            acc = tl.where(j < n_rows, acc + (tl.exp(g_last - g_j) * k_j)[:, None] * d_j[None, :], acc)
    return acc


@triton.jit
def _subst_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, tok_ptr, r0_ptr, r1_ptr, scr_ptr, a_ptr,
    sk_t, sk_h, sv_t, sv_h, sg_t, sb_t,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, WU: tl.constexpr, C: tl.constexpr,
    R: tl.constexpr, OFF_K: tl.constexpr, OFF_W: tl.constexpr, OFF_G: tl.constexpr,
):
    """Program (chunk, value head): rows ``[r0, r1)`` of the chunk's ``k, G`` and ``[w | u]`` (adjacent in a row,
    solved together: one substitution over ``WU >= K + V`` columns) into its scratch rows. Rows below ``r0`` (an
    open chunk continued) are already there, copied from the state buffer. ``a_ptr``: the chunk's ``A^T``, scratch."""
    c = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    h = hv // (HV // H)
    t0 = tl.load(tok_ptr + c).to(tl.int64)
    r0 = tl.load(r0_ptr + c)
    r1 = tl.load(r1_ptr + c)
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, K)
    offs_x = tl.arange(0, WU)  # [w | u] columns
    new = (offs_c >= r0) & (offs_c < r1)
    tok = t0 + (offs_c - r0).to(tl.int64)
    rows = scr_ptr + (c * HV + hv) * C * R
    k_CK = tl.load(k_ptr + tok[:, None] * sk_t + h * sk_h + offs_k[None, :], mask=new[:, None], other=0.0)
    tl.store(rows + offs_c[:, None] * R + OFF_K + offs_k[None, :], k_CK.to(tl.float32), mask=new[:, None])
    # G: the sequential fp32 cumulative sum, continued from the open chunk's last row (0 + g_0 = g_0 exactly)
    G_prev = tl.load(rows + (r0 - 1) * R + OFF_G, mask=r0 > 0, other=0.0)
    for i0 in range(r0, r1, UNROLL):
        for di in tl.static_range(UNROLL):
            i = i0 + di
            in_piece = (i >= r0) & (i < r1)
            g_i = tl.load(g_ptr + (t0 + i - r0) * sg_t + hv, mask=in_piece, other=0.0).to(tl.float32)
            G_prev = tl.where(in_piece, G_prev + g_i, G_prev)
            tl.store(rows + i * R + OFF_G, G_prev, mask=in_piece)
    tl.debug_barrier()
    G_C = tl.load(rows + offs_c * R + OFF_G, mask=offs_c < r1, other=0.0)
    beta_C = tl.load(beta_ptr + tok * sb_t + hv, mask=new, other=0.0).to(tl.float32)
    p_kcol = rows + offs_c * R + OFF_K
    kk_CC = tl.zeros([C, C], dtype=tl.float32)
    for kk0 in range(0, K, UNROLL):
        for dkk in tl.static_range(UNROLL):
            kk = kk0 + dkk
            col = tl.load(p_kcol + kk, mask=offs_c < r1, other=0.0)
            kk_CC = kk_CC + col[:, None] * col[None, :]
    A_CC = tl.where(offs_c[:, None] > offs_c[None, :],
                    (beta_C[:, None] * tl.exp(G_C[:, None] - G_C[None, :])) * kk_CC, 0.0)
    # A transposed into scratch: the substitution loads column l of A as a contiguous row
    a_base = a_ptr + (c * HV + hv) * C * C
    tl.store(a_base + offs_c[None, :] * C + offs_c[:, None], A_CC)
    tl.debug_barrier()
    # forward substitution column by column: row i's sum takes l = 0, 1, ..., i-1 in order (the decode kernel's
    # order); a row's sum is left untouched once l reaches it. First a continued chunk's earlier rows (solved
    # already), then the new ones, each right-hand side [beta exp(G) k | beta v] formed as the decode kernel forms it
    is_w = offs_x < K
    is_v = (offs_x >= K) & (offs_x < K + V)
    zx = offs_x * 0  # vector masks element-wise: the interpreter rejects a scalar bool & a block
    p_x = rows + OFF_W + offs_x
    p_a = a_base + offs_c
    acc = tl.zeros([C, WU], dtype=tl.float32)
    for l0 in range(0, r0, UNROLL):
        for dl in tl.static_range(UNROLL):
            l = l0 + dl
            x_l = tl.load(p_x + l * R, mask=(is_w | is_v) & ((zx + l) < r0), other=0.0)
            a_C = tl.load(p_a + l * C, mask=(offs_c * 0 + l) < r0, other=0.0)
            acc = tl.where((offs_c[:, None] > l) & (l < r0), acc + a_C[:, None] * x_l[None, :], acc)
    p_beta = beta_ptr + (t0 - r0) * sb_t + hv
    p_kx = k_ptr + (t0 - r0) * sk_t + h * sk_h + offs_x
    p_vx = v_ptr + (t0 - r0) * sv_t + hv * sv_h + (offs_x - K)
    for l0 in range(r0, r1, UNROLL):
        for dl in tl.static_range(UNROLL):
            l = l0 + dl
            live = (zx + l) < r1
            beta_l = tl.load(p_beta + l * sb_t, mask=l < r1, other=0.0).to(tl.float32)
            G_l = tl.load(rows + l * R + OFF_G, mask=l < r1, other=0.0)
            k_x = tl.load(p_kx + l * sk_t, mask=live & is_w, other=0.0).to(tl.float32)
            v_x = tl.load(p_vx + l * sv_t, mask=live & is_v, other=0.0).to(tl.float32)
            a_C = tl.load(p_a + l * C, mask=(offs_c * 0 + l) < r1, other=0.0)
            acc_l = tl.reduce(tl.where(offs_c[:, None] == l, acc, 0.0), 0, _ADD)  # row l (one-hot: exact)
            x_l = tl.where(is_w, (beta_l * tl.exp(G_l)) * k_x, beta_l * v_x) - acc_l
            tl.store(p_x + l * R, x_l, mask=live & (is_w | is_v))
            acc = tl.where((offs_c[:, None] > l) & (l < r1), acc + a_C[:, None] * x_l[None, :], acc)


@triton.jit
def _chain_kernel(
    q_ptr, tok_ptr, r0_ptr, r1_ptr, first_ptr, slot_ptr, scr_ptr, s_ptr, final_ptr, o32_ptr,
    scale, sq_t, sq_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    R: tl.constexpr, OFF_K: tl.constexpr, OFF_W: tl.constexpr, OFF_U: tl.constexpr, OFF_D: tl.constexpr,
    OFF_G: tl.constexpr,
):
    """Program (sequence, value head, BV value columns): the sequence's chunks in order -- ``delta = u - S^T w``
    and the outputs' ``exp(G) S^T q`` term per chunk, the state folded at every complete chunk; the boundary
    state back in place, the running state after the last token into ``final``."""
    n = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    i_v = tl.program_id(2)
    h = hv // (HV // H)
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, K)
    offs_v = i_v * BV + tl.arange(0, BV)
    s_base = s_ptr + (tl.load(slot_ptr + n).to(tl.int64) * HV + hv) * K * V  # the sequence's state row
    p_S = offs_k[:, None] * V + offs_v[None, :]
    S = tl.load(s_base + p_S)
    final = S
    c_beg = tl.load(first_ptr + n).to(tl.int64)
    c_end = tl.load(first_ptr + n + 1).to(tl.int64)
    for c64 in range(c_beg, c_end):
        t0 = tl.load(tok_ptr + c64).to(tl.int64)
        r0 = tl.load(r0_ptr + c64)
        r1 = tl.load(r1_ptr + c64)
        new = (offs_c >= r0) & (offs_c < r1)
        tok = t0 + (offs_c - r0).to(tl.int64)
        rows = scr_ptr + (c64 * HV + hv) * C * R
        p_qcol = q_ptr + tok * sq_t + h * sq_h
        p_wcol = rows + offs_c * R + OFF_W
        # the loop below reads S row by row: through memory (this program's own block of the state)
        tl.store(s_base + p_S, S)
        tl.debug_barrier()
        x_CV = tl.zeros([C, BV], dtype=tl.float32)
        qs_CV = tl.zeros([C, BV], dtype=tl.float32)
        for kk0 in range(0, K, UNROLL):
            for dkk in tl.static_range(UNROLL):
                kk = kk0 + dkk
                s_row = tl.load(s_base + kk * V + offs_v)
                w_col = tl.load(p_wcol + kk, mask=new, other=0.0)
                q_col = tl.load(p_qcol + kk, mask=new, other=0.0).to(tl.float32) * scale
                x_CV = x_CV + w_col[:, None] * s_row[None, :]
                qs_CV = qs_CV + q_col[:, None] * s_row[None, :]
        u_CV = tl.load(rows + offs_c[:, None] * R + OFF_U + offs_v[None, :], mask=new[:, None], other=0.0)
        tl.store(rows + offs_c[:, None] * R + OFF_D + offs_v[None, :], u_CV - x_CV, mask=new[:, None])
        G_C = tl.load(rows + offs_c * R + OFF_G, mask=new, other=0.0)
        tl.store(o32_ptr + (tok[:, None] * HV + hv) * V + offs_v[None, :], tl.exp(G_C)[:, None] * qs_CV,
                 mask=new[:, None])
        tl.debug_barrier()
        g_last = tl.load(rows + (r1 - 1) * R + OFF_G)
        final = _fold(S, rows, g_last, r1, offs_k, offs_v, R, OFF_K, OFF_D, OFF_G)
        S = tl.where(r1 == C, final, S)
    tl.store(s_base + p_S, S)
    tl.store(final_ptr + (n * HV + hv) * K * V + p_S, final)


@triton.jit
def _output_kernel(
    q_ptr, tok_ptr, r0_ptr, r1_ptr, scr_ptr, o32_ptr, o_ptr,
    scale, sq_t, sq_h, so_t, so_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    R: tl.constexpr, OFF_K: tl.constexpr, OFF_D: tl.constexpr, OFF_G: tl.constexpr,
):
    """Program (chunk, value head, BV value columns): ``o_i = exp(G_i) S^T q_i + sum_{j<=i} exp(G_i - G_j)
    (q_i . k_j) delta_j`` for the chunk's new rows, the first term from the chain."""
    c = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    i_v = tl.program_id(2)
    h = hv // (HV // H)
    t0 = tl.load(tok_ptr + c).to(tl.int64)
    r0 = tl.load(r0_ptr + c)
    r1 = tl.load(r1_ptr + c)
    offs_c = tl.arange(0, C)
    offs_v = i_v * BV + tl.arange(0, BV)
    new = (offs_c >= r0) & (offs_c < r1)
    tok = t0 + (offs_c - r0).to(tl.int64)
    rows = scr_ptr + (c * HV + hv) * C * R
    p_qcol = q_ptr + tok * sq_t + h * sq_h
    p_kcol = rows + offs_c * R + OFF_K
    qk_CC = tl.zeros([C, C], dtype=tl.float32)
    for kk0 in range(0, K, UNROLL):
        for dkk in tl.static_range(UNROLL):
            kk = kk0 + dkk
            q_col = tl.load(p_qcol + kk, mask=new, other=0.0).to(tl.float32) * scale
            k_col = tl.load(p_kcol + kk, mask=offs_c < r1, other=0.0)
            qk_CC = qk_CC + q_col[:, None] * k_col[None, :]
    G_C = tl.load(rows + offs_c * R + OFF_G, mask=offs_c < r1, other=0.0)
    m_CC = tl.where(offs_c[:, None] >= offs_c[None, :], tl.exp(G_C[:, None] - G_C[None, :]) * qk_CC, 0.0)
    p_d = rows + OFF_D + offs_v
    inner = tl.zeros([C, BV], dtype=tl.float32)
    for j0 in range(0, r1, UNROLL):
        for dj in tl.static_range(UNROLL):
            j = j0 + dj
            m_C = tl.reduce(tl.where(offs_c[None, :] == j, m_CC, 0.0), 1, _ADD)  # column j (one-hot: exact)
            d_j = tl.load(p_d + j * R, mask=(offs_v * 0 + j) < r1, other=0.0)
            # a row's sum stops at j = i, as the decode kernel's does
            inner = tl.where((offs_c[:, None] >= j) & (j < r1), inner + m_C[:, None] * d_j[None, :], inner)
    p_o = (tok[:, None] * HV + hv) * V + offs_v[None, :]
    o_CV = tl.load(o32_ptr + p_o, mask=new[:, None], other=0.0) + inner
    tl.store(o_ptr + tok[:, None] * so_t + hv * so_h + offs_v[None, :], o_CV.to(o_ptr.dtype.element_ty),
             mask=new[:, None])


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, pos_ptr, slot_ptr, s_ptr, buf_ptr, o_ptr,
    scale, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sb_t, so_t, so_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, WU: tl.constexpr, C: tl.constexpr,
    R: tl.constexpr, OFF_K: tl.constexpr, OFF_W: tl.constexpr, OFF_U: tl.constexpr, OFF_D: tl.constexpr,
    OFF_G: tl.constexpr, OFF_A: tl.constexpr, OFF_M: tl.constexpr,
):
    """Program (sequence, value head): one token at row ``i = pos % C`` of the open chunk -- its buffer row
    written, its output, and the chunk folded into ``S`` at ``i = C - 1``. The step's own ``A[i, :]`` and output
    weights go through the rows' scratch columns ``OFF_A``/``OFF_M`` (read back as scalars)."""
    b = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    h = hv // (HV // H)
    i = (tl.load(pos_ptr + b) % C).to(tl.int32)
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, K)
    offs_v = tl.arange(0, V)
    offs_x = tl.arange(0, WU)
    slot = tl.load(slot_ptr + b).to(tl.int64)  # the sequence's rows of the state cache
    rows = buf_ptr + (slot * HV + hv) * C * R
    s_base = s_ptr + (slot * HV + hv) * K * V
    p_q = q_ptr + b * sq_t + h * sq_h
    p_k = k_ptr + b * sk_t + h * sk_h
    beta_i = tl.load(beta_ptr + b * sb_t + hv).to(tl.float32)
    G_i = tl.load(rows + (i - 1) * R + OFF_G, mask=i > 0, other=0.0) + tl.load(g_ptr + b * sg_t + hv).to(tl.float32)
    tl.store(rows + i * R + OFF_K + offs_k, tl.load(p_k + offs_k).to(tl.float32))
    tl.store(rows + i * R + OFF_G, G_i)
    tl.debug_barrier()
    seen = offs_c <= i
    p_kcol = rows + offs_c * R + OFF_K
    kk_C = tl.zeros([C], dtype=tl.float32)
    qk_C = tl.zeros([C], dtype=tl.float32)
    qs_V = tl.zeros([V], dtype=tl.float32)
    for kk0 in range(0, K, UNROLL):
        for dkk in tl.static_range(UNROLL):
            kk = kk0 + dkk
            col = tl.load(p_kcol + kk, mask=seen, other=0.0)
            q_s = tl.load(p_q + kk).to(tl.float32) * scale
            kk_C = kk_C + tl.load(p_k + kk).to(tl.float32) * col
            qk_C = qk_C + q_s * col
            qs_V = qs_V + q_s * tl.load(s_base + kk * V + offs_v)
    G_C = tl.load(rows + offs_c * R + OFF_G, mask=seen, other=0.0)
    tl.store(rows + offs_c * R + OFF_A, tl.where(offs_c < i, (beta_i * tl.exp(G_i - G_C)) * kk_C, 0.0), mask=seen)
    tl.store(rows + offs_c * R + OFF_M, tl.where(seen, tl.exp(G_i - G_C) * qk_C, 0.0), mask=seen)
    tl.debug_barrier()
    # the substitution's sum over l = 0..i-1 in order
    is_w = offs_x < K
    is_wu = offs_x < K + V
    acc = tl.zeros([WU], dtype=tl.float32)
    for l0 in range(0, i, UNROLL):
        for dl in tl.static_range(UNROLL):
            l = l0 + dl
            a_l = tl.load(rows + l * R + OFF_A, mask=l < i, other=0.0)
            x_l = tl.load(rows + l * R + OFF_W + offs_x, mask=is_wu & ((offs_x * 0 + l) < i), other=0.0)
            acc = tl.where(l < i, acc + a_l * x_l, acc)
    k_x = tl.load(p_k + offs_x, mask=is_w, other=0.0).to(tl.float32)
    v_x = tl.load(v_ptr + b * sv_t + hv * sv_h + (offs_x - K), mask=is_wu & (offs_x >= K), other=0.0).to(tl.float32)
    wu_i = tl.where(is_w, (beta_i * tl.exp(G_i)) * k_x, beta_i * v_x) - acc
    tl.store(rows + i * R + OFF_W + offs_x, wu_i, mask=is_wu)
    tl.debug_barrier()
    x_V = tl.zeros([V], dtype=tl.float32)
    for kk0 in range(0, K, UNROLL):
        for dkk in tl.static_range(UNROLL):
            kk = kk0 + dkk
            x_V = x_V + tl.load(rows + i * R + OFF_W + kk) * tl.load(s_base + kk * V + offs_v)
    tl.store(rows + i * R + OFF_D + offs_v, tl.load(rows + i * R + OFF_U + offs_v) - x_V)
    tl.debug_barrier()
    inner = tl.zeros([V], dtype=tl.float32)
    for j0 in range(0, i + 1, UNROLL):
        for dj in tl.static_range(UNROLL):
            j = j0 + dj
            m_j = tl.load(rows + j * R + OFF_M, mask=j <= i, other=0.0)
            d_j = tl.load(rows + j * R + OFF_D + offs_v, mask=(offs_v * 0 + j) <= i, other=0.0)
            inner = tl.where(j <= i, inner + m_j * d_j, inner)
    o = tl.exp(G_i) * qs_V + inner
    tl.store(o_ptr + b * so_t + hv * so_h + offs_v, o.to(o_ptr.dtype.element_ty))
    if i == C - 1:
        p_S = offs_k[:, None] * V + offs_v[None, :]
        S = _fold(tl.load(s_base + p_S), rows, G_i, C, offs_k, offs_v, R, OFF_K, OFF_D, OFF_G)
        tl.store(s_base + p_S, S)


def _launch_opts(dev: torch.device, num_warps: int) -> dict[str, object]:
    # no contraction into FMAs: the decode and prefill kernels must round every product and sum alike
    return {"num_warps": num_warps} if dev.type != "cuda" else {"num_warps": num_warps, "enable_fp_fusion": False}


def prefill_kernels(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    plan: dict[str, torch.Tensor], scratch: torch.Tensor, S: torch.Tensor, final: torch.Tensor, o: torch.Tensor,
    layout: dict[str, int], BV: int, num_warps: dict[str, int],
) -> None:
    """The three prefill launches (``gdn_chunk_grid.prefill`` prepares ``plan`` and ``scratch``)."""
    T, H, K = q.shape
    HV, V = v.shape[1:]
    n_chunks = plan["tok"].numel()
    N = plan["first"].numel() - 1
    C, R = scratch.shape[2], scratch.shape[3]
    offs = {f"OFF_{n}": layout[n] for n in ("K", "W", "U", "D", "G")}
    o32 = torch.empty(T, HV, V, dtype=torch.float32, device=v.device)
    a_scr = torch.empty(n_chunks, HV, C, C, dtype=torch.float32, device=v.device)
    _subst_kernel[(n_chunks, HV)](
        k, v, g, beta, plan["tok"], plan["r0"], plan["r1"], scratch, a_scr,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        H=H, HV=HV, K=K, V=V, WU=triton.next_power_of_2(K + V), C=C, R=R, OFF_K=offs["OFF_K"],
        OFF_W=offs["OFF_W"], OFF_G=offs["OFF_G"], **_launch_opts(v.device, num_warps["subst"]),
    )
    _chain_kernel[(N, HV, V // BV)](
        q, plan["tok"], plan["r0"], plan["r1"], plan["first"], plan["slot"], scratch, S, final, o32,
        scale, q.stride(0), q.stride(1), H=H, HV=HV, K=K, V=V, BV=BV, C=C, R=R, **offs,
        **_launch_opts(v.device, num_warps["chain"]),
    )
    _output_kernel[(n_chunks, HV, V // BV)](
        q, plan["tok"], plan["r0"], plan["r1"], scratch, o32, o,
        scale, q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        H=H, HV=HV, K=K, V=V, BV=BV, C=C, R=R, OFF_K=offs["OFF_K"], OFF_D=offs["OFF_D"], OFF_G=offs["OFF_G"],
        **_launch_opts(v.device, num_warps["output"]),
    )


def decode_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    pos: torch.Tensor, slots: torch.Tensor, S: torch.Tensor, buf: torch.Tensor, o: torch.Tensor,
    layout: dict[str, int],
    num_warps: dict[str, int],
) -> None:
    B, H, K = q.shape
    HV, V = v.shape[1:]
    C, R = buf.shape[2], buf.shape[3]
    offs = {f"OFF_{n}": layout[n] for n in ("K", "W", "U", "D", "G", "A", "M")}
    _decode_kernel[(B, HV)](
        q, k, v, g, beta, pos, slots, S, buf, o,
        scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
        beta.stride(0), o.stride(0), o.stride(1),
        H=H, HV=HV, K=K, V=V, WU=triton.next_power_of_2(K + V), C=C, R=R, **offs,
        **_launch_opts(v.device, num_warps["decode"]),
    )
