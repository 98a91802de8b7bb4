"""The project's own recurrent gated-delta-rule kernel (Triton): BI mode's forward in the trainer, the
generator's prefill and its decode steps alike, so all three run one per-token computation.

Why not FLA's ``fused_recurrent`` (what BI ran before): its step is a chain of two dependent reductions over
K (``k^T S`` after the decay, then ``S^T q`` after the write), and it issues the next token's loads only
after the current token's store, so a long sequence pays memory latency on every token (its share of the BI
trainer step and of a BI prefill: docs/gpu_runs.md §11, "The recurrent GDN kernel").

Here, per value head and block of ``BV`` value columns, one program walks its sequence token by token with
the state block ``S [K, BV]`` in registers and

    kS = S^T k,  qS = S^T q,  kq = k . q           (independent reductions: issued together)
    d = exp(g),  delta = beta (v - d kS)
    o = d qS + kq delta,  S <- d S + k delta^T

which is the rule of ``kernels.gdn`` rearranged: ``(dS)^T k = d S^T k`` and ``(dS + k delta^T)^T q = d S^T
q + (k . q) delta``. The arithmetic differs from the token-by-token reference by rounding only (tests
state the tolerance). The q, k, v, g and beta of the token two steps ahead are loaded before the current token
is computed, so their latency hides behind two steps of work (loads: the bits do not depend on it).

Batch invariance and prefill/decode bit equality: the per-token work depends on the constexprs (``BV``,
``BK``, ``num_warps``, the flags) and on nothing else: not T, not the number of sequences, not where a
sequence starts, not how many tokens a call holds. ``CONFIG`` fixes them per head shape; a prefill split
anywhere, or one token per call with the state carried (decode), gives the same bits as one call.

Optional fused preparation (``NORM_QK``, ``GATES``): q/k arrive raw and are L2-normalised in the kernel
(``x * rsqrt(sum(x^2) + eps)``, as ``rows.l2norm``), and g/beta are formed from the projection's raw
``a``/``b`` (``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)`` rounded to b's dtype, as
``rows.gdn_gates``): three launches fewer per layer and no fp32 copies of q/k.

Runs under the Triton interpreter (``TRITON_INTERPRET=1``) on CPU tensors, which is how the CPU suite
checks it (``tests/test_gdn_triton_interp.py``). Reference: ``kernels.gdn.recurrent_gated_delta_rule_torch``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class RecurrentConfig:
    """Per-token layout of the kernel. Every process of a run must use the same one (bits depend on it)."""

    # BV 32, one warp: of the layouts timed by ``benchmarks/gdn_recurrent.py``, the fastest on the train batch
    # and a 16x2048 prefill together, and among the fastest at decode B = 1/32/256 (the timings:
    # docs/gpu_runs.md §11, "The recurrent GDN kernel")
    BV: int = 32
    num_warps: int = 1


CONFIG = RecurrentConfig()


@triton.jit
def _l2norm(x, eps):
    return x * tl.math.rsqrt(tl.sum(x * x, axis=0) + eps)


@triton.jit
def _gates(a, b, a_log, dt_bias, BETA_DTYPE: tl.constexpr):
    x = a + dt_bias
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's softplus (beta 1, threshold 20)
    return -tl.exp(a_log) * softplus, tl.sigmoid(b).to(BETA_DTYPE).to(tl.float32)


@triton.jit
def _load_token(p_q, p_k, p_v, p_g, p_b, t, sq_t, sk_t, sv_t, sg_t, sb_t, mask_k, mask_v):
    """Token t's q, k, v, g and beta, as stored."""
    return (tl.load(p_q + t * sq_t, mask=mask_k, other=0.0), tl.load(p_k + t * sk_t, mask=mask_k, other=0.0),
            tl.load(p_v + t * sv_t, mask=mask_v, other=0.0), tl.load(p_g + t * sg_t), tl.load(p_b + t * sb_t))


