"""The gated delta rule on a chunk grid anchored at each sequence's first token, defined so that a whole-prompt
prefill (parallel over chunks), a decode step (one token) and a prefill continued from a cut anywhere give the
same bits.

Why: the recurrent kernel (``kernels.gdn_triton``) steps a sequence token by token, ~0.7 us a token however many
programs share it, so a 32K-token prompt costs ~22 ms per GDN layer on an H100 (FLA's chunk kernel ~3 ms;
docs/benchmarks.md section 19, item 3). Here the serial chain is one step per 64-token chunk, and a decode step
repeats exactly the prefill's arithmetic for its row, so the trainer (packed prefill), the generator's prefill
(whole or chunked) and its decode steps agree bit for bit.

Definition, per sequence and value head (key head ``hv // (HV // H)``), chunks of ``C`` tokens from the
sequence's first token, ``S [K, V]`` the state entering the chunk, ``i`` the row in the chunk, ``G_i`` the
sequential left-to-right fp32 sum of the chunk's log decays ``g`` up to row i, ``q`` pre-scaled (``q * scale``,
where ``kernels.gdn_triton`` applies it; q/k arrive L2-normalised, g/beta formed, as ``kernels.gdn``)::

    A[i,l]  = (beta_i exp(G_i - G_l)) (k_i . k_l)                        l < i
    u_i     = beta_i v_i - sum_{l<i} A[i,l] u_l                           (forward substitution,
    w_i     = (beta_i exp(G_i)) k_i - sum_{l<i} A[i,l] w_l                 independent of S)
    delta_i = u_i - S^T w_i
    o_i     = exp(G_i) S^T q_i + sum_{j<=i} (exp(G_i - G_j) (q_i . k_j)) delta_j
    S_next  = exp(G_last) S + sum_j (exp(G_last - G_j) k_j) delta_j^T       (complete chunks; at a sequence's
                                                                            end the same fold gives its state)

Every sum runs in one fixed order (dot products over the K index 0..K-1, sums over rows l / j from 0 up), each
term ``acc = acc + a * b`` from zeros, each product associated as written: the kernels
(``kernels.gdn_chunk_grid_triton``, whose docstring says how) and ``decode_step_torch`` do exactly this (the latter
gives the kernels' bits under the interpreter given numpy's exp; torch's rounds differently). Mathematically it is
the gated delta rule (the chunk form ``kernels.gdn.chunk_gated_delta_rule_torch`` derives, with the substitution
instead of a matrix inverse); it differs from the token-by-token rule by rounding only.

Kernels. Prefill: (1) per chunk and value head, all in parallel: ``G``, ``A`` and the substitution for ``[w | u]``
(an open chunk continued takes its earlier rows from the buffer); (2) per sequence, value head and 32 value
columns, chunk after chunk (the only chain: ``T / 64`` steps): ``delta``, the outputs' ``exp(G) S^T q`` term, the
fold; (3) per chunk: the outputs. Decode: one program per (sequence, value head) computes its row ``i = pos % C``
from ``S`` and rows ``< i``, writes it, and folds at ``i = C - 1``.

State per sequence and layer (fp32): the boundary state ``S [HV, K, V]`` and the open chunk's buffer ``[HV, C,
R]``, one row per token of the open chunk, ``R = 2K + 2V + 4``: ``[k | w | u | delta | G | a | m | pad]`` -- ``a``
and ``m`` are a decode step's own scratch (its ``A[i, :]`` and output weights, written and read within the step),
the pad keeps rows 16-byte aligned. The open chunk holds ``pos % C`` rows, ``pos`` the tokens seen; rows beyond
are stale and never read. Bytes at the 9B's heads (HV 32, K = V = 128, C 64): S 2 MiB + buffer 4.03 MiB = 6.03 MiB,
against the recurrent kernel's 2 MiB (``state_bytes``).

Functions: ``prefill`` (packed prompts, continued from ``pos``), ``decode`` (one token per sequence),
``gated_delta_rule_chunk_grid`` (whole prompts from a state, functional), ``reference_float64`` (the definition in
float64 matrix form), ``decode_step_torch`` / ``prefill_torch`` (the fixed order in plain PyTorch, fp32).
Prefill scratch: ``[chunks, HV, C, R]`` fp32 rows, each chunk's ``A^T [C, C]`` and an fp32 ``[T, HV, V]`` output
term (at 32K tokens of the 9B: 2.2 + 0.27 + 0.5 GB).

Not here yet: a backward (the trainer's), a fresh-sequence flag for recycled slots (zero the ``S`` row instead),
the fused q/k normalisation and gates of ``kernels.gdn_triton``; bits on a GPU are checked by
``benchmarks/gdn_chunk_grid.py`` before it times (not yet run).
"""

