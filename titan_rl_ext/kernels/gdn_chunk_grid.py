"""The gated delta rule on a chunk grid anchored at each sequence's first token: boundary states by the chunk
formula on tensor-core tiles, rows by the recurrent kernel from their chunk's boundary state -- so a whole-prompt
prefill, a prefill continued from a cut anywhere and a decode step give the same bits, a prefill runs its chunks'
rows in parallel, and a decode step costs the recurrent kernel's step (plus a fold once every 64 tokens).

Why: the recurrent kernel (``kernels.gdn_triton``) steps a sequence token by token, so a 32K-token prompt is a
32K-long serial chain (~30 ms per GDN layer on an H100; FLA's chunk kernel ~3 ms). Here the serial chain is one
fold a chunk (matrix products on a fixed 64-row tile), and the rows of every chunk are independent recurrent
segments of at most 64 tokens, each started from its chunk's boundary state.

Definition, per sequence and value head (key head ``hv // (HV // H)``), chunks of ``C`` rows (C = 64) from the
sequence's first token. Boundary states ``S_b(0)`` = the initial state and, over chunk c's 64 raw rows (k rounded to
bf16, the tensor cores' operand; v bf16; g, beta fp32; q/k arrive L2-normalised, g/beta formed, as ``kernels.gdn``
makes them)::

    G      = cumsum(g)
    A      = strictly_lower(beta_i exp(G_i - G_l) (k_i . k_l))   one [C, C] product k k^T
    T      = (I + A)^-1                                         16-row diagonal blocks by forward substitution,
                                                                the blocks below by block substitution (tf32)
    W      = T (k * beta exp(G)),   U = T (v * beta)            bf16 operands, then stored bf16
    delta  = U - W S_b(c)                                       (S_b as bf16 operand), stored bf16
    S_b(c+1) = exp(G_last) S_b(c) + (k * exp(G_last - G))^T delta

Row t of chunk c: the output of the recurrent kernel (``gdn_triton``'s arithmetic and layout, unchanged) stepping
from ``S_b(c)`` over rows 0..t of the chunk. The running state after a chunk's last row is discarded: the next
chunk starts from ``S_b(c+1)``. The state after a sequence's last token (``final``) is the running state where the
sequence ends mid-chunk, ``S_b`` where it ends on a boundary.

Why the bits hold across calls: a row is the recurrent kernel's, whose per-token work depends on nothing but its
constexprs (its prefill rows equal its decode steps bit for bit), started from the same ``S_b(c)`` (an exact copy);
a fold always reads the chunk's 64 stored raw rows and ``S_b(c)`` and runs the same compiled kernels
(``kernels.gdn_chunk_grid_triton``) at the same tile shape, whichever call completes the chunk. The folds are the
gated delta rule's chunk form (as FLA's ``chunk_gated_delta_rule``), so a row differs from the token-by-token rule
from position 0 by the bf16-operand rounding of its boundary state (~1e-2 on outputs of order 1).

State per sequence and layer: ``S_run [HV, K, V]`` fp32 (the running state: the recurrent form's ssm state), the
boundary state ``S_b [HV, K, V]`` fp32 of the open chunk, and its raw rows ``buffer [HV, C, R]`` bf16,
``R = K + V + 4``: ``[k | v | g | beta]``, ``g`` and ``beta`` fp32 stored as two bf16 columns each (the buffer's
fp32 view). The open chunk holds ``pos % C`` rows, ``pos`` the tokens seen; rows beyond are stale and never read.
Bytes at the 9B's heads (HV 32, K = V = 128): 2 + 2 + 1.03 = 5.03 MiB against the recurrent form's 2 MiB
(``state_bytes``).

A prefill (host-side plan, ``chunk_plan``): the folds of every chunk the call completes, in chain order per
sequence, write each piece's starting state into a scratch ``[n_pieces, HV, K, V]`` fp32 (a sequence's first piece
starts from its ``S_run``); then one recurrent launch runs every piece as a segment of its own from its scratch
row; a sequence ending mid-chunk keeps its last segment's final state as ``S_run``. A decode step (the plan on the
device: CUDA-graph capturable): the recurrent kernel's step on ``S_run`` (the recurrent form's decode), the row
into the buffer, and the fold launches, whose programs exit at once for a sequence whose chunk does not complete
at this token; where it does, ``S_b`` folds and ``S_run := S_b``.

Functions: ``prefill`` (packed prompts, continued from ``pos``), ``decode`` (one token per sequence), their plans
``make_prefill_plan`` / ``make_decode_plan`` (an engine makes each once a step and shares it among its GDN layers,
whose layout is the same), ``gated_delta_rule_chunk_grid`` (whole prompts from a state, functional), ``reference_float64`` (the definition in
float64 without bf16 roundings), ``prefill_torch`` (the same definition in plain PyTorch: what runs off CUDA; its
own bits, self-consistent across cuts and steps as the kernels are). Scratch of a call, per completing chunk and
value head: ``W, U, k * exp(G_last - G)`` ``[C, K|V]`` bf16 (48 KiB at the 9B's heads; ``A`` and ``T`` stay in
registers), plus the boundary states (64 KiB a piece and value head; at 32K tokens of the 9B: 1 + 1 GiB).

Not here: a backward (the trainer's is the chunked form's), the fused q/k normalisation and gates of
``kernels.gdn_triton``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

CHUNK = 64
BV = 32  # value columns per chain program: 4 programs per head at V = 128
# warps per kernel, fixed: every call (prefill, continued prefill, decode) compiles the same kernels
# (``benchmarks/gdn_chunk_grid.py --compile-only`` reports their registers and spills)
NUM_WARPS = {"intra": 8, "chain": 4}

GridState = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (S_run, S_b, buffer), each [N, ...] by slot


def row_layout(K: int, V: int) -> dict[str, int]:
    """bf16 column offsets of a buffer row and its width ``R`` (``G``/``B``: fp32 g / beta, two columns each)."""
    return {"K": 0, "V": K, "G": K + V, "B": K + V + 2, "R": K + V + 4}


def state_bytes(HV: int, K: int, V: int, chunk: int = CHUNK) -> dict[str, int]:
    """Bytes of one sequence's state per layer: ``S_run``, ``S_b``, the open-chunk buffer, and their sum."""
    s, b = HV * K * V * 4, HV * chunk * row_layout(K, V)["R"] * 2
    return {"S_run": s, "S_b": s, "buffer": b, "total": 2 * s + b}


