"""Triton kernels of the chunk-grid gated delta rule's boundary states (``kernels.gdn_chunk_grid`` has the
definition, the layouts and the public API; this module only launches). The rows are the recurrent kernel's
(``kernels.gdn_triton``), launched by ``gdn_chunk_grid``.

Three kernels, and every call -- a packed prefill, a prefill continued mid-chunk, a decode step -- runs these same
compiled kernels on whole ``C``-row chunk tiles (the same constexprs, ``num_warps`` and tile shapes, so the same
layouts and the same order inside every ``tl.dot`` and reduction):

- ``_intra_kernel``, program (piece, value head), only for a piece that completes its chunk (the others exit at
  once, which is what a decode step that folds nothing costs): the chunk's 64 raw rows (earlier rows of an open
  chunk from the state buffer, the call's rows from its inputs) in four 16-row blocks, ``G``, the blocks of ``A``
  and ``T = (I + A)^-1`` in registers, and ``W``, ``U`` and the fold's decayed keys into scratch. Nothing it
  writes is read back in the same launch (no barrier to trust between the threads of one program);
- ``_save_kernel``, program (piece, value head): the call's rows of a sequence's last, open chunk into the buffer.
  A launch of its own, after ``_intra_kernel``: a call that continues one open chunk and ends in another reads the
  first's earlier rows from the same buffer rows the second's new rows go to, and programs of one launch run in no
  set order (the interpreter runs them in order, so only this ordering keeps the GPU honest);
- ``_chain_kernel``, program (sequence, value head, ``BV`` value columns): the sequence's pieces in order, folding
  each complete chunk into the boundary state ``S_b``, writing the state each later piece's rows start from into
  the per-piece scratch, and ``S_b`` (and, where the sequence's last piece completes its chunk, the running state)
  back to the caches.

A fold's bits do not depend on the call that makes it: it always reads the chunk's 64 rows (from the buffer or
the inputs: the same values, bf16 k/v and fp32 g/beta stored as given) and ``S_b``, and runs the same compiled
kernels at the same tile shape.

Under the interpreter (CPU tensors) ``tl.dot`` runs numpy, whose float32 BLAS does not round a row alike at every
position in a tile; ``UPCAST`` makes it a float64 dot rounded once to fp32, exact for bf16 products and
position-independent for fp32 ones, so the CPU checks see the kernels' structure, not the BLAS.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ``tl.sum``'s own combine, passed to ``tl.reduce`` directly: the same reduction on a GPU, and the interpreter
# recognises it (numpy's sum) without the per-call cost of ``tl.sum``, a jitted helper
_ADD = getattr(tl.standard, "_sum_combine", None)
if _ADD is None:  # pragma: no cover - older/newer Triton without the private name

    @triton.jit
    def _ADD(a, b):  # type: ignore[no-redef]
        return a + b


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """``a @ b`` on tensor cores with fp32 accumulation: bf16 operands, or fp32 ones as tf32 (the inverse's block
    merges, whose result is rounded to bf16 after: tf32's 2^-11 is below that rounding; an exact fp32 dot would
    run on CUDA cores, each thread holding whole rows and columns: hundreds of registers)."""
    if UPCAST:
        return tl.dot(a.to(tl.float64), b.to(tl.float64)).to(tl.float32)
    return tl.dot(a, b, input_precision="tf32")


@triton.jit
def _rows(k_ptr, g_ptr, beta_ptr, bufh_ptr, buff_ptr, t0, r0, h, hv, slot, sk_t, sk_h, sg_t, sb_t, sbuf_n,
          i: tl.constexpr, SUB: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
          C: tl.constexpr, R: tl.constexpr):
    """Row block ``i`` (chunk rows ``i SUB ..``) of the chunk's raw rows: ``k [SUB, K]`` bf16, ``g``, ``beta`` fp32
    -- rows before ``r0`` from the open chunk's buffer, the others from the call's inputs (token ``t0`` is row
    ``r0``). Read-only memory: the buffer is written by ``_save_kernel`` in a later launch."""
    offs = i * SUB + tl.arange(0, SUB)
    offs_k = tl.arange(0, K)
    old = offs < r0
    new = offs >= r0
    tok = t0 + (offs - r0).to(tl.int64)
    rows_h = bufh_ptr + slot * sbuf_n + hv * C * R
    rows_f = buff_ptr + slot * (sbuf_n // 2) + hv * C * (R // 2)
    p_gf = rows_f + offs * (R // 2) + (K + V) // 2
    k_in = tl.load(k_ptr + tok[:, None] * sk_t + h * sk_h + offs_k[None, :], mask=new[:, None], other=0.0)
    k = tl.where(old[:, None], tl.load(rows_h + offs[:, None] * R + offs_k[None, :], mask=old[:, None], other=0.0),
                 k_in.to(tl.bfloat16))
    g = tl.where(old, tl.load(p_gf, mask=old, other=0.0), tl.load(g_ptr + tok * sg_t + hv, mask=new, other=0.0)
                 .to(tl.float32))
    beta = tl.where(old, tl.load(p_gf + 1, mask=old, other=0.0),
                    tl.load(beta_ptr + tok * sb_t + hv, mask=new, other=0.0).to(tl.float32))
    return k, g, beta


@triton.jit
def _v_rows(v_ptr, bufh_ptr, t0, r0, hv, slot, sv_t, sv_h, sbuf_n, i: tl.constexpr, SUB: tl.constexpr,
            K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, R: tl.constexpr):
    """Row block ``i`` of the chunk's ``v [SUB, V]`` bf16 (as ``_rows``)."""
    offs = i * SUB + tl.arange(0, SUB)
    offs_v = tl.arange(0, V)
    old = offs < r0
    tok = t0 + (offs - r0).to(tl.int64)
    p_vh = bufh_ptr + slot * sbuf_n + hv * C * R + offs[:, None] * R + K + offs_v[None, :]
    v_in = tl.load(v_ptr + tok[:, None] * sv_t + hv * sv_h + offs_v[None, :], mask=(offs >= r0)[:, None], other=0.0)
    return tl.where(old[:, None], tl.load(p_vh, mask=old[:, None], other=0.0), v_in.to(tl.bfloat16))


