"""The gated delta rule on a chunk grid anchored at each sequence's first token, defined so that a whole-prompt
prefill, a prefill continued from a cut anywhere and a decode step give the same bits, on tensor-core tiles.

Why: the recurrent kernel (``kernels.gdn_triton``) steps a sequence token by token, so a 32K-token prompt costs
~30 ms per GDN layer on an H100 (FLA's chunk kernel ~3 ms). Here every sum is a matrix product on a fixed
``C``-row tile (C = 64), the serial chain is one step per chunk, and a decode step is the same tile with its later
rows zero, so the trainer (packed prefill), the generator's prefill (whole or chunked) and its decode steps agree
bit for bit.

Definition, per sequence and value head (key head ``hv // (HV // H)``), chunks of ``C`` rows from the sequence's
first token, ``S [K, V]`` the state entering the chunk, rows after the chunk's last (in a prompt's last chunk, or
an open chunk at a decode step) zero: ``k = v = q = 0``, ``g = beta = 0``. ``q, k, v`` are rounded to bf16 (the
tensor cores' operands), ``g, beta`` fp32, ``q`` unscaled (``scale`` multiplies the output); q/k arrive
L2-normalised, g/beta formed, as ``kernels.gdn`` makes them::

    G      = cumsum(g)                                          (over the chunk's rows)
    A      = strictly_lower(beta_i exp(G_i - G_l) (k_i . k_l))   one [C, C] product k k^T
    T      = (I + A)^-1                                         16-row diagonal blocks by forward substitution,
                                                                the blocks below by block substitution (tf32)
    W      = T (k * beta exp(G)),   U = T (v * beta)            bf16 operands, then stored bf16
    delta  = U - W S                                            (S as bf16 operand)
    o      = scale (exp(G) * (q S) + M delta),  M = lower_incl(exp(G_i - G_j) (q_i . k_j))   (M bf16)
    S_next = exp(G_last) S + (k * exp(G_last - G))^T delta        complete chunks only; at a sequence's end the
                                                                same fold to its last row gives its final state

Every product is a ``tl.dot`` with fp32 accumulation at one tile shape; the mathematics is the gated delta rule's
chunk form (``kernels.gdn.chunk_gated_delta_rule_torch``), as in FLA's ``chunk_gated_delta_rule``, so it differs
from the token-by-token rule by bf16-operand rounding (~1e-2 on outputs of order 1). Why a row's bits depend only
on the rows up to it, which is what makes a zero-padded chunk a prefix of the full one:
``kernels.gdn_chunk_grid_triton``.

State per sequence and layer: the boundary state ``S [HV, K, V]`` fp32 (the state at the sequence's last chunk
boundary) and the open chunk's raw rows ``buffer [HV, C, R]`` bf16, ``R = K + V + 4``: ``[k | v | g | beta]``,
``g`` and ``beta`` fp32 stored as two bf16 columns each (the buffer's fp32 view). The open chunk holds ``pos % C``
rows, ``pos`` the tokens seen; rows beyond are stale and never read. A step rebuilds the open chunk's ``W, U, M``
from these rows (the same bits as when they came). Bytes at the 9B's heads (HV 32, K = V = 128, C 64): S 2 MiB +
buffer 1.03 MiB = 3.03 MiB, against the recurrent kernel's 2 MiB (``state_bytes``).

Functions: ``prefill`` (packed prompts, continued from ``pos``), ``decode`` (one token per sequence, the plan on
the device: CUDA-graph capturable), ``gated_delta_rule_chunk_grid`` (whole prompts from a state, functional),
``reference_float64`` (the gated delta rule's chunk form in float64: no bf16 rounding), ``prefill_torch`` (the same
tiles in plain PyTorch: what runs off CUDA; its own bits, self-consistent across cuts and steps as the kernels
are). Scratch of a call, per chunk and value head: ``W, U, k * exp(G_last - G)`` ``[C, K|V]`` and ``M [C, C]`` bf16,
``A``/``T [C, C]`` and ``G [C]`` fp32 (at 32K tokens of the 9B: 1.2 GB; a decode step of B sequences: B x 2.4 MiB).

Not here: a backward (the trainer's is the chunked form's), the fused q/k normalisation and gates of
``kernels.gdn_triton``.
"""

from __future__ import annotations

import torch

