"""Gated delta rule: plain-PyTorch references, FLA's kernels and the project's recurrent kernel
(``kernels.gdn_triton``, chosen by ``TITAN_GDN_RECURRENT``) behind one signature.

Recurrence per value head h (key head h // (HV // H)), with S of shape [K, V]:

    S_t = exp(g_t) * (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,      o_t = S_t^T (scale * q_t)

Packed layout, no batch dim: q/k ``[T, H, K]``, v ``[T, HV, V]``, g/beta ``[T, HV]``; ``cu_seqlens``
``[N+1]`` splits T into N sequences. States are ``[N, HV, K, V]`` (key-first, FLA's default) in fp32.
q and k arrive already L2-normalised: normalisation belongs to the layer, so every backend sees the
same inputs.

Two torch implementations:
- ``recurrent_gated_delta_rule_torch``: token by token, exactly the formula above. The reference.
- ``chunk_gated_delta_rule_torch``: the chunkwise (WY) form, differentiable through plain autograd;
  many times faster on CPU for prefill/training and used by default there.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F

from titan_rl_ext import settings

GDNMode = Literal["chunk", "recurrent"]


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None,
) -> tuple[int, int, int, int, int]:
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [T, H, K]; got {tuple(q.shape)} and {tuple(k.shape)}")
    T, H, K = q.shape
    if v.dim() != 3 or v.shape[0] != T:
        raise ValueError(f"v must be [T, HV, V] with T={T}; got {tuple(v.shape)}")
    HV, V = v.shape[1], v.shape[2]
    if HV % H != 0:
        raise ValueError(f"value heads ({HV}) must be a multiple of key heads ({H})")
    if g.shape != (T, HV) or beta.shape != (T, HV):
        raise ValueError(f"g and beta must be [T, HV]=[{T}, {HV}]; got {tuple(g.shape)}, {tuple(beta.shape)}")
    # the end check reads a device value: a host sync per layer on GPU, so only on CPU
    if cu_seqlens.dim() != 1 or (cu_seqlens.device.type == "cpu" and int(cu_seqlens[-1]) != T):
        raise ValueError(f"cu_seqlens must be 1-D and end at T={T}; got {cu_seqlens.tolist()}")
    N = cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (N, HV, K, V):
        raise ValueError(f"initial_state must be [N, HV, K, V]={[N, HV, K, V]}; got {tuple(initial_state.shape)}")
    return T, H, K, HV, V


def _expand_heads(x_THK: torch.Tensor, hv: int) -> torch.Tensor:
    """Grouped value heads: value head h reads key head h // (HV // H)."""
    return x_THK.repeat_interleave(hv // x_THK.shape[1], dim=1)


def recurrent_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    T, H, K, HV, V = _check_inputs(q, k, v, g, beta, cu_seqlens, initial_state)
    N = cu_seqlens.numel() - 1
    q_f = _expand_heads(q.float(), HV) * scale
    k_f = _expand_heads(k.float(), HV)
    v_f, g_f, b_f = v.float(), g.float(), beta.float()
    o = torch.empty(T, HV, V, dtype=torch.float32, device=v.device)
    finals = []
    bounds = cu_seqlens.tolist()
    for n in range(N):
        S = (
            initial_state[n].float().clone()
            if initial_state is not None
            else torch.zeros(HV, K, V, dtype=torch.float32, device=v.device)
        )
        for t in range(bounds[n], bounds[n + 1]):
            S = S * g_f[t].exp()[:, None, None]
            k_t = k_f[t]
            kv_mem = (S * k_t[:, :, None]).sum(dim=1)  # [HV, V] = k_t^T S
            delta = (v_f[t] - kv_mem) * b_f[t][:, None]
            S = S + k_t[:, :, None] * delta[:, None, :]
            o[t] = (S * q_f[t][:, :, None]).sum(dim=1)
        finals.append(S)
    final = torch.stack(finals) if finals else torch.zeros(0, HV, K, V, device=v.device)
    return o.to(v.dtype), final


def _pad_sequences(x: torch.Tensor, bounds: list[int], length: int) -> torch.Tensor:
    """[T, ...] packed -> [N, length, ...], zero padded at the end of each sequence."""
    parts = [F.pad(x[s:e], (0, 0) * (x.dim() - 1) + (0, length - (e - s))) for s, e in zip(bounds[:-1], bounds[1:])]
    return torch.stack(parts)


def chunk_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunkwise form. Within a chunk with local cumulative gate c_t = sum_{s<=t} g_s and entry state S0:

        u_t = beta_t (v_t - e^{c_t} k_t^T S0 - sum_{j<t} e^{c_t - c_j} (k_t . k_j) u_j)
        o_t = e^{c_t} S0^T q_t + sum_{j<=t} e^{c_t - c_j} (q_t . k_j) u_j
        S_C = e^{c_C} S0 + sum_j e^{c_C - c_j} k_j u_j^T

    The u-system is unit lower triangular and is solved with ``solve_triangular`` (differentiable).
    Sequences are zero padded to whole chunks: k=v=beta=g=0 leaves the state untouched, so final
    states stay exact. ``compute_dtype=torch.float64`` makes it the float64 reference of the GPU checks.
    """
    cdt = compute_dtype
    T, H, K, HV, V = _check_inputs(q, k, v, g, beta, cu_seqlens, initial_state)
    N = cu_seqlens.numel() - 1
    bounds = cu_seqlens.tolist()
    lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    C = chunk_size
    L = max(1, -(-max(lengths, default=1) // C)) * C
    n_chunks = L // C

    def to_chunks(x: torch.Tensor) -> torch.Tensor:  # [T, HV, ...] -> [N, HV, n, C, ...]
        xp = _pad_sequences(x, bounds, L)  # [N, L, HV, ...]
        xp = xp.movedim(2, 1)  # [N, HV, L, ...]
        return xp.reshape(xp.shape[0], HV, n_chunks, C, *xp.shape[3:])

    q_c = to_chunks(_expand_heads(q.to(cdt), HV) * scale)
    k_c = to_chunks(_expand_heads(k.to(cdt), HV))
    v_c = to_chunks(v.to(cdt))
    g_c = to_chunks(g.to(cdt)).cumsum(-1)  # [N, HV, n, C]
    b_c = to_chunks(beta.to(cdt))

    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    strict = causal.clone().fill_diagonal_(False)
    diff = g_c[..., :, None] - g_c[..., None, :]
    decay = torch.where(causal, diff, torch.full_like(diff, float("-inf"))).exp()  # e^{c_t - c_j}, j <= t

    kk = k_c @ k_c.transpose(-1, -2)
    lower = torch.where(strict, b_c[..., :, None] * kk * decay, torch.zeros_like(kk))
    eye = torch.eye(C, dtype=cdt, device=q.device)
    A = eye + lower
    rhs = torch.cat([b_c[..., None] * v_c, (b_c * g_c.exp())[..., None] * k_c], dim=-1)
    sol = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    u_free, w = sol[..., :V], sol[..., V:]  # u = u_free - w @ S0
    qk = torch.where(causal, (q_c @ k_c.transpose(-1, -2)) * decay, torch.zeros_like(kk))

    S = (
        initial_state.to(cdt)
        if initial_state is not None
        else torch.zeros(N, HV, K, V, dtype=cdt, device=q.device)
    )
    outs = []
    for i in range(n_chunks):
        u = u_free[:, :, i] - w[:, :, i] @ S
        c = g_c[:, :, i]
        o_i = (q_c[:, :, i] * c.exp()[..., None]) @ S + qk[:, :, i] @ u
        outs.append(o_i)
        c_last = c[..., -1:]
        S = S * c_last.exp()[..., None] + (k_c[:, :, i] * (c_last - c).exp()[..., None]).transpose(-1, -2) @ u
    o_pad = torch.stack(outs, dim=2).reshape(N, HV, L, V).movedim(1, 2)  # [N, L, HV, V]
    o = torch.cat([o_pad[n, : lengths[n]] for n in range(N)], dim=0)
    return o.to(v.dtype), S


def _fla_gated_delta_rule(
    mode: GDNMode,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    chunk_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    # Always hand FLA an initial state (zeros for fresh sequences): its kernels are specialised on
    # whether one is given, and the two compiled variants round differently -- a prefill without state
    # and the decode steps after it must run the same code for batch invariance.
    if initial_state is None:
        N = cu_seqlens.numel() - 1
        initial_state = torch.zeros(N, v.shape[1], q.shape[2], v.shape[2], dtype=torch.float32, device=q.device)
    # FLA wants a leading batch dim of 1 for varlen, and int32/int64 cu_seqlens on the device.
    args = dict(
        q=q.to(v.dtype).unsqueeze(0),
        k=k.to(v.dtype).unsqueeze(0),
        v=v.unsqueeze(0),
        g=g.float().unsqueeze(0),
        beta=beta.unsqueeze(0),
        scale=scale,
        initial_state=None if initial_state is None else initial_state.float(),
        output_final_state=True,
        cu_seqlens=cu_seqlens.to(device=q.device, dtype=torch.int32),
    )
    # keyword arguments only: fused_recurrent's fifth positional slot is `gk`, not `beta`.
    # "chunk" is the fast choice; when sequences average two tokens or fewer (decode steps) the
    # recurrent kernel is the faster one (the chunk kernel pads every sequence to a 64-token chunk).
    N = cu_seqlens.numel() - 1
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta, initial_state))
    recurrent = mode == "recurrent" or (q.shape[0] <= 2 * N and not needs_grad)  # recurrent has no backward
    if needs_grad and not recurrent:
        allow_fla_chunk_backward()
    if recurrent:
        fn = fused_recurrent_gated_delta_rule
    else:
        fn = chunk_gated_delta_rule
        if chunk_indices is not None:  # else fla derives them from cu_seqlens on the host: a sync per call
            args["chunk_indices"] = chunk_indices
    o, final = fn(**args)
    return o.squeeze(0), final


FLA_CHUNK_BWD_ENV = settings.FLA_CHUNK_BWD.name
_guard_overridden = False


def allow_fla_chunk_backward() -> str:
    """Let fla-core's chunk backward run on Hopper with Triton 3.4..3.7.0, where fla-core 0.6.0 refuses it
    (FLA issue #640: ``chunk_bwd_dqkwg`` miscompiled at BK=64 on those Triton releases). Allowed because
    ``tests/gpu/test_bi_kernels_cuda.py`` checks its gradients against a float64 reference at the shapes the
    project trains (Qwen3.5 heads, packed varlen, T up to 16K) on the GPU it runs on; ``TITAN_FLA_CHUNK_BWD=0``
    keeps the guard (then BI mode differentiates the torch chunked form, and non-BI training raises).
    The guard reads module globals at call time, so setting the flag on that module is enough."""
    global _guard_overridden
    if not settings.FLA_CHUNK_BWD.get():
        return "kept (TITAN_FLA_CHUNK_BWD=0)"
    co, status = fla_chunk_guard()
    if status == "active":
        co.TRITON_ABOVE_3_7_1 = True
        _guard_overridden = True
    if _guard_overridden:
        return "overridden (gradients checked by tests/gpu/test_bi_kernels_cuda.py)"
    return status


def fla_chunk_guard() -> tuple[Any, str]:
    """fla's ``chunk_o`` module (None without fla) and the state of its #640 guard: ``"active"`` (it would
    refuse the chunk backward), or why it is not."""
    try:
        import fla.ops.common.chunk_o as co
    except Exception as e:  # no fla: nothing to guard
        return None, f"n/a (fla not importable: {type(e).__name__})"
    active = bool(getattr(co, "IS_NVIDIA_HOPPER", False) and getattr(co, "TRITON_ABOVE_3_4_0", False)
                  and not getattr(co, "TRITON_ABOVE_3_7_1", True))
    return co, "active" if active else "not active here (not Hopper, or Triton outside 3.4..3.7.0)"


def fla_chunk_backward_allowed() -> bool:
    return settings.FLA_CHUNK_BWD.get() and fla_available()


def fla_available() -> bool:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception:
        return False
    return True


RECURRENT_ENV = settings.GDN_RECURRENT.name


def recurrent_kernel() -> str:
    """Which kernel runs recurrent forwards on CUDA (BI mode's forward everywhere, decode-sized non-BI calls):
    ``TITAN_GDN_RECURRENT`` = ``titan`` (default: ``kernels.gdn_triton``) or ``fla`` (FLA's ``fused_recurrent``).
    The two round differently, so the trainer and every generator of a run must name the same one."""
    return settings.GDN_RECURRENT.get()


MIXED_STEPS_ENV = settings.GDN_MIXED_STEPS.name


def mixed_steps() -> str:
    """How an engine's non-BI step of decodes and prefills runs its GDN rule (``TITAN_GDN_MIXED_STEPS``):
    ``recurrent`` (default) -- a step of two tokens a sequence or fewer on the project's recurrent kernel whole
    (the prefills' tokens one by one, as BI runs every step), a longer one with its decodes peeled off onto that
    kernel and its prefills on FLA's chunk kernel; ``peel`` -- every such step peeled, as vLLM's own GDN layer
    does. Which is faster depends on the prefills' lengths: the serial kernel walks the longest one token by
    token, the chunk kernel costs a fixed handful of launches."""
    return settings.GDN_MIXED_STEPS.get()


def runs_titan_recurrent(q: torch.Tensor, n_seqs: int, mode: GDNMode, needs_grad: bool) -> bool:
    """The one rule for when ``gated_delta_rule`` (backend ``auto``) runs ``kernels.gdn_triton``: on CUDA, with
    ``recurrent_kernel()`` = ``titan``, for a recurrent forward -- asked for (BI mode), or chosen because the
    call is decode-sized (two tokens a sequence or fewer, no gradient: the chunk kernel would pad each to 64)."""
    return (q.is_cuda and recurrent_kernel() == "titan"
            and (mode == "recurrent" or (q.shape[0] <= 2 * n_seqs and not needs_grad)))


def resolve_backend(q: torch.Tensor, n_seqs: int, mode: GDNMode, needs_grad: bool) -> str:
    """What ``gated_delta_rule`` with backend ``auto`` runs: ``titan`` (``runs_titan_recurrent``), else ``fla`` on
    CUDA where fla-core is installed, else ``torch``."""
    if runs_titan_recurrent(q, n_seqs, mode, needs_grad):
        return "titan"
    return "fla" if q.is_cuda and fla_available() else "torch"


def _titan_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    cu_seqlens: torch.Tensor, scale: float, initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    from titan_rl_ext.kernels.gdn_triton import gated_delta_rule_recurrent

    return gated_delta_rule_recurrent(q, k, v, g, beta, cu_seqlens, scale, initial_state)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    mode: GDNMode = "chunk",
    backend: Literal["auto", "torch", "fla", "titan"] = "auto",
    chunk_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: FLA's Triton kernels on CUDA when installed, the torch implementations otherwise; recurrent
    forwards on CUDA take the project's kernel when ``recurrent_kernel()`` says ``titan`` (FLA not needed).
    ``backend="titan"`` asks for that kernel (recurrent, forward only) wherever triton runs.

    ``chunk_indices [NT, 2]``: (sequence, chunk within it) of every 64-token chunk of ``cu_seqlens``, in FLA's
    layout, where the caller has them (an engine's metadata builds them on the host ahead of the step): FLA's
    chunk kernel then skips deriving them, which reads ``cu_seqlens`` back to the host. Ignored elsewhere."""
    if backend == "auto":
        needs_grad = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state))
        backend = resolve_backend(q, cu_seqlens.numel() - 1, mode, needs_grad)
    if backend == "titan":
        _check_inputs(q, k, v, g, beta, cu_seqlens, initial_state)
        return _titan_recurrent(q, k, v, g, beta, cu_seqlens, scale, initial_state)
    if backend == "fla":
        _check_inputs(q, k, v, g, beta, cu_seqlens, initial_state)
        return _fla_gated_delta_rule(mode, q, k, v, g, beta, cu_seqlens, scale, initial_state, chunk_indices)
    fn = chunk_gated_delta_rule_torch if mode == "chunk" else recurrent_gated_delta_rule_torch
    return fn(q, k, v, g, beta, cu_seqlens, scale, initial_state)


BIForm = Literal["recurrent", "grid"]
BI_FORM_ENV = settings.GDN_BI_FORM.name


def bi_form() -> BIForm:
    """The GDN definition batch-invariant mode runs (``TITAN_GDN_BI_FORM``): ``recurrent`` (token by token, the
    default) or ``grid`` (``kernels.gdn_chunk_grid``: boundary states of 64-token chunks from each sequence's first
    token by the chunk formula, rows by the recurrent kernel from them; prefill, decode and continued prefill give
    the same bits). The two round differently: trainer and generators must name the same one."""
    return settings.GDN_BI_FORM.get()  # type: ignore[return-value]


def bi_form_problem(batch_invariant: bool) -> str | None:
    """Why ``TITAN_GDN_BI_FORM`` cannot hold for a process that starts with ``batch_invariant`` (None: it can):
    ``grid`` defines the rule under batch invariance only, and a generator sizes its GDN state (the open-chunk
    buffer and the boundary state as third and fourth tensors) once, at start-up."""
    if bi_form() == "grid" and not batch_invariant:
        return (f"{BI_FORM_ENV}=grid defines the GDN rule under batch invariance only: start with "
                f"TITAN_BATCH_INVARIANT=1, or unset {BI_FORM_ENV}")
    return None


def grid_shape_problem(n_k_heads: int, n_v_heads: int, k_head_dim: int, v_head_dim: int) -> str | None:
    """Why ``TITAN_GDN_BI_FORM=grid`` cannot serve these GDN heads (None: it can). The Triton kernels tile K, V
    and the chunk as powers of two >= 16; the CPU form is held to the same rule so that a configuration the
    trainer accepts on CPU is one a GPU generator accepts too."""
    bad = [f"{n}={x}" for n, x in (("linear_key_head_dim", k_head_dim), ("linear_value_head_dim", v_head_dim))
           if x < 16 or x & (x - 1)]
    if n_v_heads % n_k_heads:
        bad.append(f"value heads {n_v_heads} not a multiple of key heads {n_k_heads}")
    if not bad:
        return None
    return f"{BI_FORM_ENV}=grid needs GDN head dims that are powers of two >= 16; got {', '.join(bad)}"


def grid_steps_torch(
    q_THK: torch.Tensor, k_THK: torch.Tensor, v_THV: torch.Tensor, g_TH: torch.Tensor, beta_TH: torch.Tensor,
    cu_seqlens: list[int], scale: float, S_run: torch.Tensor, S_b: torch.Tensor, buf: torch.Tensor, pos: list[int],
    slots: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid rule in plain PyTorch (``gdn_chunk_grid.prefill_torch``), continued from each sequence's state rows
    ``slots[n]`` at ``pos[n]`` tokens seen; ``S_run``/``S_b``/``buf`` advanced in place: ``(o [T, HV, V] fp32,
    final)``. The CPU
    form of both the trainer's packed forward and an engine's steps: one function, so that their bits match
    whatever the step layout (row views keep the state where the engine holds it, strided or not)."""
    from titan_rl_ext.kernels.gdn_chunk_grid import prefill_torch

    return prefill_torch(q_THK, k_THK, v_THV, g_TH, beta_TH, cu_seqlens, scale, S_run, S_b, buf, pos, slots)


def gated_delta_rule_grid(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor,
    scale: float, initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole sequences from ``initial_state`` (zeros by default) on the chunk grid: the Triton kernels on CUDA (the
    folds' tiles, then every chunk's rows as a recurrent segment of its own), the same definition in plain PyTorch
    elsewhere (the interpreter is a test tool, not a CPU path): ``(o in v's dtype,
    final [N, HV, K, V])``."""
    from titan_rl_ext.kernels.gdn_chunk_grid import gated_delta_rule_chunk_grid, new_state

    _check_inputs(q, k, v, g, beta, cu_seqlens, initial_state)
    bounds = cu_seqlens.tolist()  # the grid's plan is made on the host either way
    if q.is_cuda:
        return gated_delta_rule_chunk_grid(q, k, v, g, beta, bounds, scale, initial_state)
    N = len(bounds) - 1
    state = new_state(N, v.shape[1], q.shape[2], v.shape[2], device=v.device, initial_state=initial_state)
    o, final = grid_steps_torch(q, k, v, g, beta, bounds, scale, *state, [0] * N, list(range(N)))
    return o.to(v.dtype), final


class _RecurrentForwardChunkBackward(torch.autograd.Function):
    """Forward with the recurrent rule (batch invariant: per-token ops of fixed shape) or the chunk grid
    (``form``), backward through the chunked form (fast, same math). The gradient is the chunked form's gradient
    at the same inputs; the forward value is the recurrent (or grid) one -- they agree to ~1e-7 in fp32."""

    @staticmethod
    def forward(  # type: ignore[no-untyped-def]
        ctx, q, k, v, g, beta, initial_state, cu_seqlens, scale, backend, form="recurrent",
    ):
        with torch.no_grad():
            if form == "grid":
                o, final = gated_delta_rule_grid(q, k, v, g, beta, cu_seqlens, scale, initial_state)
            else:
                o, final = gated_delta_rule(q, k, v, g, beta, cu_seqlens, scale, initial_state, "recurrent", backend)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
        ctx.scale, ctx.backend = scale, backend
        return o, final

    @staticmethod
    def backward(ctx, d_o, d_final):  # type: ignore[no-untyped-def]
        q, k, v, g, beta, s0, cu = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(t.requires_grad) if t is not None else None for t in (q, k, v, g, beta, s0)]
        with torch.enable_grad():
            # FLA's chunk backward on CUDA (its Hopper guard overridden: see allow_fla_chunk_backward), else
            # the torch chunked form; either way the chunked form's gradient at the same inputs
            if q.is_cuda and ctx.backend in ("auto", "fla", "titan") and fla_chunk_backward_allowed():
                o, final = gated_delta_rule(*inputs[:5], cu, ctx.scale, inputs[5], "chunk", "fla")
            else:
                o, final = chunk_gated_delta_rule_torch(*inputs[:5], cu, ctx.scale, inputs[5])
            outs, grads_in = [o], [d_o]
            if d_final is not None:
                outs.append(final)
                grads_in.append(d_final)
            wrt = [t for t in inputs if t is not None and t.requires_grad]
            grads = iter(torch.autograd.grad(outs, wrt, grads_in, allow_unused=True)) if wrt else iter(())
        result = [next(grads) if (t is not None and t.requires_grad) else None for t in inputs]
        return (*result, None, None, None, None)


def gated_delta_rule_bi(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    backend: Literal["auto", "torch", "fla", "titan"] = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch-invariant mode: recurrent kernel forward (trainer, prefill and decode alike) -- or the chunk grid where
    ``bi_form()`` says ``grid`` -- chunked backward."""
    form = bi_form()
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, g, beta, initial_state)):
        return _RecurrentForwardChunkBackward.apply(q, k, v, g, beta, initial_state, cu_seqlens, scale, backend, form)
    if form == "grid":
        return gated_delta_rule_grid(q, k, v, g, beta, cu_seqlens, scale, initial_state)
    return gated_delta_rule(q, k, v, g, beta, cu_seqlens, scale, initial_state, "recurrent", backend)