@triton.jit
def _gsum(G, SUB: tl.constexpr):
    """The last entry of a row block's cumulative gate (one-hot: exact)."""
    return tl.reduce(tl.where(tl.arange(0, SUB) == SUB - 1, G, 0.0), 0, _ADD)


@triton.jit
def _A_block(ki, kj, bi, Gi, Gj, UPCAST: tl.constexpr):
    """``beta_i exp(G_i - G_j) (k_i . k_j)`` for row block i against an earlier row block j (every entry below
    the chunk's diagonal, so every decay <= 1)."""
    return (bi[:, None] * tl.exp(Gi[:, None] - Gj[None, :])) * _dot(ki, tl.trans(kj), UPCAST)


@triton.jit
def _inv_unit_lower(A, SUB: tl.constexpr):
    """``(I + A)^-1`` of a strictly lower ``A [SUB, SUB]`` in registers, by forward substitution row by row."""
    o_s = tl.arange(0, SUB)
    T = tl.where(o_s[:, None] == o_s[None, :], 1.0, 0.0)
    for i in range(1, SUB):
        # T[i, :] = e_i - sum_{l < i} A[i, l] T[l, :] (A[i, l >= i] is zero: later rows add exact zeros)
        a_i = tl.reduce(tl.where(o_s[:, None] == i, A, 0.0), 0, _ADD)  # row i (one-hot: exact)
        t_i = -tl.reduce(a_i[:, None] * T, 0, _ADD)
        T = tl.where(o_s[:, None] == i, tl.where(o_s[None, :] == i, 1.0, t_i[None, :]), T)
    return T


@triton.jit
def _wu_block(T0, T1, T2, T3, X0, X1, X2, X3, n: tl.constexpr, UPCAST: tl.constexpr):
    """``sum_{j < n} T_j X_j`` (T bf16-rounded; the first ``n`` pairs), fp32."""
    acc = _dot(T0.to(tl.bfloat16), X0, UPCAST)
    if n > 1:
        acc += _dot(T1.to(tl.bfloat16), X1, UPCAST)
    if n > 2:
        acc += _dot(T2.to(tl.bfloat16), X2, UPCAST)
    if n > 3:
        acc += _dot(T3.to(tl.bfloat16), X3, UPCAST)
    return acc