CHUNK = 64
BV = 32  # value columns per chain program: 4 programs per head at V = 128
# warps per kernel, fixed: every call (prefill, continued prefill, decode) compiles the same two kernels. At the 9B's
# heads ptxas (sm_90a) reports 255 registers and ~0.7 KB of spill stores for intra at 8 warps (more at 4), none for
# chain (``benchmarks/gdn_chunk_grid.py --compile-only``)
NUM_WARPS = {"intra": 8, "chain": 4}


def row_layout(K: int, V: int) -> dict[str, int]:
    """bf16 column offsets of a buffer row and its width ``R`` (``G``/``B``: fp32 g / beta, two columns each)."""
    return {"K": 0, "V": K, "G": K + V, "B": K + V + 2, "R": K + V + 4}


def state_bytes(HV: int, K: int, V: int, chunk: int = CHUNK) -> dict[str, int]:
    """Bytes of one sequence's state per layer: ``S``, the open-chunk buffer, and their sum."""
    s, b = HV * K * V * 4, HV * chunk * row_layout(K, V)["R"] * 2
    return {"S": s, "buffer": b, "total": s + b}


def new_state(N: int, HV: int, K: int, V: int, chunk: int = CHUNK, device: torch.device | str = "cpu",
              initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S [N, HV, K, V] fp32, buffer [N, HV, C, R] bf16)`` for sequences at position 0 (``S`` zeros or a copy of
    ``initial_state``; the buffer's rows are never read before they are written)."""
    S = (torch.zeros(N, HV, K, V, dtype=torch.float32, device=device) if initial_state is None
         else initial_state.to(device=device, dtype=torch.float32).clone().contiguous())
    return S, torch.zeros(N, HV, chunk, row_layout(K, V)["R"], dtype=torch.bfloat16, device=device)


def chunk_plan(cu_seqlens: list[int], pos: list[int], chunk: int = CHUNK) -> dict[str, list[int]]:
    """Every piece of a packed prefill that falls in one chunk of its sequence's grid: packed index of its first
    token (``tok``), the rows it fills (``r0``..``r1``, ``r0 > 0`` continuing an open chunk), its sequence
    (``seq``), whether its rows go to the buffer (``save``: the sequence's last piece, ending mid-chunk);
    ``first[n]``..``first[n+1]`` are sequence n's pieces, in order."""
    plan: dict[str, list[int]] = {"tok": [], "r0": [], "r1": [], "seq": [], "save": [], "first": [0]}
    for n, (s, e) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        t, r = s, pos[n] % chunk
        while t < e:
            m = min(chunk - r, e - t)
            last = t + m == e
            for key, val in (("tok", t), ("r0", r), ("r1", r + m), ("seq", n), ("save", int(last and r + m < chunk))):
                plan[key].append(val)
            t, r = t + m, 0
        plan["first"].append(len(plan["tok"]))
    return plan


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           S: torch.Tensor, buf: torch.Tensor) -> None:
    T, H, K = q.shape
    HV, V = v.shape[1:]
    if k.shape != q.shape or v.shape[0] != T or g.shape != (T, HV) or beta.shape != (T, HV) or HV % H:
        raise ValueError(f"shapes: q/k [T, H, K], v [T, HV, V], g/beta [T, HV], HV % H == 0; got q {tuple(q.shape)}"
                         f" k {tuple(k.shape)} v {tuple(v.shape)} g {tuple(g.shape)} beta {tuple(beta.shape)}")
    C = buf.shape[2]
    for name, x in (("K", K), ("V", V), ("chunk", C)):
        if x < 16 or x & (x - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (a tile side); got {x}")
    R = row_layout(K, V)["R"]
    if S.shape[1:] != (HV, K, V) or buf.shape[1:] != (HV, C, R) or S.shape[0] != buf.shape[0]:
        raise ValueError(f"state must be S [N, {HV}, {K}, {V}] and buffer [N, {HV}, C, {R}]; got {tuple(S.shape)},"
                         f" {tuple(buf.shape)}")
    if S.dtype != torch.float32 or buf.dtype != torch.bfloat16 or not (S.is_contiguous() and buf.is_contiguous()):
        raise ValueError("state tensors must be contiguous: S fp32, buffer bf16")


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def prefill(q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor,
            beta_TH: torch.Tensor, cu_seqlens: list[int], scale: float, S: torch.Tensor, buf: torch.Tensor,
            pos: list[int] | None = None, slots: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed prompts continued from each sequence's state (``S``/``buf`` rows ``slots[n]``, default n; ``pos[n]``
    tokens seen, default 0): returns ``(o [T, HV, V] in v's dtype, final [N, HV, K, V])``, the state after each
    sequence's last token; ``S`` and ``buf`` are advanced in place (the caller advances ``pos`` by the lengths).
    A sequence at ``pos`` 0 reads no buffer row but starts from its ``S`` row: zero it for a fresh sequence."""
    from titan_rl_ext.kernels.gdn_chunk_grid_triton import run_kernels

    _check(q_THK, k_THK, v_THV, g_TH, beta_TH, S, buf)
    N = len(cu_seqlens) - 1
    pos = [0] * N if pos is None else list(pos)
    slots = list(range(N)) if slots is None else list(slots)
    if len(pos) != N or len(slots) != N or len(set(slots)) != N or any(not 0 <= x < S.shape[0] for x in slots):
        raise ValueError(f"{N} sequences need {N} positions and distinct state rows in [0, {S.shape[0]}); got "
                         f"{pos}, {slots}")
    dev = v_THV.device
    plan = chunk_plan(cu_seqlens, pos, buf.shape[2])
    plan["slot"] = [slots[n] for n in plan["seq"]]
    plan["seq_slot"] = slots
    o = torch.empty(v_THV.shape, dtype=v_THV.dtype, device=dev)
    final = torch.empty(N, *S.shape[1:], dtype=torch.float32, device=dev)
    if N == 0:
        return o, final
    plan_t = {key: torch.tensor(val, dtype=torch.int32, device=dev) for key, val in plan.items()}
    qkv = [_unit_last(x) for x in (q_THK, k_THK, v_THV, g_TH, beta_TH)]
    run_kernels(*qkv, scale, plan_t, S, buf, o, final, min(BV, v_THV.shape[2]), NUM_WARPS)
    return o, final


def decode(q_BHK: torch.Tensor, k_BHK: torch.Tensor, v_BHV: torch.Tensor, g_BH: torch.Tensor, beta_BH: torch.Tensor,
           scale: float, S: torch.Tensor, buf: torch.Tensor, pos: torch.Tensor,
           slots: torch.Tensor | None = None) -> torch.Tensor:
    """One token for each of B sequences (state rows ``slots [B]``, default b; ``pos [B]``, the tokens seen before
    this one; both on the device): returns ``o [B, HV, V]``; ``S``/``buf`` advanced in place (the caller advances
    ``pos`` by one). The same kernels as ``prefill``, on one chunk a sequence whose row ``pos % C`` is this token;
    the plan is made on the device (no host sync). Slots must be distinct."""
    from titan_rl_ext.kernels.gdn_chunk_grid_triton import run_kernels

    _check(q_BHK, k_BHK, v_BHV, g_BH, beta_BH, S, buf)
    B = q_BHK.shape[0]
    dev = v_BHV.device
    if slots is None:
        if S.shape[0] != B:
            raise ValueError(f"{B} tokens without slots need {B} state rows; got {S.shape[0]}")
        slots = torch.arange(B, dtype=torch.int32, device=dev)
    if pos.shape != (B,) or slots.shape != (B,):
        raise ValueError(f"{B} tokens need positions and slots [B]; got {tuple(pos.shape)}, {tuple(slots.shape)}")
    o = torch.empty(v_BHV.shape, dtype=v_BHV.dtype, device=dev)
    if B:
        C = buf.shape[2]
        r0 = (pos % C).to(torch.int32)
        slots = slots.to(torch.int32)
        plan = {"tok": torch.arange(B, dtype=torch.int32, device=dev), "r0": r0, "r1": r0 + 1, "slot": slots,
                "save": (r0 + 1 < C).to(torch.int32), "first": torch.arange(B + 1, dtype=torch.int32, device=dev),
                "seq_slot": slots}
        qkv = [_unit_last(x) for x in (q_BHK, k_BHK, v_BHV, g_BH, beta_BH)]
        run_kernels(*qkv, scale, plan, S, buf, o, None, min(BV, v_BHV.shape[2]), NUM_WARPS)
    return o


def gated_delta_rule_chunk_grid(q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor,
                                beta_TH: torch.Tensor, cu_seqlens: list[int], scale: float,
                                initial_state: torch.Tensor | None = None,
                                chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole prompts from ``initial_state`` (zeros by default): ``(o [T, HV, V], final [N, HV, K, V])``."""
    HV, V = v_THV.shape[1:]
    S, buf = new_state(len(cu_seqlens) - 1, HV, k_THK.shape[2], V, chunk, v_THV.device, initial_state)
    return prefill(q_THK, k_THK, v_THV, g_TH, beta_TH, cu_seqlens, scale, S, buf)


# ------------------------------------------------------------------------------------------------
# plain PyTorch


def reference_float64(q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor,
                      beta_TH: torch.Tensor, cu_seqlens: list[int], scale: float,
                      initial_state: torch.Tensor | None = None,
                      chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition's mathematics in float64 matrix form, without its bf16 roundings (triangular solves for
    ``T``): ``(o, final)`` of whole prompts, float64."""
    f64 = torch.float64
    T, H, K = q_THK.shape
    HV, V = v_THV.shape[1:]
    N = len(cu_seqlens) - 1
    q = q_THK.to(f64).repeat_interleave(HV // H, dim=1) * scale
    k = k_THK.to(f64).repeat_interleave(HV // H, dim=1)
    v, g, beta = v_THV.to(f64), g_TH.to(f64), beta_TH.to(f64)
    S_all = (torch.zeros(N, HV, K, V, dtype=f64) if initial_state is None else initial_state.to(f64)).clone()
    o = torch.zeros(T, HV, V, dtype=f64)
    for n in range(N):
        for lo in range(cu_seqlens[n], cu_seqlens[n + 1], chunk):
            hi = min(lo + chunk, cu_seqlens[n + 1])
            for h in range(HV):
                S = S_all[n, h]
                kc, qc, G, bc = k[lo:hi, h], q[lo:hi, h], torch.cumsum(g[lo:hi, h], 0), beta[lo:hi, h]
                decay = torch.exp(G[:, None] - G[None, :])
                eye = torch.eye(hi - lo, dtype=f64)
                A = torch.tril(bc[:, None] * decay * (kc @ kc.T), diagonal=-1)
                U = torch.linalg.solve_triangular(eye + A, bc[:, None] * v[lo:hi, h], upper=False)
                W = torch.linalg.solve_triangular(eye + A, (bc * torch.exp(G))[:, None] * kc, upper=False)
                D = U - W @ S
                o[lo:hi, h] = torch.exp(G)[:, None] * (qc @ S) + torch.tril(decay * (qc @ kc.T)) @ D
                S_all[n, h] = torch.exp(G[-1]) * S + (torch.exp(G[-1] - G)[:, None] * kc).T @ D
    return o, S_all


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` as float64 rounded once to fp32: exact for bf16 products, and the same bits for a row wherever it
    sits in the tile (an fp32 BLAS may round rows differently by position or thread count)."""
    return (a.double() @ b.double()).float()


def _f32_cols(rows: torch.Tensor, col: int) -> torch.Tensor:
    """The fp32 value stored in bf16 columns ``col, col + 1`` of buffer rows ``[..., R]``: ``[...]``."""
    return rows[..., col:col + 2].contiguous().view(torch.float32)[..., 0]


def _tile_torch(q_mHK: torch.Tensor, k_mHK: torch.Tensor, v_mHV: torch.Tensor, g_mH: torch.Tensor,
                beta_mH: torch.Tensor, scale: float, S_HKV: torch.Tensor, rows_HCR: torch.Tensor, r0: int,
                save: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One piece (rows ``r0 .. r0 + m`` of a chunk) on the whole zero-padded ``C``-row tile, all value heads:
    ``(o [m, HV, V] fp32, state after the piece's last row [HV, K, V])``; ``S_HKV`` folded in place when the piece
    completes the chunk, the rows saved to ``rows_HCR`` where ``save``."""
    m, H, K = q_mHK.shape
    HV, C, R = rows_HCR.shape
    V = v_mHV.shape[2]
    L = row_layout(K, V)
    r1, rep, bf16 = r0 + m, HV // H, torch.bfloat16
    k_new = k_mHK.repeat_interleave(rep, dim=1).transpose(0, 1).to(bf16)  # [HV, m, K]
    v_new = v_mHV.transpose(0, 1).to(bf16)
    g_new, b_new = g_mH.T.float(), beta_mH.T.float()  # [HV, m]
    k = torch.zeros(HV, C, K, dtype=bf16)
    v = torch.zeros(HV, C, V, dtype=bf16)
    g = torch.zeros(HV, C)
    beta = torch.zeros(HV, C)
    q = torch.zeros(HV, C, K, dtype=bf16)
    k[:, :r0], v[:, :r0] = rows_HCR[:, :r0, :K], rows_HCR[:, :r0, L["V"]:L["V"] + V]
    g[:, :r0], beta[:, :r0] = _f32_cols(rows_HCR[:, :r0], L["G"]), _f32_cols(rows_HCR[:, :r0], L["B"])
    k[:, r0:r1], v[:, r0:r1], g[:, r0:r1], beta[:, r0:r1] = k_new, v_new, g_new, b_new
    q[:, r0:r1] = q_mHK.repeat_interleave(rep, dim=1).transpose(0, 1).to(bf16)
    if save:
        rows_HCR[:, r0:r1, :K], rows_HCR[:, r0:r1, L["V"]:L["V"] + V] = k_new, v_new
        rows_HCR[:, r0:r1, L["G"]:L["G"] + 2] = g_new[..., None].contiguous().view(bf16)
        rows_HCR[:, r0:r1, L["B"]:L["B"] + 2] = b_new[..., None].contiguous().view(bf16)
    G = torch.cumsum(g, 1)
    idx = torch.arange(C)
    strict, incl = idx[:, None] > idx[None, :], idx[:, None] >= idx[None, :]
    decay = torch.exp(G[:, :, None] - G[:, None, :])
    A = torch.where(strict, (beta[:, :, None] * decay) * _mm(k, k.transpose(1, 2)), 0.0)
    eye = torch.eye(C, dtype=torch.float64)
    T = torch.linalg.solve_triangular(eye + A.double(), eye.expand(HV, C, C), upper=False).float()
    T = torch.where(incl, T, 0.0).to(bf16)
    W = _mm(T, (k.float() * (beta * torch.exp(G))[..., None]).to(bf16)).to(bf16)
    U = _mm(T, (v.float() * beta[..., None]).to(bf16)).to(bf16)
    M = torch.where(incl, decay * _mm(q, k.transpose(1, 2)), 0.0).to(bf16)
    G_end = G[:, r1 - 1]
    kg = (k.float() * torch.exp(G_end[:, None] - G)[..., None]).to(bf16)
    S_b = S_HKV.to(bf16)
    delta = (U.float() - _mm(W, S_b)).to(bf16)
    o = (torch.exp(G)[..., None] * _mm(q, S_b) + _mm(M, delta)) * scale
    final = torch.exp(G_end)[:, None, None] * S_HKV + _mm(kg.transpose(1, 2), delta)
    if r1 == C:
        S_HKV.copy_(final)
    return o[:, r0:r1].transpose(0, 1), final


def prefill_torch(q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor,
                  beta_TH: torch.Tensor, cu_seqlens: list[int], scale: float, S: torch.Tensor, buf: torch.Tensor,
                  pos: list[int] | None = None, slots: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``prefill`` in plain PyTorch, piece by piece on whole tiles: ``(o [T, HV, V] fp32, final [N, HV, K, V])``;
    ``S``/``buf`` advanced in place (row views: the state may live in a strided engine cache). A decode step is a
    call with one token a sequence. Its own bits (not the kernels': other sum orders), the same for a sequence
    however its tokens are cut into calls."""
    N = len(cu_seqlens) - 1
    pos = [0] * N if pos is None else list(pos)
    slots = list(range(N)) if slots is None else list(slots)
    plan = chunk_plan(cu_seqlens, pos, buf.shape[2])
    o = torch.empty(v_THV.shape, dtype=torch.float32, device=v_THV.device)
    final = torch.empty(N, *S.shape[1:], dtype=torch.float32, device=S.device)
    for n, slot in enumerate(slots):
        fin = S[slot].clone()
        for c in range(plan["first"][n], plan["first"][n + 1]):
            t, r0, r1 = plan["tok"][c], plan["r0"][c], plan["r1"][c]
            sl = slice(t, t + r1 - r0)
            o[sl], fin = _tile_torch(q_THK[sl], k_THK[sl], v_THV[sl], g_TH[sl], beta_TH[sl], scale, S[slot],
                                     buf[slot], r0, bool(plan["save"][c]))
        final[n] = fin
    return o, final
