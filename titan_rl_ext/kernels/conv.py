"""Causal depthwise conv1d over packed sequences, with an optional carried state.

Layout: x ``[T, C]`` packed, weight ``[C, W]``, ``cu_seqlens`` ``[N+1]``; the state of a sequence is
its last ``W - 1`` inputs, ``[N, W-1, C]`` (time-major, like vLLM's conv cache). With no initial
state a sequence starts from zeros -- the same as left zero padding, which is what HF does.

``causal_conv1d`` is what the model calls: the Triton kernel (``conv_triton``) on CUDA, else
``causal_conv1d_torch``, every sequence at once with no host synchronisation (decode steps of hundreds of
sequences). ``causal_conv1d_reference`` loops over sequences and is kept as the readable reference.
All three compute ``sum_j x[t - W + 1 + j] * w[:, j]`` in fp32 with the taps in ascending order, the
activation in fp32 and one rounding to the input dtype (as FLA's and vLLM's conv kernels do); the two
torch ones agree bit for bit, the kernel to fp32 rounding (it may fuse multiply-adds).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from titan_rl_ext.kernels import ops


def _check_args(
    x_TC: torch.Tensor, weight_CW: torch.Tensor, cu_seqlens: torch.Tensor, initial_state: torch.Tensor | None
) -> tuple[int, int, int, int]:
    """Shapes of both implementations' inputs; returns ``T, C, W, N``."""
    if x_TC.dim() != 2 or weight_CW.dim() != 2 or weight_CW.shape[0] != x_TC.shape[1]:
        raise ValueError(f"expected x [T, C] and weight [C, W]; got {tuple(x_TC.shape)}, {tuple(weight_CW.shape)}")
    T, C = x_TC.shape
    W = weight_CW.shape[1]
    N = cu_seqlens.numel() - 1
    if x_TC.device.type == "cpu" and int(cu_seqlens[-1]) != T:  # on GPU this check would cost a host sync
        raise ValueError(f"cu_seqlens ends at {int(cu_seqlens[-1])}, expected T={T}")
    if initial_state is not None and initial_state.shape != (N, W - 1, C):
        raise ValueError(f"conv state must be [N, W-1, C]={[N, W - 1, C]}; got {tuple(initial_state.shape)}")
    return T, C, W, N