@triton.jit(do_not_specialize=["T"])
def _gdn_recurrent_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, alog_ptr, dtb_ptr, h0_ptr, o_ptr, ht_ptr, cu_ptr, slot_ptr, keep_ptr,
    T, scale, eps, sh0_n, sht_n,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sb_t, so_t, so_h,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    NORM_QK: tl.constexpr, GATES: tl.constexpr, BETA_DTYPE: tl.constexpr, SLOTS: tl.constexpr, KEEP: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_nh = tl.program_id(1).to(tl.int64)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    i_h = i_hv // (HV // H)
    bos = tl.load(cu_ptr + i_n).to(tl.int64)
    eos = tl.load(cu_ptr + i_n + 1).to(tl.int64)

    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    mask_s = mask_k[:, None] & mask_v[None, :]
    # the state: sequence n's own row, or (SLOTS) the row of a state cache its slot names, read and written in
    # place; KEEP: a slot without prior state (recycled: any bits) starts from zeros, by select, not multiply
    if SLOTS:
        slot = tl.load(slot_ptr + i_n).to(tl.int64)
    else:
        slot = i_n
    p_s = i_hv * K * V + offs_k[:, None] * V + offs_v[None, :]
    S = tl.load(h0_ptr + slot * sh0_n + p_s, mask=mask_s, other=0.0).to(tl.float32)
    if KEEP:
        S = tl.where(tl.load(keep_ptr + i_n) != 0, S, 0.0)

    p_q = q_ptr + i_h * sq_h + offs_k
    p_k = k_ptr + i_h * sk_h + offs_k
    p_v = v_ptr + i_hv * sv_h + offs_v
    p_g = g_ptr + i_hv
    p_b = beta_ptr + i_hv
    p_o = o_ptr + i_hv * so_h + offs_v
    if GATES:
        a_log = tl.load(alog_ptr + i_hv).to(tl.float32)
        dt_bias = tl.load(dtb_ptr + i_hv).to(tl.float32)

    # the inputs of the two tokens ahead, loaded before the current one is computed (two: the token chain no
    # longer waits on memory at the train and prefill sizes, docs/gpu_runs.md §15); indices are clamped into
    # [0, T) and past a sequence's end onto its last row, so every load is in bounds and a token loaded beyond
    # the end is never used
    nq, nk, nv, ng, nb = _load_token(p_q, p_k, p_v, p_g, p_b, tl.minimum(bos, T - 1), sq_t, sk_t, sv_t, sg_t, sb_t,
                                     mask_k, mask_v)
    mq, mk, mv, mg, mb = _load_token(p_q, p_k, p_v, p_g, p_b, tl.minimum(bos + 1, T - 1), sq_t, sk_t, sv_t, sg_t,
                                     sb_t, mask_k, mask_v)
    for t in range(bos, eos):
        b_q, b_k, b_v, b_g, b_b = nq, nk, nv, ng, nb
        nq, nk, nv, ng, nb = mq, mk, mv, mg, mb
        mq, mk, mv, mg, mb = _load_token(p_q, p_k, p_v, p_g, p_b, tl.minimum(t + 2, eos - 1), sq_t, sk_t, sv_t,
                                         sg_t, sb_t, mask_k, mask_v)
        q = b_q.to(tl.float32)
        k = b_k.to(tl.float32)
        v = b_v.to(tl.float32)
        if NORM_QK:
            q = _l2norm(q, eps)
            k = _l2norm(k, eps)
        q = q * scale
        if GATES:
            g, beta = _gates(b_g.to(tl.float32), b_b.to(tl.float32), a_log, dt_bias, BETA_DTYPE)
        else:
            g = b_g.to(tl.float32)
            beta = b_b.to(tl.float32)
        d = tl.exp(g)
        kS = tl.sum(S * k[:, None], axis=0)
        qS = tl.sum(S * q[:, None], axis=0)
        kq = tl.sum(k * q, axis=0)
        delta = beta * (v - d * kS)
        o = d * qS + kq * delta
        S = S * d + k[:, None] * delta[None, :]
        tl.store(p_o + t * so_t, o.to(o_ptr.dtype.element_ty), mask=mask_v)
    tl.store(ht_ptr + slot * sht_n + p_s, S.to(ht_ptr.dtype.element_ty), mask=mask_s)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a unit last stride (a head view of a wider buffer is read in place)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def slotted_state_ok(cache: torch.Tensor, HV: int, K: int, V: int) -> bool:
    """Whether the kernel can read and write ``cache`` by slot: ``[S, HV, K, V]`` with each slot contiguous."""
    return (cache.dim() == 4 and tuple(cache.shape[1:]) == (HV, K, V) and tuple(cache.stride()[1:]) == (K * V, V, 1)
            and cache.dtype in _TL_DTYPES)