def new_state(N: int, HV: int, K: int, V: int, chunk: int = CHUNK, device: torch.device | str = "cpu",
              initial_state: torch.Tensor | None = None) -> GridState:
    """``(S_run, S_b [N, HV, K, V] fp32, buffer [N, HV, C, R] bf16)`` for sequences at position 0 (both states
    zeros or copies of ``initial_state``; the buffer's rows are never read before they are written)."""
    S = (torch.zeros(N, HV, K, V, dtype=torch.float32, device=device) if initial_state is None
         else initial_state.to(device=device, dtype=torch.float32).clone().contiguous())
    return S, S.clone(), torch.zeros(N, HV, chunk, row_layout(K, V)["R"], dtype=torch.bfloat16, device=device)


def chunk_plan(cu_seqlens: list[int], pos: list[int], chunk: int = CHUNK) -> dict[str, list[int]]:
    """Every piece of a packed prefill that falls in one chunk of its sequence's grid: packed index of its first
    token (``tok``), the rows it fills (``r0``..``r1``, ``r0 > 0`` continuing an open chunk, ``r1 == C`` completing
    it: a fold), its sequence (``seq``), whether its rows go to the buffer (``save``: the sequence's last piece,
    ending mid-chunk); ``first[n]``..``first[n+1]`` are sequence n's pieces, in order."""
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