from __future__ import annotations

from typing import Callable

import torch

CHUNK = 64
BV = 32  # value columns per chain / output program: 4 programs per head at V = 128
# warps per kernel: the bits do not depend on them (every sum is element-wise); chosen so that ptxas (sm_90a) reports
# no register spills at the 9B's heads, K = V = 128 (decode: 8 bytes; ``benchmarks/gdn_chunk_grid.py --compile-only``)
NUM_WARPS = {"subst": 8, "chain": 8, "output": 8, "decode": 4}


def row_layout(K: int, V: int) -> dict[str, int]:
    """Column offsets of a buffer row and its width ``R``."""
    G = 2 * K + 2 * V
    return {"K": 0, "W": K, "U": 2 * K, "D": 2 * K + V, "G": G, "A": G + 1, "M": G + 2, "R": G + 4}


def state_bytes(HV: int, K: int, V: int, chunk: int = CHUNK) -> dict[str, int]:
    """Bytes of one sequence's state per layer: ``S``, the open-chunk buffer, and their sum."""
    s, b = HV * K * V * 4, HV * chunk * row_layout(K, V)["R"] * 4
    return {"S": s, "buffer": b, "total": s + b}


def new_state(N: int, HV: int, K: int, V: int, chunk: int = CHUNK, device: torch.device | str = "cpu",
              initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S [N, HV, K, V], buffer [N, HV, C, R])`` for sequences at position 0 (``S`` zeros or a copy of
    ``initial_state``; the buffer's content is never read before it is written)."""
    S = (torch.zeros(N, HV, K, V, dtype=torch.float32, device=device) if initial_state is None
         else initial_state.to(device=device, dtype=torch.float32).clone().contiguous())
    return S, torch.zeros(N, HV, chunk, row_layout(K, V)["R"], dtype=torch.float32, device=device)


def chunk_plan(cu_seqlens: list[int], pos: list[int], chunk: int = CHUNK) -> dict[str, list[int]]:
    """Every piece of a packed prefill that falls in one chunk of its sequence's grid: packed index of its first
    token (``tok``), the rows it fills (``r0``..``r1``, ``r0 > 0`` continuing an open chunk), its sequence
    (``seq``); ``first[n]``..``first[n+1]`` are sequence n's pieces, in order."""
    plan: dict[str, list[int]] = {"tok": [], "r0": [], "r1": [], "seq": [], "first": [0]}
    for n, (s, e) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        t, r = s, pos[n] % chunk
        while t < e:
            m = min(chunk - r, e - t)
            for key, val in (("tok", t), ("r0", r), ("r1", r + m), ("seq", n)):
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
    if S.dtype != torch.float32 or buf.dtype != torch.float32 or not (S.is_contiguous() and buf.is_contiguous()):
        raise ValueError("state tensors must be contiguous fp32")


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def prefill(q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor,
            beta_TH: torch.Tensor, cu_seqlens: list[int], scale: float, S: torch.Tensor, buf: torch.Tensor,
            pos: list[int] | None = None, slots: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed prompts continued from each sequence's state (``S``/``buf`` rows ``slots[n]``, default n; ``pos[n]``
    tokens seen, default 0): returns ``(o [T, HV, V] in v's dtype, final [N, HV, K, V])``, the state after each
    sequence's last token; ``S`` and ``buf`` are advanced in place (the caller advances ``pos`` by the lengths).
    A sequence at ``pos`` 0 reads no buffer row but starts from its ``S`` row: zero it for a fresh sequence."""
    from titan_rl_ext.kernels.gdn_chunk_grid_triton import prefill_kernels

    _check(q_THK, k_THK, v_THV, g_TH, beta_TH, S, buf)
    N = len(cu_seqlens) - 1
    HV, V = v_THV.shape[1:]
    C, R = buf.shape[2:]
    pos = [0] * N if pos is None else list(pos)
    slots = list(range(N)) if slots is None else list(slots)
    if len(pos) != N or len(slots) != N or len(set(slots)) != N or any(not 0 <= x < S.shape[0] for x in slots):
        raise ValueError(f"{N} sequences need {N} positions and distinct state rows in [0, {S.shape[0]}); got "
                         f"{pos}, {slots}")
    dev = v_THV.device
    plan = chunk_plan(cu_seqlens, pos, C)
    plan["slot"] = slots
    o = torch.empty(v_THV.shape, dtype=v_THV.dtype, device=dev)
    if not plan["tok"]:
        return o, S[slots].clone()
    plan_t = {key: torch.tensor(val, dtype=torch.int32, device=dev) for key, val in plan.items()}
    scratch = torch.empty(len(plan["tok"]), HV, C, R, dtype=torch.float32, device=dev)
    cont = [c for c, r0 in enumerate(plan["r0"]) if r0 > 0]  # open chunks continued: their earlier rows
    if cont:
        scratch[cont] = buf[[slots[plan["seq"][c]] for c in cont]]
    final = torch.empty(N, *S.shape[1:], dtype=torch.float32, device=dev)
    qkv = [_unit_last(x) for x in (q_THK, k_THK, v_THV, g_TH, beta_TH)]
    prefill_kernels(*qkv, scale, plan_t, scratch, S, final, o, row_layout(q_THK.shape[2], V), min(BV, V), NUM_WARPS)
    lasts = [plan["first"][n + 1] - 1 for n in range(N) if plan["first"][n + 1] > plan["first"][n]]
    open_ = [c for c in lasts if plan["r1"][c] < C]  # sequences ending mid-chunk keep its rows
    if open_:
        buf[[slots[plan["seq"][c]] for c in open_]] = scratch[open_]
    return o, final


def decode(q_BHK: torch.Tensor, k_BHK: torch.Tensor, v_BHV: torch.Tensor, g_BH: torch.Tensor, beta_BH: torch.Tensor,
           scale: float, S: torch.Tensor, buf: torch.Tensor, pos: torch.Tensor,
           slots: torch.Tensor | None = None) -> torch.Tensor:
    """One token for each of B sequences (state rows ``slots [B]``, default b; ``pos [B]``, the tokens seen before
    this one; both on the device): returns ``o [B, HV, V]``; ``S``/``buf`` advanced in place (the caller advances
    ``pos`` by one). Slots must be distinct (each program writes its sequence's rows)."""
    from titan_rl_ext.kernels.gdn_chunk_grid_triton import decode_kernel

    _check(q_BHK, k_BHK, v_BHV, g_BH, beta_BH, S, buf)
    B = q_BHK.shape[0]
    if slots is None:
        if S.shape[0] != B:
            raise ValueError(f"{B} tokens without slots need {B} state rows; got {S.shape[0]}")
        slots = torch.arange(B, dtype=torch.int32, device=v_BHV.device)
    if pos.shape != (B,) or slots.shape != (B,):
        raise ValueError(f"{B} tokens need positions and slots [B]; got {tuple(pos.shape)}, {tuple(slots.shape)}")
    o = torch.empty(v_BHV.shape, dtype=v_BHV.dtype, device=v_BHV.device)
    if B:
        qkv = [_unit_last(x) for x in (q_BHK, k_BHK, v_BHV, g_BH, beta_BH)]
        decode_kernel(*qkv, scale, pos, slots, S, buf, o, row_layout(q_BHK.shape[2], v_BHV.shape[2]), NUM_WARPS)
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
    """The definition in float64 matrix form (triangular solves for the substitution): ``(o, final)`` of whole
    prompts, float64."""
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


def decode_step_torch(q_BHK: torch.Tensor, k_BHK: torch.Tensor, v_BHV: torch.Tensor, g_BH: torch.Tensor,
                      beta_BH: torch.Tensor, scale: float, S: torch.Tensor, buf: torch.Tensor, pos: list[int],
                      exp: Callable[[torch.Tensor], torch.Tensor] = torch.exp) -> torch.Tensor:
    """The decode kernel's arithmetic in plain PyTorch fp32, the same order term by term (all value heads at once,
    sequences one by one): ``o [B, HV, V]`` fp32, ``S``/``buf`` advanced in place. The kernels' bits where ``exp``
    rounds as theirs does: torch's and the interpreter's (numpy's) fp32 exp differ in the last bit on ~40 % of
    inputs, so the interpreter tests pass numpy's."""
    B, H, K = q_BHK.shape
    HV, V = v_BHV.shape[1:]
    C = buf.shape[2]
    L = row_layout(K, V)
    oK, oW, oU, oD, oG = L["K"], L["W"], L["U"], L["D"], L["G"]
    o = torch.empty(B, HV, V, dtype=torch.float32)
    ar = torch.arange(C)
    for b in range(B):
        rows, i = buf[b], pos[b] % C  # rows [HV, C, R]
        k = k_BHK[b].float().repeat_interleave(HV // H, dim=0)  # [HV, K]
        q = q_BHK[b].float().repeat_interleave(HV // H, dim=0) * scale
        v, g, beta = v_BHV[b].float(), g_BH[b].float(), beta_BH[b].float()  # [HV, V], [HV], [HV]
        G_i = (rows[:, i - 1, oG] if i > 0 else torch.zeros(HV)) + g
        rows[:, i, oK:oK + K] = k
        rows[:, i, oG] = G_i
        seen = (ar <= i)[None, :]
        kk_C = torch.zeros(HV, C)
        qk_C = torch.zeros(HV, C)
        for kk in range(K):
            col = torch.where(seen, rows[:, :, oK + kk], 0.0)
            kk_C = kk_C + k[:, kk, None] * col
            qk_C = qk_C + q[:, kk, None] * col
        G_C = torch.where(seen, rows[:, :, oG], 0.0)
        a_C = torch.where((ar < i)[None, :], (beta[:, None] * exp(G_i[:, None] - G_C)) * kk_C, 0.0)
        m_C = torch.where(seen, exp(G_i[:, None] - G_C) * qk_C, 0.0)
        acc_u, acc_w = torch.zeros(HV, V), torch.zeros(HV, K)
        for l in range(i):
            acc_u = acc_u + a_C[:, l, None] * rows[:, l, oU:oU + V]
            acc_w = acc_w + a_C[:, l, None] * rows[:, l, oW:oW + K]
        u_i = beta[:, None] * v - acc_u
        w_i = (beta * exp(G_i))[:, None] * k - acc_w
        rows[:, i, oU:oU + V] = u_i
        rows[:, i, oW:oW + K] = w_i
        x_V, qs_V = torch.zeros(HV, V), torch.zeros(HV, V)
        for kk in range(K):
            x_V = x_V + w_i[:, kk, None] * S[b, :, kk]
            qs_V = qs_V + q[:, kk, None] * S[b, :, kk]
        rows[:, i, oD:oD + V] = u_i - x_V
        inner = torch.zeros(HV, V)
        for j in range(i + 1):
            inner = inner + m_C[:, j, None] * rows[:, j, oD:oD + V]
        o[b] = exp(G_i)[:, None] * qs_V + inner
        if i == C - 1:
            acc = exp(G_i)[:, None, None] * S[b]
            for j in range(C):
                kd = exp(G_i - rows[:, j, oG])[:, None] * rows[:, j, oK:oK + K]
                acc = acc + kd[:, :, None] * rows[:, j, None, oD:oD + V]
            S[b] = acc
    return o


def prefill_torch(q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor,
                  beta_TH: torch.Tensor, cu_seqlens: list[int], scale: float, S: torch.Tensor, buf: torch.Tensor,
                  pos: list[int] | None = None,
                  exp: Callable[[torch.Tensor], torch.Tensor] = torch.exp) -> torch.Tensor:
    """``prefill`` as decode steps of ``decode_step_torch`` (fp32 ``o``; ``S``/``buf`` advanced in place)."""
    o = torch.empty(v_THV.shape, dtype=torch.float32)
    for n in range(len(cu_seqlens) - 1):
        p = 0 if pos is None else pos[n]
        for t in range(cu_seqlens[n], cu_seqlens[n + 1]):
            sl = slice(t, t + 1)
            o[sl] = decode_step_torch(q_THK[sl], k_THK[sl], v_THV[sl], g_TH[sl], beta_TH[sl], scale, S[n:n + 1],
                                      buf[n:n + 1], [p + t - cu_seqlens[n]], exp)
    return o
