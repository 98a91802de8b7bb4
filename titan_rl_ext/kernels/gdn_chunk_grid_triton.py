"""Triton kernels of the chunk-grid gated delta rule (``kernels.gdn_chunk_grid`` has the definition, the layouts and
the public API; this module only launches).

Two kernels of arithmetic, and every call -- a packed prefill, a prefill continued mid-chunk, a decode step -- runs
these same two compiled kernels on whole ``C``-row chunk tiles (the same constexprs, ``num_warps`` and tile shapes,
so the same layouts and the same order inside every ``tl.dot`` and reduction):

- ``_intra_kernel``, program (chunk, value head): the chunk's rows (earlier rows of an open chunk from the state
  buffer, the call's rows from its inputs, zeros after), ``G``, ``A``, ``T = (I + A)^-1``, ``W``, ``U``, the output
  weights ``M`` and the fold's scaled keys, into scratch;
- ``_save_kernel``, program (chunk, value head): the call's rows of a sequence's last, open chunk into the buffer
  (after every ``_intra_kernel`` program has read the earlier rows there);
- ``_chain_kernel``, program (sequence, value head, ``BV`` value columns): the sequence's chunks in order --
  ``delta = U - W S``, the outputs, the fold into ``S`` at complete chunks, the state after the last token.

Why a row's bits do not depend on the rows after it: each element of a ``tl.dot`` result is computed from its own
row of the left operand and its own column of the right one, in an order fixed by the (fixed) tile shape; every
triangular factor (``A``, ``T``, ``M``) has exact zeros above its diagonal (``tl.where`` / masked loads), so the
terms a later row contributes to row ``t`` are exact zeros whatever that row holds, as long as it is finite (rows
after the chunk's last are loaded as zeros, never read from stale memory); ``tl.cumsum`` gives row ``t`` from rows
``<= t``. Hence row ``t`` of a chunk whose later rows are zeros (a decode step, a packed prompt's last chunk) has
the bits of the same row in the completed chunk.

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


SUB = tl.constexpr(16)  # side of the diagonal blocks inverted by forward substitution (a tensor-core tile side)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """``a @ b`` on tensor cores with fp32 accumulation: bf16 operands, or fp32 ones as tf32 (the inverse's block
    merges, whose result is rounded to bf16 after: tf32's 2^-11 is below that rounding; an exact fp32 dot would
    run on CUDA cores, each thread holding whole rows and columns: hundreds of registers)."""
    if UPCAST:
        return tl.dot(a.to(tl.float64), b.to(tl.float64)).to(tl.float32)
    return tl.dot(a, b, input_precision="tf32")


@triton.jit
def _solve_unit_lower(a_base, C: tl.constexpr, UPCAST: tl.constexpr):
    """``T = (I + A)^-1`` in place of the strictly lower ``A [C, C]`` at ``a_base`` (fp32, row-major): each
    ``SUB``-row diagonal block by forward substitution, the blocks below it by block forward substitution
    ``T_ij = -T_ii (sum_{j <= m < i} A_im T_mj)`` as one dot (tf32: ``_dot``) over the row block's columns left of
    the diagonal.
    Entries above the diagonal are left as they were: readers mask them."""
    o_s = tl.arange(0, SUB)
    offs_c = tl.arange(0, C)
    eye = tl.where(o_s[:, None] == o_s[None, :], 1.0, 0.0)
    for bi in tl.static_range(C // SUB):
        rows = bi * SUB + o_s
        A_ii = tl.load(a_base + rows[:, None] * C + bi * SUB + o_s[None, :])
        # row block bi of A left of its diagonal block (rows of T above it are final)
        A_row = tl.load(a_base + rows[:, None] * C + offs_c[None, :], mask=offs_c[None, :] < bi * SUB, other=0.0)
        T_ii = eye
        for i in range(1, SUB):
            # T[i, :] = e_i - sum_{l < i} A[i, l] T[l, :] (A[i, l >= i] is zero: later rows add exact zeros)
            a_i = tl.reduce(tl.where(o_s[:, None] == i, A_ii, 0.0), 0, _ADD)  # row i (one-hot: exact)
            t_i = -tl.reduce(a_i[:, None] * T_ii, 0, _ADD)
            T_ii = tl.where(o_s[:, None] == i, tl.where(o_s[None, :] == i, 1.0, t_i[None, :]), T_ii)
        tl.debug_barrier()  # every thread has read row block bi of A before it is overwritten
        tl.store(a_base + rows[:, None] * C + bi * SUB + o_s[None, :], T_ii)
        for bj in tl.static_range(bi):
            T_col = tl.load(a_base + offs_c[:, None] * C + bj * SUB + o_s[None, :],
                            mask=(offs_c[:, None] >= bj * SUB) & (offs_c[:, None] < bi * SUB), other=0.0)
            T_ij = -_dot(T_ii, _dot(A_row, T_col, UPCAST), UPCAST)
            tl.store(a_base + rows[:, None] * C + bj * SUB + o_s[None, :], T_ij)
        tl.debug_barrier()


# Triton compiles a variant per pointer alignment (16-byte or not) and per integer equal to 1 / divisible by 16; a
# variant may give a loaded tile another register layout, and with it another order inside ``tl.cumsum`` and the
# substitution's ``tl.reduce`` -- so a prompt continued from a slice at an odd token would round differently from
# the whole prompt (an engine's q/k/v are views at whatever offset the step's layout gives). Every pointer and
# stride is left unspecialised: one compiled kernel for every call.
_INTRA_PTRS = ["q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr", "tok_ptr", "r0_ptr", "r1_ptr", "slot_ptr", "bufh_ptr",
               "buff_ptr", "w_ptr", "u_ptr", "m_ptr", "kg_ptr", "gs_ptr", "a_ptr"]
_CHAIN_PTRS = ["q_ptr", "tok_ptr", "r0_ptr", "r1_ptr", "first_ptr", "slot_ptr", "w_ptr", "u_ptr", "m_ptr", "kg_ptr",
               "gs_ptr", "s_ptr", "final_ptr", "o_ptr"]


@triton.jit(do_not_specialize=["sq_t", "sq_h", "sk_t", "sk_h", "sv_t", "sv_h", "sg_t", "sb_t"],
            do_not_specialize_on_alignment=_INTRA_PTRS + ["sq_t", "sq_h", "sk_t", "sk_h", "sv_t", "sv_h", "sg_t", "sb_t"])
def _intra_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, tok_ptr, r0_ptr, r1_ptr, slot_ptr, bufh_ptr, buff_ptr,
    w_ptr, u_ptr, m_ptr, kg_ptr, gs_ptr, a_ptr,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sb_t,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, R: tl.constexpr,
    UPCAST: tl.constexpr,
):
    c = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    h = hv // (HV // H)
    t0 = tl.load(tok_ptr + c).to(tl.int64)
    r0 = tl.load(r0_ptr + c)
    r1 = tl.load(r1_ptr + c)
    slot = tl.load(slot_ptr + c).to(tl.int64)
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, K)
    offs_v = tl.arange(0, V)
    old = offs_c < r0
    new = (offs_c >= r0) & (offs_c < r1)
    tok = t0 + (offs_c - r0).to(tl.int64)
    # the open chunk's raw rows: bf16 k | v, then fp32 g, beta (the buffer's fp32 view, half as many columns)
    rows_h = bufh_ptr + (slot * HV + hv) * C * R
    rows_f = buff_ptr + (slot * HV + hv) * C * (R // 2)
    p_kh = rows_h + offs_c[:, None] * R + offs_k[None, :]
    p_vh = rows_h + offs_c[:, None] * R + K + offs_v[None, :]
    p_gf = rows_f + offs_c * (R // 2) + (K + V) // 2
    k_in = tl.load(k_ptr + tok[:, None] * sk_t + h * sk_h + offs_k[None, :], mask=new[:, None], other=0.0)
    k_in = k_in.to(tl.bfloat16)
    g_in = tl.load(g_ptr + tok * sg_t + hv, mask=new, other=0.0).to(tl.float32)
    b_in = tl.load(beta_ptr + tok * sb_t + hv, mask=new, other=0.0).to(tl.float32)
    k = tl.where(old[:, None], tl.load(p_kh, mask=old[:, None], other=0.0), k_in)
    g = tl.where(old, tl.load(p_gf, mask=old, other=0.0), g_in)
    beta = tl.where(old, tl.load(p_gf + 1, mask=old, other=0.0), b_in)
    G = tl.cumsum(g, 0)
    base = c * HV + hv
    tl.store(gs_ptr + base * C + offs_c, G)
    # the products of k first, so that few tiles stay live across the inverse (register pressure)
    decay = tl.exp(G[:, None] - G[None, :])  # > 1 only above the diagonal, where it is masked off
    A = _dot(k, tl.trans(k), UPCAST)
    A = tl.where(offs_c[:, None] > offs_c[None, :], (beta[:, None] * decay) * A, 0.0)
    a_base = a_ptr + base * C * C
    tl.store(a_base + offs_c[:, None] * C + offs_c[None, :], A)
    # output weights: rows before r0 have no query here (their outputs were made when they came)
    q = tl.load(q_ptr + tok[:, None] * sq_t + h * sq_h + offs_k[None, :], mask=new[:, None], other=0.0)
    M = tl.where(offs_c[:, None] >= offs_c[None, :], decay * _dot(q.to(tl.bfloat16), tl.trans(k), UPCAST), 0.0)
    tl.store(m_ptr + base * C * C + offs_c[:, None] * C + offs_c[None, :], M.to(tl.bfloat16))
    # keys as the fold weighs them, decayed to the chunk's last row r1 - 1 (rows after it are zero)
    G_end = tl.reduce(tl.where(offs_c == r1 - 1, G, 0.0), 0, _ADD)  # one-hot: exact
    kg = k.to(tl.float32) * tl.exp(G_end - G)[:, None]
    tl.store(kg_ptr + base * C * K + offs_c[:, None] * K + offs_k[None, :], kg.to(tl.bfloat16))
    tl.debug_barrier()
    _solve_unit_lower(a_base, C, UPCAST)
    T = tl.load(a_base + offs_c[:, None] * C + offs_c[None, :], mask=offs_c[:, None] >= offs_c[None, :], other=0.0)
    T = T.to(tl.bfloat16)
    W = _dot(T, (k.to(tl.float32) * (beta * tl.exp(G))[:, None]).to(tl.bfloat16), UPCAST)
    tl.store(w_ptr + base * C * K + offs_c[:, None] * K + offs_k[None, :], W.to(tl.bfloat16))
    v_in = tl.load(v_ptr + tok[:, None] * sv_t + hv * sv_h + offs_v[None, :], mask=new[:, None], other=0.0)
    v_in = v_in.to(tl.bfloat16)
    v = tl.where(old[:, None], tl.load(p_vh, mask=old[:, None], other=0.0), v_in)
    U = _dot(T, (v.to(tl.float32) * beta[:, None]).to(tl.bfloat16), UPCAST)
    tl.store(u_ptr + base * C * V + offs_c[:, None] * V + offs_v[None, :], U.to(tl.bfloat16))


@triton.jit(do_not_specialize=["sk_t", "sk_h", "sv_t", "sv_h", "sg_t", "sb_t"])
def _save_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, tok_ptr, r0_ptr, r1_ptr, slot_ptr, save_ptr, bufh_ptr, buff_ptr,
    sk_t, sk_h, sv_t, sv_h, sg_t, sb_t,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, R: tl.constexpr,
):
    """The call's rows of each sequence's last, open chunk into its buffer. A launch of its own, after
    ``_intra_kernel``: a call that continues one open chunk and ends in another reads the first's earlier rows
    from the same buffer rows the second's new rows go to, and programs of one launch run in no set order."""
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
        rows_h = bufh_ptr + (slot * HV + hv) * C * R
        rows_f = buff_ptr + (slot * HV + hv) * C * (R // 2)
        k_in = tl.load(k_ptr + tok[:, None] * sk_t + h * sk_h + offs_k[None, :], mask=new[:, None], other=0.0)
        v_in = tl.load(v_ptr + tok[:, None] * sv_t + hv * sv_h + offs_v[None, :], mask=new[:, None], other=0.0)
        g_in = tl.load(g_ptr + tok * sg_t + hv, mask=new, other=0.0).to(tl.float32)
        b_in = tl.load(beta_ptr + tok * sb_t + hv, mask=new, other=0.0).to(tl.float32)
        tl.store(rows_h + offs_c[:, None] * R + offs_k[None, :], k_in.to(tl.bfloat16), mask=new[:, None])
        tl.store(rows_h + offs_c[:, None] * R + K + offs_v[None, :], v_in.to(tl.bfloat16), mask=new[:, None])
        p_gf = rows_f + offs_c * (R // 2) + (K + V) // 2
        tl.store(p_gf, g_in, mask=new)
        tl.store(p_gf + 1, b_in, mask=new)


@triton.jit(do_not_specialize=["scale", "sq_t", "sq_h", "so_t", "so_h", "has_final"],
            do_not_specialize_on_alignment=_CHAIN_PTRS + ["sq_t", "sq_h", "so_t", "so_h", "has_final"])
def _chain_kernel(
    q_ptr, tok_ptr, r0_ptr, r1_ptr, first_ptr, slot_ptr, w_ptr, u_ptr, m_ptr, kg_ptr, gs_ptr, s_ptr, final_ptr,
    o_ptr, scale, sq_t, sq_h, so_t, so_h, has_final,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, C: tl.constexpr,
    UPCAST: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    i_v = tl.program_id(2)
    h = hv // (HV // H)
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, K)
    offs_v = i_v * BV + tl.arange(0, BV)
    s_base = s_ptr + (tl.load(slot_ptr + n).to(tl.int64) * HV + hv) * K * V
    p_S = offs_k[:, None] * V + offs_v[None, :]
    S = tl.load(s_base + p_S)
    final = S
    folded = tl.program_id(0) * 0  # an int32 scalar, carried by the loop
    c_beg = tl.load(first_ptr + n).to(tl.int64)
    c_end = tl.load(first_ptr + n + 1).to(tl.int64)
    for c in range(c_beg, c_end):
        t0 = tl.load(tok_ptr + c).to(tl.int64)
        r0 = tl.load(r0_ptr + c)
        r1 = tl.load(r1_ptr + c)
        new = (offs_c >= r0) & (offs_c < r1)
        tok = t0 + (offs_c - r0).to(tl.int64)
        base = c * HV + hv
        W = tl.load(w_ptr + base * C * K + offs_c[:, None] * K + offs_k[None, :])
        U = tl.load(u_ptr + base * C * V + offs_c[:, None] * V + offs_v[None, :]).to(tl.float32)
        q = tl.load(q_ptr + tok[:, None] * sq_t + h * sq_h + offs_k[None, :], mask=new[:, None], other=0.0)
        M = tl.load(m_ptr + base * C * C + offs_c[:, None] * C + offs_c[None, :])
        kgT = tl.load(kg_ptr + base * C * K + offs_c[None, :] * K + offs_k[:, None])
        G = tl.load(gs_ptr + base * C + offs_c)
        S_b = S.to(tl.bfloat16)
        delta = (U - _dot(W, S_b, UPCAST)).to(tl.bfloat16)
        o = (tl.exp(G)[:, None] * _dot(q.to(tl.bfloat16), S_b, UPCAST) + _dot(M, delta, UPCAST)) * scale
        tl.store(o_ptr + tok[:, None] * so_t + hv * so_h + offs_v[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=new[:, None])
        G_end = tl.reduce(tl.where(offs_c == r1 - 1, G, 0.0), 0, _ADD)  # one-hot: exact
        final = tl.exp(G_end) * S + _dot(kgT, delta, UPCAST)
        S = tl.where(r1 == C, final, S)  # only a complete chunk moves the boundary state
        folded = tl.maximum(folded, (r1 == C).to(tl.int32))
    if folded != 0:
        tl.store(s_base + p_S, S)
    if has_final != 0:
        tl.store(final_ptr + (n * HV + hv) * K * V + p_S, final)


def run_kernels(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, scale: float,
    plan: dict[str, torch.Tensor], S: torch.Tensor, buf: torch.Tensor, o: torch.Tensor, final: torch.Tensor | None,
    BV: int, num_warps: dict[str, int],
) -> None:
    """Both launches over ``plan`` (``gdn_chunk_grid`` builds it: per chunk ``tok, r0, r1, slot, save``, per
    sequence ``first, seq_slot``); ``final [N, HV, K, V]`` written where given."""
    H, K = q.shape[1:]
    HV, V = v.shape[1:]
    C, R = buf.shape[2:]
    n_chunks = plan["tok"].shape[0]
    N = plan["seq_slot"].shape[0]
    dev, bf16 = v.device, torch.bfloat16
    upcast = dev.type != "cuda"
    # contraction pinned, not left to Triton's default (an environment variable): every process that computes the
    # grid -- trainer and generators -- must compile the same kernels
    opts = {} if upcast else {"enable_fp_fusion": True}
    w = torch.empty(n_chunks, HV, C, K, dtype=bf16, device=dev)
    u = torch.empty(n_chunks, HV, C, V, dtype=bf16, device=dev)
    kg = torch.empty(n_chunks, HV, C, K, dtype=bf16, device=dev)
    m = torch.empty(n_chunks, HV, C, C, dtype=bf16, device=dev)
    gs = torch.empty(n_chunks, HV, C, dtype=torch.float32, device=dev)
    a = torch.empty(n_chunks, HV, C, C, dtype=torch.float32, device=dev)
    _intra_kernel[(n_chunks, HV)](
        q, k, v, g, beta, plan["tok"], plan["r0"], plan["r1"], plan["slot"], buf,
        buf.view(torch.float32), w, u, m, kg, gs, a,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        H=H, HV=HV, K=K, V=V, C=C, R=R, UPCAST=upcast, num_warps=num_warps["intra"], **opts,
    )
    _save_kernel[(n_chunks, HV)](
        k, v, g, beta, plan["tok"], plan["r0"], plan["r1"], plan["slot"], plan["save"], buf, buf.view(torch.float32),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        H=H, HV=HV, K=K, V=V, C=C, R=R, num_warps=4,
    )
    _chain_kernel[(N, HV, V // BV)](
        q, plan["tok"], plan["r0"], plan["r1"], plan["first"], plan["seq_slot"], w, u, m, kg, gs, S,
        S if final is None else final, o, scale, q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        int(final is not None), H=H, HV=HV, K=K, V=V, BV=BV, C=C, UPCAST=upcast, num_warps=num_warps["chain"],
        **opts,
    )