# Triton compiles a variant per integer equal to 1 / divisible by 16: the strides are left unspecialised (one
# compiled kernel whatever the step's layout). Pointers keep Triton's alignment specialisation (16-byte accesses):
# ``kernels.gdn_chunk_grid`` hands the kernels 16-byte-aligned tensors only (an input slice that is not is copied,
# the caches are checked by ``state_layout_ok``), so every call compiles the same variant.
_INTRA_INTS = ["sk_t", "sk_h", "sv_t", "sv_h", "sg_t", "sb_t", "sbuf_n"]
_CHAIN_INTS = ["sb_n", "srun_n"]


@triton.jit(do_not_specialize=_INTRA_INTS)
def _intra_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, tok_ptr, r0_ptr, r1_ptr, slot_ptr, bufh_ptr, buff_ptr,
    w_ptr, u_ptr, kg_ptr, gl_ptr,
    sk_t, sk_h, sv_t, sv_h, sg_t, sb_t, sbuf_n,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, R: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The fold's operands of a chunk the piece completes, in four ``SUB = C / 4``-row blocks held in registers
    from the first load to the last store: no memory this program writes is read back."""
    c = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    r1 = tl.load(r1_ptr + c)
    if r1 == C:  # only a piece that completes its chunk folds
        SUB: tl.constexpr = C // 4
        h = hv // (HV // H)
        t0 = tl.load(tok_ptr + c).to(tl.int64)
        r0 = tl.load(r0_ptr + c)
        slot = tl.load(slot_ptr + c).to(tl.int64)
        a = (k_ptr, g_ptr, beta_ptr, bufh_ptr, buff_ptr, t0, r0, h, hv, slot, sk_t, sk_h, sg_t, sb_t, sbuf_n)
        k0, g0, b0 = _rows(*a, 0, SUB, HV, K, V, C, R)
        k1, g1, b1 = _rows(*a, 1, SUB, HV, K, V, C, R)
        k2, g2, b2 = _rows(*a, 2, SUB, HV, K, V, C, R)
        k3, g3, b3 = _rows(*a, 3, SUB, HV, K, V, C, R)
        # G = cumsum(g) over the chunk: block by block, each block's cumsum plus the gates before it
        G0 = tl.cumsum(g0, 0)
        G1 = tl.cumsum(g1, 0) + _gsum(G0, SUB)
        G2 = tl.cumsum(g2, 0) + _gsum(G1, SUB)
        G3 = tl.cumsum(g3, 0) + _gsum(G2, SUB)
        G_last = _gsum(G3, SUB)
        base = c * HV + hv
        o_s = tl.arange(0, SUB)
        offs_k = tl.arange(0, K)
        offs_v = tl.arange(0, V)
        # keys as the fold weighs them, decayed to the chunk's last row
        p_kg = kg_ptr + base * C * K + o_s[:, None] * K + offs_k[None, :]
        tl.store(p_kg, (k0.to(tl.float32) * tl.exp(G_last - G0)[:, None]).to(tl.bfloat16))
        tl.store(p_kg + SUB * K, (k1.to(tl.float32) * tl.exp(G_last - G1)[:, None]).to(tl.bfloat16))
        tl.store(p_kg + 2 * SUB * K, (k2.to(tl.float32) * tl.exp(G_last - G2)[:, None]).to(tl.bfloat16))
        tl.store(p_kg + 3 * SUB * K, (k3.to(tl.float32) * tl.exp(G_last - G3)[:, None]).to(tl.bfloat16))
        tl.store(gl_ptr + base, G_last)
        # the blocks of A (the last use of the keys but for W's operands)
        low = o_s[:, None] > o_s[None, :]
        A00 = tl.where(low, _A_block(k0, k0, b0, G0, G0, UPCAST), 0.0)
        A11 = tl.where(low, _A_block(k1, k1, b1, G1, G1, UPCAST), 0.0)
        A22 = tl.where(low, _A_block(k2, k2, b2, G2, G2, UPCAST), 0.0)
        A33 = tl.where(low, _A_block(k3, k3, b3, G3, G3, UPCAST), 0.0)
        A10 = _A_block(k1, k0, b1, G1, G0, UPCAST)
        A20 = _A_block(k2, k0, b2, G2, G0, UPCAST)
        A21 = _A_block(k2, k1, b2, G2, G1, UPCAST)
        A30 = _A_block(k3, k0, b3, G3, G0, UPCAST)
        A31 = _A_block(k3, k1, b3, G3, G1, UPCAST)
        A32 = _A_block(k3, k2, b3, G3, G2, UPCAST)
        # W_i = sum_j T_ij (k_j beta_j exp(G_j)), U_i = sum_j T_ij (v_j beta_j): bf16 operands
        X0 = (k0.to(tl.float32) * (b0 * tl.exp(G0))[:, None]).to(tl.bfloat16)
        X1 = (k1.to(tl.float32) * (b1 * tl.exp(G1))[:, None]).to(tl.bfloat16)
        X2 = (k2.to(tl.float32) * (b2 * tl.exp(G2))[:, None]).to(tl.bfloat16)
        X3 = (k3.to(tl.float32) * (b3 * tl.exp(G3))[:, None]).to(tl.bfloat16)
        # the diagonal blocks of T = (I + A)^-1, then the blocks below by block forward substitution
        # T_ij = -T_ii sum_{j <= m < i} A_im T_mj (tf32 merges, rounded to bf16 after)
        T00 = _inv_unit_lower(A00, SUB)
        T11 = _inv_unit_lower(A11, SUB)
        T22 = _inv_unit_lower(A22, SUB)
        T33 = _inv_unit_lower(A33, SUB)
        T10 = -_dot(T11, _dot(A10, T00, UPCAST), UPCAST)
        T21 = -_dot(T22, _dot(A21, T11, UPCAST), UPCAST)
        T20 = -_dot(T22, _dot(A20, T00, UPCAST) + _dot(A21, T10, UPCAST), UPCAST)
        T32 = -_dot(T33, _dot(A32, T22, UPCAST), UPCAST)
        T31 = -_dot(T33, _dot(A31, T11, UPCAST) + _dot(A32, T21, UPCAST), UPCAST)
        T30 = -_dot(T33, _dot(A30, T00, UPCAST) + _dot(A31, T10, UPCAST) + _dot(A32, T20, UPCAST), UPCAST)
        p_w = w_ptr + base * C * K + o_s[:, None] * K + offs_k[None, :]
        tl.store(p_w, _wu_block(T00, T00, T00, T00, X0, X0, X0, X0, 1, UPCAST).to(tl.bfloat16))
        tl.store(p_w + SUB * K, _wu_block(T10, T11, T11, T11, X0, X1, X1, X1, 2, UPCAST).to(tl.bfloat16))
        tl.store(p_w + 2 * SUB * K, _wu_block(T20, T21, T22, T22, X0, X1, X2, X2, 3, UPCAST).to(tl.bfloat16))
        tl.store(p_w + 3 * SUB * K, _wu_block(T30, T31, T32, T33, X0, X1, X2, X3, 4, UPCAST).to(tl.bfloat16))
        av = (v_ptr, bufh_ptr, t0, r0, hv, slot, sv_t, sv_h, sbuf_n)
        Y0 = (_v_rows(*av, 0, SUB, K, V, C, R).to(tl.float32) * b0[:, None]).to(tl.bfloat16)
        Y1 = (_v_rows(*av, 1, SUB, K, V, C, R).to(tl.float32) * b1[:, None]).to(tl.bfloat16)
        Y2 = (_v_rows(*av, 2, SUB, K, V, C, R).to(tl.float32) * b2[:, None]).to(tl.bfloat16)
        Y3 = (_v_rows(*av, 3, SUB, K, V, C, R).to(tl.float32) * b3[:, None]).to(tl.bfloat16)
        p_u = u_ptr + base * C * V + o_s[:, None] * V + offs_v[None, :]
        tl.store(p_u, _wu_block(T00, T00, T00, T00, Y0, Y0, Y0, Y0, 1, UPCAST).to(tl.bfloat16))
        tl.store(p_u + SUB * V, _wu_block(T10, T11, T11, T11, Y0, Y1, Y1, Y1, 2, UPCAST).to(tl.bfloat16))
        tl.store(p_u + 2 * SUB * V, _wu_block(T20, T21, T22, T22, Y0, Y1, Y2, Y2, 3, UPCAST).to(tl.bfloat16))
        tl.store(p_u + 3 * SUB * V, _wu_block(T30, T31, T32, T33, Y0, Y1, Y2, Y3, 4, UPCAST).to(tl.bfloat16))


@triton.jit(do_not_specialize=["sk_t", "sk_h", "sv_t", "sv_h", "sg_t", "sb_t", "sbuf_n"])
def _save_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, tok_ptr, r0_ptr, r1_ptr, slot_ptr, save_ptr, bufh_ptr, buff_ptr,
    sk_t, sk_h, sv_t, sv_h, sg_t, sb_t, sbuf_n,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, R: tl.constexpr,
):
    """The call's rows of each sequence's last, open chunk into its buffer (see the module docstring: after
    ``_intra_kernel``, in a launch of its own)."""
    c = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    if tl.load(save_ptr + c) != 0:
        h = hv // (HV // H)
        t0 = tl.load(tok_ptr + c).to(tl.int64)
        r0 = tl.load(r0_ptr + c)
        r1 = tl.load(r1_ptr + c)
        slot = tl.load(slot_ptr + c).to(tl.int64)
        offs_c = tl.arange(0, C)
        offs_k = tl.arange(0, K)
        offs_v = tl.arange(0, V)
        new = (offs_c >= r0) & (offs_c < r1)
        tok = t0 + (offs_c - r0).to(tl.int64)
        rows_h = bufh_ptr + slot * sbuf_n + hv * C * R
        rows_f = buff_ptr + slot * (sbuf_n // 2) + hv * C * (R // 2)
        k_in = tl.load(k_ptr + tok[:, None] * sk_t + h * sk_h + offs_k[None, :], mask=new[:, None], other=0.0)
        v_in = tl.load(v_ptr + tok[:, None] * sv_t + hv * sv_h + offs_v[None, :], mask=new[:, None], other=0.0)
        g_in = tl.load(g_ptr + tok * sg_t + hv, mask=new, other=0.0).to(tl.float32)
        b_in = tl.load(beta_ptr + tok * sb_t + hv, mask=new, other=0.0).to(tl.float32)
        tl.store(rows_h + offs_c[:, None] * R + offs_k[None, :], k_in.to(tl.bfloat16), mask=new[:, None])
        tl.store(rows_h + offs_c[:, None] * R + K + offs_v[None, :], v_in.to(tl.bfloat16), mask=new[:, None])
        p_gf = rows_f + offs_c * (R // 2) + (K + V) // 2
        tl.store(p_gf, g_in, mask=new)
        tl.store(p_gf + 1, b_in, mask=new)


@triton.jit(do_not_specialize=_CHAIN_INTS)
def _chain_kernel(
    r1_ptr, first_ptr, slot_ptr, w_ptr, u_ptr, kg_ptr, gl_ptr, sb_ptr, srun_ptr, scr_ptr, sb_n, srun_n,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, UPCAST: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    i_v = tl.program_id(2)
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, K)
    offs_v = i_v * BV + tl.arange(0, BV)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    # The state's BV columns held transposed, ``St [BV, K]``, so that both products of a fold have BV (< 64) rows:
    # Triton lowers them to mma.sync. With ``S [K, BV]`` the second product has K = 128 rows and becomes a wgmma
    # (Hopper's 64-row warp-group instruction). That form was suspected of an earlier GPU failure, but on an H100
    # it gives the same fold as this one (docs/gpu_runs.md §25); the transposed form stays as the one measured and
    # shipped, its products on the same instruction path as the intra kernel's.
    p_St = hv * K * V + offs_v[:, None] + offs_k[None, :] * V
    c_beg = tl.load(first_ptr + n).to(tl.int64)
    c_end = tl.load(first_ptr + n + 1).to(tl.int64)
    last_folds = (c_end > c_beg) & (tl.load(r1_ptr + c_end - 1, mask=c_end > c_beg, other=0) == C)
    # a sequence whose pieces fold nothing (a decode step inside its chunk, a short continuation) reads nothing more
    if (c_end - c_beg > 1) | last_folds:
        St = tl.load(sb_ptr + slot * sb_n + p_St)
        for c in range(c_beg, c_end):
            if tl.load(r1_ptr + c) == C:  # every piece but a sequence's last completes its chunk
                base = c * HV + hv
                Wt = tl.load(w_ptr + base * C * K + offs_c[None, :] * K + offs_k[:, None])  # [K, C]
                Ut = tl.load(u_ptr + base * C * V + offs_c[None, :] * V + offs_v[:, None]).to(tl.float32)
                kg = tl.load(kg_ptr + base * C * K + offs_c[:, None] * K + offs_k[None, :])  # [C, K]
                G_last = tl.load(gl_ptr + base)
                delta_t = (Ut - _dot(St.to(tl.bfloat16), Wt, UPCAST)).to(tl.bfloat16)  # [BV, C]
                St = tl.exp(G_last) * St + _dot(delta_t, kg, UPCAST)
            if c + 1 < c_end:  # the next piece's rows start from this boundary state
                tl.store(scr_ptr + (c + 1) * HV * K * V + p_St, St)
        tl.store(sb_ptr + slot * sb_n + p_St, St)
        if last_folds:  # a chunk just completed: the running state restarts at its boundary
            tl.store(srun_ptr + slot * srun_n + p_St, St)


def run_folds(
    k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, plan: dict[str, torch.Tensor],
    S_b: torch.Tensor, buf: torch.Tensor, S_run: torch.Tensor, scratch: torch.Tensor | None, BV: int,
    num_warps: dict[str, int],
) -> None:
    """The three launches over ``plan`` (``gdn_chunk_grid`` builds it: per piece ``tok, r0, r1, slot, save``, per
    sequence ``first, seq_slot``): the folds into ``S_b``, the open rows into ``buf``, and where a sequence's last
    piece completes its chunk ``S_run := S_b``; ``scratch [n_pieces, HV, K, V]`` gets each later piece's starting
    state where given. Caches are indexed by slot with any slot stride (each slot contiguous)."""
    H, K = k.shape[1:]
    HV, V = v.shape[1:]
    C, R = buf.shape[2:]
    n_pieces = plan["tok"].shape[0]
    N = plan["seq_slot"].shape[0]
    dev, bf16 = v.device, torch.bfloat16
    upcast = dev.type != "cuda"
    # contraction pinned, not left to Triton's default (an environment variable): every process that computes the
    # grid -- trainer and generators -- must compile the same kernels
    opts = {} if upcast else {"enable_fp_fusion": True}
    w = torch.empty(n_pieces, HV, C, K, dtype=bf16, device=dev)
    u = torch.empty(n_pieces, HV, C, V, dtype=bf16, device=dev)
    kg = torch.empty(n_pieces, HV, C, K, dtype=bf16, device=dev)
    gl = torch.empty(n_pieces, HV, dtype=torch.float32, device=dev)
    buf_f = buf.view(torch.float32)
    strides = (k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0), buf.stride(0))
    _intra_kernel[(n_pieces, HV)](
        k, v, g, beta, plan["tok"], plan["r0"], plan["r1"], plan["slot"], buf, buf_f, w, u, kg, gl, *strides,
        H=H, HV=HV, K=K, V=V, C=C, R=R, UPCAST=upcast, num_warps=num_warps["intra"], **opts,
    )
    _save_kernel[(n_pieces, HV)](
        k, v, g, beta, plan["tok"], plan["r0"], plan["r1"], plan["slot"], plan["save"], buf, buf_f, *strides,
        H=H, HV=HV, K=K, V=V, C=C, R=R, num_warps=4,
    )
    _chain_kernel[(N, HV, V // BV)](
        plan["r1"], plan["first"], plan["seq_slot"], w, u, kg, gl, S_b, S_run, S_b if scratch is None else scratch,
        S_b.stride(0), S_run.stride(0), HV=HV, K=K, V=V, BV=BV, C=C, UPCAST=upcast,
        num_warps=num_warps["chain"], **opts,
    )