def gated_delta_rule_recurrent(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    v_THV: torch.Tensor,
    g_TH: torch.Tensor,
    beta_TH: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    *,
    state_slots: torch.Tensor | None = None,
    state_keep: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    norm_qk: bool = False,
    eps: float = 1e-6,
    config: RecurrentConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Recurrent gated delta rule over packed sequences; returns ``(o [T, HV, V] in v's dtype, final state
    [N, HV, K, V] fp32)``. Shapes as ``kernels.gdn``: q/k ``[T, H, K]`` (any strides with a unit last one),
    v ``[T, HV, V]``, g/beta ``[T, HV]``, ``cu_seqlens [N+1]`` on the device.

    ``state_slots [N]`` (an engine's state cache): ``initial_state`` is the cache ``[S, HV, K, V]`` (any slot stride,
    each slot contiguous, fp32 or a narrower dtype), sequence n starts from row ``state_slots[n]`` -- or from
    zeros where ``state_keep[n]`` is false -- and its final state is written back there in place; the cache is
    returned as the state. Saves the gather and scatter copies of every state around the kernel (at a decode
    step of 256 sequences of the 9B shape: 2 x 512 MB read and written per layer).
    ``norm_qk``: q/k are raw and L2-normalised here. ``A_log``/``dt_bias`` given: ``g_TH``/``beta_TH`` are the
    projection's raw ``a``/``b`` and the gates are formed here (``A_log`` fp32, beta rounded to b's dtype)."""
    cfg = config or CONFIG
    if q_THK.dim() != 3 or k_THK.shape != q_THK.shape:
        raise ValueError(f"q and k must both be [T, H, K]; got {tuple(q_THK.shape)} and {tuple(k_THK.shape)}")
    T, H, K = q_THK.shape
    if v_THV.dim() != 3 or v_THV.shape[0] != T:
        raise ValueError(f"v must be [T, HV, V] with T={T}; got {tuple(v_THV.shape)}")
    HV, V = v_THV.shape[1:]
    if HV % H:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({H})")
    if g_TH.shape != (T, HV) or beta_TH.shape != (T, HV):
        raise ValueError(f"g and beta must be [T, HV]=[{T}, {HV}]; got {tuple(g_TH.shape)}, {tuple(beta_TH.shape)}")
    gates = A_log is not None
    if gates and (dt_bias is None or A_log.shape != (HV,) or dt_bias.shape != (HV,)):
        raise ValueError(f"fused gates need A_log and dt_bias of shape [{HV}]")
    if cu_seqlens.dim() != 1:
        raise ValueError(f"cu_seqlens must be 1-D; got {tuple(cu_seqlens.shape)}")
    N = cu_seqlens.numel() - 1
    dev = v_THV.device
    if state_slots is not None:
        if initial_state is None or not slotted_state_ok(initial_state, HV, K, V):
            raise ValueError(f"state_slots need initial_state as a state cache [S, {HV}, {K}, {V}] with contiguous "
                             f"slots; got {None if initial_state is None else tuple(initial_state.shape)}")
        if state_slots.shape != (N,) or (state_keep is not None and state_keep.shape != (N,)):
            raise ValueError(f"state_slots and state_keep must be [N={N}]")
        h0 = final = initial_state
    else:
        if state_keep is not None:
            raise ValueError("state_keep goes with state_slots")
        if initial_state is None:
            initial_state = torch.zeros(N, HV, K, V, dtype=torch.float32, device=dev)
        elif initial_state.shape != (N, HV, K, V):
            raise ValueError(f"initial_state must be [N, HV, K, V]={[N, HV, K, V]}; got {tuple(initial_state.shape)}")
        h0 = initial_state.float().contiguous()
        final = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev)
    q, k, v = _unit_last(q_THK), _unit_last(k_THK), _unit_last(v_THV)
    g, beta = _unit_last(g_TH), _unit_last(beta_TH)
    o = torch.empty(T, HV, V, dtype=v.dtype, device=dev)
    if N == 0 or (T == 0 and state_slots is None):  # no token to step: every final state is its initial state
        return o, final.copy_(h0)
    if T == 0:  # slotted: each slot keeps its state, except that a slot without prior state is zeroed
        if state_keep is not None:
            lost = state_slots[~state_keep.bool()].long()
            final.index_fill_(0, lost, 0.0)
        return o, final
    BK = triton.next_power_of_2(K)
    BV = min(cfg.BV, triton.next_power_of_2(V))
    _gdn_recurrent_kernel[(triton.cdiv(V, BV), N * HV)](
        q, k, v, g, beta,
        A_log if gates else g, dt_bias if gates else g,  # unread without GATES
        h0, o, final, cu_seqlens.to(device=dev, dtype=torch.int32),
        cu_seqlens if state_slots is None else state_slots, cu_seqlens if state_keep is None else state_keep,
        T, scale, eps, h0.stride(0), final.stride(0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), beta.stride(0), o.stride(0), o.stride(1),
        H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        NORM_QK=norm_qk, GATES=gates, BETA_DTYPE=_TL_DTYPES[beta_TH.dtype],
        SLOTS=state_slots is not None, KEEP=state_keep is not None,
        num_warps=cfg.num_warps,
    )
    return o, final