def _slotted(x: torch.Tensor) -> bool:
    """``[N, ...]`` with each slot contiguous (any slot stride: an engine's mamba pages interleave its tensors)."""
    return x.shape[0] == 0 or x[0].is_contiguous()


def state_layout_ok(S_run: torch.Tensor, S_b: torch.Tensor, buf: torch.Tensor) -> bool:
    """Whether the kernels can address these state caches in place: fp32 states and a bf16 buffer, each slot
    contiguous, the buffer's slot stride even (its fp32 view), each starting 16-byte aligned (the fold kernels are
    compiled for aligned pointers: a misaligned one would compile another variant, whose tiles may round
    otherwise; inputs are copied where needed, ``_kernel_view``)."""
    return (S_run.dtype == S_b.dtype == torch.float32 and buf.dtype == torch.bfloat16
            and _slotted(S_run) and _slotted(S_b) and _slotted(buf) and buf.stride(0) % 2 == 0
            and all(x.data_ptr() % 16 == 0 for x in (S_run, S_b, buf)))


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           S_run: torch.Tensor, S_b: torch.Tensor, buf: torch.Tensor) -> None:
    T, H, K = q.shape
    HV, V = v.shape[1:]
    if k.shape != q.shape or v.shape[0] != T or g.shape != (T, HV) or beta.shape != (T, HV) or HV % H:
        raise ValueError(f"shapes: q/k [T, H, K], v [T, HV, V], g/beta [T, HV], HV % H == 0; got q {tuple(q.shape)}"
                         f" k {tuple(k.shape)} v {tuple(v.shape)} g {tuple(g.shape)} beta {tuple(beta.shape)}")
    C = buf.shape[2]
    for name, x in (("K", K), ("V", V), ("chunk", C)):
        if x < 16 or x & (x - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (a tile side); got {x}")
    if C < 64 and v.device.type == "cuda":
        raise ValueError(f"chunk must be >= 64 on a GPU (the fold's four row blocks are tensor-core tiles of >= 16 "
                         f"rows); got {C}")
    R = row_layout(K, V)["R"]
    if (S_run.shape[1:] != (HV, K, V) or S_b.shape[1:] != (HV, K, V) or buf.shape[1:] != (HV, C, R)
            or not S_run.shape[0] == S_b.shape[0] == buf.shape[0]):
        raise ValueError(f"state must be S_run, S_b [N, {HV}, {K}, {V}] and buffer [N, {HV}, C, {R}]; got "
                         f"{tuple(S_run.shape)}, {tuple(S_b.shape)}, {tuple(buf.shape)}")
    if not state_layout_ok(S_run, S_b, buf):
        raise ValueError("state tensors: S_run, S_b fp32 and the buffer bf16, each 16-byte aligned with each slot "
                         "contiguous (the buffer's slot stride even: its fp32 view)")


def _kernel_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernels take it: unit last stride, 16-byte-aligned start (a slice at an odd token is copied)."""
    return x if x.stride(-1) == 1 and x.data_ptr() % 16 == 0 else x.clone(memory_format=torch.contiguous_format)


class PrefillPlan(NamedTuple):
    """A packed prefill's chunk plan (``chunk_plan``) with every index its launches read already on the device:
    made once per call, or by an engine once per step for all its GDN layers (their layout is the same), so a
    layer's prefill makes no host round trip."""
    n_pieces: int
    slots: list[int]  # state row of each sequence
    kernel: dict[str, torch.Tensor]  # the fold kernels' plan, int32: per piece tok r0 r1 slot save; first, seq_slot
    cu_seg: torch.Tensor  # [n_pieces + 1] int32: every piece a recurrent segment of its own
    pieces: torch.Tensor  # arange(n_pieces): the segments' rows of the scratch
    start_piece: torch.Tensor  # first piece of each sequence with tokens ...
    start_slot: torch.Tensor  # ... and its state row (its S_run seeds that piece)
    mid_piece: torch.Tensor  # last piece of each sequence ending mid-chunk ...
    mid_slot: torch.Tensor  # ... and its state row (S_run := that piece's final state)


def make_prefill_plan(cu_seqlens: list[int], pos: list[int], slots: list[int], chunk: int,
                      device: torch.device | str) -> PrefillPlan:
    """``PrefillPlan`` of packed sequences (``pos[n]`` tokens seen, state rows ``slots[n]``): the host plan and its
    index tensors, moved to the device in two copies."""
    N = len(cu_seqlens) - 1
    plan = chunk_plan(cu_seqlens, pos, chunk)
    plan["slot"] = [slots[n] for n in plan["seq"]]
    plan["seq_slot"] = list(slots)
    n_pieces, first = len(plan["tok"]), plan["first"]
    started = [n for n in range(N) if first[n] < first[n + 1]]
    mid = [n for n in started if plan["r1"][first[n + 1] - 1] < chunk]
    keys32 = ("tok", "r0", "r1", "slot", "save", "first", "seq_slot")
    lists32 = [plan[k] for k in keys32] + [[*plan["tok"], cu_seqlens[-1]]]
    lists64 = [list(range(n_pieces)), [first[n] for n in started], [slots[n] for n in started],
               [first[n + 1] - 1 for n in mid], [slots[n] for n in mid]]
    pin = torch.device(device).type == "cuda"

    def upload(lists: list[list[int]], dtype: torch.dtype) -> list[torch.Tensor]:
        flat = torch.tensor([x for xs in lists for x in xs], dtype=dtype)
        flat = flat.pin_memory() if pin else flat
        return list(flat.to(device, non_blocking=pin).split([len(xs) for xs in lists]))

    t32, t64 = upload(lists32, torch.int32), upload(lists64, torch.long)
    return PrefillPlan(n_pieces, list(slots), dict(zip(keys32, t32[:-1])), t32[-1], *t64)


def prefill(q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor,
            beta_TH: torch.Tensor, cu_seqlens: list[int], scale: float, S_run: torch.Tensor, S_b: torch.Tensor,
            buf: torch.Tensor, pos: list[int] | None = None, slots: list[int] | None = None, *,
            plan: PrefillPlan | None = None, want_final: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Packed prompts continued from each sequence's state (rows ``slots[n]`` of the three state tensors, default
    n; ``pos[n]`` tokens seen, default 0): returns ``(o [T, HV, V] in v's dtype, final [N, HV, K, V])``, ``final``
    each sequence's ``S_run`` after its last token (``None`` unless ``want_final``: an engine reads its caches);
    the state is advanced in place (the caller advances ``pos`` by the lengths). A sequence at a chunk boundary
    (``pos % C == 0``) starts its rows from ``S_run``, which equals ``S_b`` there: for a fresh sequence set both to
    its initial state. ``plan``: ``make_prefill_plan`` of these ``cu_seqlens``, ``pos`` and ``slots`` made
    beforehand (an engine shares one among its layers)."""
    from titan_rl_ext.kernels.gdn_chunk_grid_triton import run_folds
    from titan_rl_ext.kernels.gdn_triton import gated_delta_rule_recurrent

    _check(q_THK, k_THK, v_THV, g_TH, beta_TH, S_run, S_b, buf)
    N = len(cu_seqlens) - 1
    dev = v_THV.device
    if plan is None:
        pos = [0] * N if pos is None else list(pos)
        slots = list(range(N)) if slots is None else list(slots)
        if (len(pos) != N or len(slots) != N or len(set(slots)) != N
                or any(not 0 <= x < S_run.shape[0] for x in slots)):
            raise ValueError(f"{N} sequences need {N} positions and distinct state rows in [0, {S_run.shape[0]}); "
                             f"got {pos}, {slots}")
        plan = make_prefill_plan(cu_seqlens, pos, slots, buf.shape[2], dev)
    elif len(plan.slots) != N:
        raise ValueError(f"a plan of {len(plan.slots)} sequences for {N}")
    if plan.n_pieces == 0:
        return (torch.empty(v_THV.shape, dtype=v_THV.dtype, device=dev),
                S_run[plan.slots].clone() if want_final else None)
    # each piece's starting state: a sequence's first from its S_run (before the folds may restart S_run), the
    # later ones written by the fold chain
    scratch = torch.empty(plan.n_pieces, *S_run.shape[1:], dtype=torch.float32, device=dev)
    scratch[plan.start_piece] = S_run[plan.start_slot]
    q, k, v, g, beta = (_kernel_view(x) for x in (q_THK, k_THK, v_THV, g_TH, beta_TH))
    run_folds(k, v, g, beta, plan.kernel, S_b, buf, S_run, scratch, min(BV, v.shape[2]), NUM_WARPS)
    # every piece a segment of its own, from its scratch row (written back in place: its final state)
    o, _ = gated_delta_rule_recurrent(q, k, v, g, beta, plan.cu_seg, scale, scratch, state_slots=plan.pieces)
    # a sequence ending mid-chunk keeps its running state (one ending on a boundary got S_b in the chain)
    if plan.mid_piece.numel():
        S_run[plan.mid_slot] = scratch[plan.mid_piece]
    return o, (S_run[plan.slots].clone() if want_final else None)


def make_decode_plan(pos: torch.Tensor, slots: torch.Tensor, chunk: int) -> dict[str, torch.Tensor]:
    """A decode step's plan on the device (no host sync; CUDA-graph capturable) for B sequences, one token each:
    ``pos [B]`` tokens seen before it, state rows ``slots [B]``. The fold kernels' fields (as ``make_prefill_plan``'s
    ``kernel``) plus ``cu`` (``arange(B + 1)``: the recurrent kernel's bounds); an engine makes it once a step for
    all its layers."""
    B = pos.shape[0]
    ar = torch.arange(B + 1, dtype=torch.int32, device=pos.device)
    r0 = (pos % chunk).to(torch.int32)
    slots = slots.to(torch.int32)
    return {"tok": ar[:B], "r0": r0, "r1": r0 + 1, "slot": slots, "save": (r0 + 1 < chunk).to(torch.int32),
            "first": ar, "seq_slot": slots, "cu": ar}


def decode(q_BHK: torch.Tensor, k_BHK: torch.Tensor, v_BHV: torch.Tensor, g_BH: torch.Tensor, beta_BH: torch.Tensor,
           scale: float, S_run: torch.Tensor, S_b: torch.Tensor, buf: torch.Tensor, pos: torch.Tensor | None = None,
           slots: torch.Tensor | None = None, *, plan: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """One token for each of B sequences (state rows ``slots [B]``, default b; ``pos [B]``, the tokens seen before
    this one; both on the device; or ``plan``, their ``make_decode_plan``): returns ``o [B, HV, V]``; the state
    advanced in place (the caller advances ``pos`` by one). The recurrent kernel's step on ``S_run``, then the row
    into the buffer and, for a sequence whose row ``pos % C`` is its chunk's last, the fold (``S_b``, then
    ``S_run := S_b``); no host sync. Slots must be distinct."""
    from titan_rl_ext.kernels.gdn_chunk_grid_triton import run_folds
    from titan_rl_ext.kernels.gdn_triton import gated_delta_rule_recurrent

    _check(q_BHK, k_BHK, v_BHV, g_BH, beta_BH, S_run, S_b, buf)
    B = q_BHK.shape[0]
    dev = v_BHV.device
    if plan is None:
        if pos is None:
            raise ValueError("decode needs the positions (pos [B]) or a plan")
        if slots is None:
            if S_run.shape[0] != B:
                raise ValueError(f"{B} tokens without slots need {B} state rows; got {S_run.shape[0]}")
            slots = torch.arange(B, dtype=torch.int32, device=dev)
        if pos.shape != (B,) or slots.shape != (B,):
            raise ValueError(f"{B} tokens need positions and slots [B]; got {tuple(pos.shape)}, {tuple(slots.shape)}")
        plan = make_decode_plan(pos, slots, buf.shape[2])
    elif plan["slot"].shape != (B,):
        raise ValueError(f"a plan of {plan['slot'].shape[0]} sequences for {B} tokens")
    if B == 0:
        return torch.empty(v_BHV.shape, dtype=v_BHV.dtype, device=dev)
    q, k, v, g, beta = (_kernel_view(x) for x in (q_BHK, k_BHK, v_BHV, g_BH, beta_BH))
    o, _ = gated_delta_rule_recurrent(q, k, v, g, beta, plan["cu"], scale, S_run, state_slots=plan["slot"])
    run_folds(k, v, g, beta, plan, S_b, buf, S_run, None, min(BV, v.shape[2]), NUM_WARPS)
    return o


def gated_delta_rule_chunk_grid(q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor,
                                beta_TH: torch.Tensor, cu_seqlens: list[int], scale: float,
                                initial_state: torch.Tensor | None = None,
                                chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole prompts from ``initial_state`` (zeros by default): ``(o [T, HV, V], final [N, HV, K, V])``."""
    HV, V = v_THV.shape[1:]
    state = new_state(len(cu_seqlens) - 1, HV, k_THK.shape[2], V, chunk, v_THV.device, initial_state)
    o, final = prefill(q_THK, k_THK, v_THV, g_TH, beta_TH, cu_seqlens, scale, *state)
    assert final is not None
    return o, final


# ------------------------------------------------------------------------------------------------
# plain PyTorch


def reference_float64(q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor,
                      beta_TH: torch.Tensor, cu_seqlens: list[int], scale: float,
                      initial_state: torch.Tensor | None = None,
                      chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition in float64 without its bf16 roundings (triangular solves for ``T``; rows token by token from
    each chunk's boundary state): ``(o, final)`` of whole prompts, float64."""
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
                S_b = S_all[n, h].clone()
                S = S_b.clone()
                for t in range(lo, hi):  # the rows: the rule token by token from the boundary state
                    S = S * torch.exp(g[t, h])
                    S = S + torch.outer(k[t, h], beta[t, h] * (v[t, h] - k[t, h] @ S))
                    o[t, h] = q[t, h] @ S
                if hi - lo < chunk:  # a prompt's open chunk: its final state is the running state
                    S_all[n, h] = S
                    continue
                kc, G, bc = k[lo:hi, h], torch.cumsum(g[lo:hi, h], 0), beta[lo:hi, h]
                eye = torch.eye(chunk, dtype=f64)
                A = torch.tril(bc[:, None] * torch.exp(G[:, None] - G[None, :]) * (kc @ kc.T), diagonal=-1)
                U = torch.linalg.solve_triangular(eye + A, bc[:, None] * v[lo:hi, h], upper=False)
                W = torch.linalg.solve_triangular(eye + A, (bc * torch.exp(G))[:, None] * kc, upper=False)
                S_all[n, h] = torch.exp(G[-1]) * S_b + (torch.exp(G[-1] - G)[:, None] * kc).T @ (U - W @ S_b)
    return o, S_all


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` as float64 rounded once to fp32: exact for bf16 products, and the same bits for a row wherever it
    sits in the tile (an fp32 BLAS may round rows differently by position or thread count)."""
    return (a.double() @ b.double()).float()


def _f32_cols(rows: torch.Tensor, col: int) -> torch.Tensor:
    """The fp32 value stored in bf16 columns ``col, col + 1`` of buffer rows ``[..., R]``: ``[...]``."""
    return rows[..., col:col + 2].contiguous().view(torch.float32)[..., 0]


def _save_rows_torch(rows_HCR: torch.Tensor, r0: int, k_mHK: torch.Tensor, v_mHV: torch.Tensor,
                     g_mH: torch.Tensor, beta_mH: torch.Tensor) -> None:
    """A piece's raw rows into buffer rows ``r0..`` (k, v bf16; g, beta fp32 as two bf16 columns each)."""
    HV, K, bf16 = rows_HCR.shape[0], k_mHK.shape[2], torch.bfloat16
    L, r1 = row_layout(K, v_mHV.shape[2]), r0 + k_mHK.shape[0]
    rows_HCR[:, r0:r1, :K] = k_mHK.repeat_interleave(HV // k_mHK.shape[1], dim=1).transpose(0, 1).to(bf16)
    rows_HCR[:, r0:r1, L["V"]:L["G"]] = v_mHV.transpose(0, 1).to(bf16)
    rows_HCR[:, r0:r1, L["G"]:L["B"]] = g_mH.T.float()[..., None].contiguous().view(bf16)
    rows_HCR[:, r0:r1, L["B"]:L["R"]] = beta_mH.T.float()[..., None].contiguous().view(bf16)


def _fold_torch(rows_HCR: torch.Tensor, S_HKV: torch.Tensor) -> torch.Tensor:
    """The fold of a complete chunk's stored raw rows ``[HV, C, R]`` from ``S_HKV``: ``S_b`` of the next chunk."""
    HV, C, _ = rows_HCR.shape
    K, V = S_HKV.shape[1:]
    L, bf16 = row_layout(K, V), torch.bfloat16
    k, v = rows_HCR[..., :K], rows_HCR[..., L["V"]:L["G"]]
    g, beta = _f32_cols(rows_HCR, L["G"]), _f32_cols(rows_HCR, L["B"])
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
    G_last = G[:, C - 1]
    kg = (k.float() * torch.exp(G_last[:, None] - G)[..., None]).to(bf16)
    delta = (U.float() - _mm(W, S_HKV.to(bf16))).to(bf16)
    return torch.exp(G_last)[:, None, None] * S_HKV + _mm(kg.transpose(1, 2), delta)


def prefill_torch(q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor,
                  beta_TH: torch.Tensor, cu_seqlens: list[int], scale: float, S_run: torch.Tensor,
                  S_b: torch.Tensor, buf: torch.Tensor, pos: list[int] | None = None,
                  slots: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``prefill`` in plain PyTorch, piece by piece (rows by ``kernels.gdn.recurrent_gated_delta_rule_torch``, folds
    on whole tiles): ``(o [T, HV, V] fp32, final [N, HV, K, V])``; the state advanced in place (row views: it may
    live in a strided engine cache). A decode step is a call with one token a sequence. Its own bits (not the
    kernels': other sum orders), the same for a sequence however its tokens are cut into calls."""
    from titan_rl_ext.kernels.gdn import recurrent_gated_delta_rule_torch

    N = len(cu_seqlens) - 1
    pos = [0] * N if pos is None else list(pos)
    slots = list(range(N)) if slots is None else list(slots)
    C = buf.shape[2]
    plan = chunk_plan(cu_seqlens, pos, C)
    o = torch.empty(v_THV.shape, dtype=torch.float32, device=v_THV.device)
    final = torch.empty(N, *S_run.shape[1:], dtype=torch.float32, device=S_run.device)
    for n, slot in enumerate(slots):
        S = S_run[slot].clone()
        for c in range(plan["first"][n], plan["first"][n + 1]):
            t, r0, r1 = plan["tok"][c], plan["r0"][c], plan["r1"][c]
            sl = slice(t, t + r1 - r0)
            x = (q_THK[sl], k_THK[sl], v_THV[sl], g_TH[sl], beta_TH[sl])
            o_c, fin = recurrent_gated_delta_rule_torch(*x, torch.tensor([0, r1 - r0]), scale, S[None])
            o[sl] = o_c.float()
            _save_rows_torch(buf[slot], r0, *x[1:])
            if r1 == C:
                S_b[slot] = _fold_torch(buf[slot], S_b[slot])
                S = S_b[slot].clone()
            else:
                S = fin[0]
        S_run[slot] = S
        final[n] = S
    return o, final