def _activate(y_TC: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation == "silu":
        return ops.silu(y_TC)
    if activation is not None:
        raise ValueError(f"unsupported activation {activation!r}")
    return y_TC


def causal_conv1d_reference(
    x_TC: torch.Tensor,
    weight_CW: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bias_C: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    T, C, W, N = _check_args(x_TC, weight_CW, cu_seqlens, initial_state)
    bounds = cu_seqlens.tolist()
    if bounds[-1] != T:  # _check_args skips this on GPU; the loop reads the bounds anyway
        raise ValueError(f"cu_seqlens ends at {bounds[-1]}, expected T={T}")
    ys, states = [], []
    for n in range(N):
        xs = x_TC[bounds[n] : bounds[n + 1]]
        prefix = (
            initial_state[n].to(x_TC.dtype)
            if initial_state is not None
            else x_TC.new_zeros(W - 1, C)
        )
        full = torch.cat([prefix, xs], dim=0)  # [W-1+L, C]
        states.append(full[full.shape[0] - (W - 1) :])
        if xs.shape[0] == 0:  # nothing new for this sequence in this step: state passes through
            continue
        L = xs.shape[0]
        # Taps summed one by one in a fixed order: each output's bits depend only on its own W
        # inputs, not on the sequence length or chunking (F.conv1d's vectorisation does depend on
        # them), so a prefill split across steps reproduces the unsplit result exactly.
        w32 = weight_CW.float()
        y = full[0:L].float() * w32[:, 0]
        for j in range(1, W):
            y = y + full[j : j + L].float() * w32[:, j]
        if bias_C is not None:
            y = y + bias_C.float()
        ys.append(y)
    y_TC = torch.cat(ys, dim=0) if ys else x_TC.new_zeros(0, C, dtype=torch.float32)
    y_TC = _activate(y_TC, activation).to(x_TC.dtype)
    final = torch.stack(states) if states else x_TC.new_zeros(0, W - 1, C)
    return y_TC, final


def causal_conv1d_torch(
    x_TC: torch.Tensor,
    weight_CW: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bias_C: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """All sequences at once: their states and tokens are laid out back to back in one buffer
    (``[state_0, x_0, state_1, x_1, ...]``), so tap ``j`` of every token is one gather."""
    T, C, W, N = _check_args(x_TC, weight_CW, cu_seqlens, initial_state)
    dev = x_TC.device
    cu = cu_seqlens.to(device=dev, dtype=torch.long)
    seq_T = torch.repeat_interleave(torch.arange(N, device=dev), cu[1:] - cu[:-1], output_size=T)
    tok_pos_T = torch.arange(T, device=dev) + (seq_T + 1) * (W - 1)  # where token t sits in the buffer
    start_N = cu[:-1] + torch.arange(N, device=dev) * (W - 1)  # where sequence n's state begins
    taps = torch.arange(W - 1, device=dev)
    buf = x_TC.new_zeros(T + N * (W - 1), C)
    if initial_state is not None:
        buf[(start_N[:, None] + taps).reshape(-1)] = initial_state.to(x_TC.dtype).reshape(-1, C)
    buf[tok_pos_T] = x_TC
    first_T = tok_pos_T - (W - 1)
    # Taps summed one by one in a fixed order: each output's bits depend only on its own W inputs, not
    # on the sequence length or chunking, so a prefill split across steps reproduces the unsplit result.
    w32 = weight_CW.float()
    y_TC = buf[first_T].float() * w32[:, 0]
    for j in range(1, W):
        y_TC = y_TC + buf[first_T + j].float() * w32[:, j]
    if bias_C is not None:
        y_TC = y_TC + bias_C.float()
    y_TC = _activate(y_TC, activation).to(x_TC.dtype)
    end_N = cu[1:] + (torch.arange(N, device=dev) + 1) * (W - 1)
    final = buf[(end_N[:, None] - (W - 1) + taps).reshape(-1)].view(N, W - 1, C)
    return y_TC, final


@functools.lru_cache(maxsize=1)
def _kernels() -> Any:
    try:
        from titan_rl_ext.kernels import conv_triton
    except Exception:  # no triton, or one that cannot initialise
        return None
    return conv_triton


def _on_kernel(x_TC: torch.Tensor) -> bool:
    """Whether ``causal_conv1d`` runs the Triton kernel for this input: on CUDA, triton importable, the fused
    kernels not switched off (``TITAN_FUSED_KERNELS``)."""
    from titan_rl_ext.kernels.rows import fused_switched_on

    return x_TC.is_cuda and fused_switched_on() and _kernels() is not None


class _ConvKernelForwardBackward(torch.autograd.Function):
    """The Triton conv with its own backward kernel (no initial state, no bias: the trainer's call). A gradient
    reaching the final states (never, in training) is taken through ``causal_conv1d_torch`` instead."""

    @staticmethod
    def forward(ctx, x, w, cu_seqlens, activation):  # type: ignore[no-untyped-def]
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, w, cu_seqlens)
        ctx.activation = activation
        return _kernels().causal_conv1d_triton(x, w, cu_seqlens, None, None, activation)

    @staticmethod
    def backward(ctx, dy, d_final):  # type: ignore[no-untyped-def]
        x, w, cu = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        if d_final is not None:
            xs = x.detach().requires_grad_(need_x)
            ws = w.detach().requires_grad_(need_w)
            with torch.enable_grad():
                y, final = causal_conv1d_torch(xs, ws, cu, None, None, ctx.activation)
            outs, grads = zip(*[(o, g) for o, g in ((y, dy), (final, d_final)) if g is not None])
            wrt = [t for t in (xs, ws) if t.requires_grad]
            got = iter(torch.autograd.grad(outs, wrt, grads, allow_unused=True))
            return (next(got) if need_x else None), (next(got) if need_w else None), None, None
        if dy is None:
            return None, None, None, None
        dx, dw = _kernels().causal_conv1d_backward_triton(x, w, cu, dy, ctx.activation)
        return (dx if need_x else None), (dw if need_w else None), None, None


def causal_conv1d(
    x_TC: torch.Tensor,
    weight_CW: torch.Tensor,
    cu_seqlens: torch.Tensor,
    bias_C: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
    *,
    state_slots: torch.Tensor | None = None,
    state_keep: torch.Tensor | None = None,
    split: int | None = None,
) -> tuple[Any, torch.Tensor]:
    """The model's conv: one Triton launch (plus one for the states) on CUDA, ``causal_conv1d_torch``
    elsewhere. Differentiable on both: on CUDA without initial state or bias (training) by the backward kernel
    (in ``rows.reference_backward``: by ``causal_conv1d_torch``'s gradient at the same inputs, as otherwise).

    ``state_slots [N]``: ``initial_state`` is an engine's conv cache ``[S, W-1, C]``; sequence n starts from cache
    row ``state_slots[n]`` (zeros where ``state_keep[n]`` is false), its final state is written back there, and
    the cache is returned as the state. The Triton kernel does it in place where it can
    (``conv_triton.slotted_conv_state_ok``, no gradient); otherwise the states are gathered (cast to x's dtype),
    run as above, and scattered back: on one device, the same bits either way.

    ``split``: the output comes as its two column ranges ``(y[:, :split], y[:, split:])``, each contiguous where the
    kernel runs without a gradient (it writes them apart), else views of one ``y``."""
    from titan_rl_ext.kernels.rows import fused_backward_on, kernel_with_reference_grad

    k = _kernels() if _on_kernel(x_TC) else None
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x_TC, weight_CW, bias_C, initial_state))
    if split is not None and (k is None or grad):  # one y, cut into views
        y, final = causal_conv1d(x_TC, weight_CW, cu_seqlens, bias_C, initial_state, activation,
                                 state_slots=state_slots, state_keep=state_keep)
        return (y[:, :split], y[:, split:]), final
    if state_slots is not None:
        return _slotted(x_TC, weight_CW, cu_seqlens, bias_C, initial_state, activation, state_slots, state_keep, k,
                        grad, split)
    if state_keep is not None:
        raise ValueError("state_keep goes with state_slots")
    if split is not None:  # the kernel, no gradient
        _check_args(x_TC, weight_CW, cu_seqlens, initial_state)
        return k.causal_conv1d_triton(x_TC, weight_CW, cu_seqlens, bias_C, initial_state, activation, split=split)
    if k is None:
        return causal_conv1d_torch(x_TC, weight_CW, cu_seqlens, bias_C, initial_state, activation)
    _check_args(x_TC, weight_CW, cu_seqlens, initial_state)
    if grad and bias_C is None and initial_state is None and fused_backward_on():
        return _ConvKernelForwardBackward.apply(x_TC, weight_CW, cu_seqlens, activation)
    kernel = k.causal_conv1d_triton

    def run(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, s: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return kernel(x, w, cu_seqlens, b, s, activation)

    def ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, s: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return causal_conv1d_torch(x, w, cu_seqlens, b, s, activation)

    return kernel_with_reference_grad(run, ref, x_TC, weight_CW, bias_C, initial_state)


def _slotted(
    x_TC: torch.Tensor, weight_CW: torch.Tensor, cu_seqlens: torch.Tensor, bias_C: torch.Tensor | None,
    cache: torch.Tensor | None, activation: str | None, slots: torch.Tensor, keep: torch.Tensor | None, k: Any,
    grad: bool, split: int | None = None,
) -> tuple[Any, torch.Tensor]:
    """``causal_conv1d`` on an engine's conv cache by slot (see there); ``grad``: whether any input (the cache
    included) wants a gradient, as ``causal_conv1d`` found."""
    W, N = weight_CW.shape[1], cu_seqlens.numel() - 1
    if cache is None or cache.dim() != 3 or tuple(cache.shape[1:]) != (W - 1, x_TC.shape[1]):
        raise ValueError(f"state_slots need initial_state as a conv cache [S, {W - 1}, {x_TC.shape[1]}]; got "
                         f"{None if cache is None else tuple(cache.shape)}")
    if slots.shape != (N,) or (keep is not None and keep.shape != (N,)):
        raise ValueError(f"state_slots and state_keep must be [N={N}]")
    if k is not None and not grad and k.slotted_conv_state_ok(cache, x_TC, W):
        return k.causal_conv1d_triton(x_TC, weight_CW, cu_seqlens, bias_C, cache, activation,
                                      state_slots=slots, state_keep=keep, split=split)
    idx = slots.long()
    s0 = cache.index_select(0, idx).to(x_TC.dtype)
    if keep is not None:
        # a recycled slot holds another request's (or uninitialised) state: where, not multiply
        s0 = torch.where(keep.to(torch.bool)[:, None, None], s0, torch.zeros_like(s0))
    y, final = causal_conv1d(x_TC, weight_CW, cu_seqlens, bias_C, s0, activation, split=split)
    cache.index_copy_(0, idx, final.to(cache.dtype))
    return y, cache
