"""Per-row ops of the layers -- RMSNorm (and the attention's q/k norm with its rotary embedding), the GDN output's
gated RMSNorm, l2norm, SwiGLU's ``silu(g) * u``, the
attention's output gate ``sigmoid(g) * o``, the GDN gates --
each as a plain-PyTorch reference (``*_torch``: what CPU runs, what the kernels are tested against) and a
dispatcher that runs one Triton launch (``rows_triton``) on CUDA.

The dispatchers pick by device alone, never by mode: on CUDA the trainer and the generator run the same
kernel, batch-invariant mode or not (its row layout depends on the row width only), so the forward bits
both sides see are the kernel's. Gradients go through the reference (the inputs are saved and the
reference is differentiated at them): a backward pass need not be batch invariant, and the reference's
gradient is the gradient of the same function up to rounding. ``TITAN_FUSED_KERNELS=0`` keeps the torch
references on CUDA (a debugging switch: both sides of a run must use the same setting).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from titan_rl_ext import settings
from titan_rl_ext.kernels import ops

FUSED_ENV = settings.FUSED_KERNELS.name


# ---------------------------------------------------------------------------------------------------
# references


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """Qwen3.5 (``zero_centered``): ``(x_hat * (1 + w)).to(x.dtype)``; Qwen3: ``w * x_hat.to(x.dtype)``
    (the promoted dtype of w and x). ``x_hat = x * rsqrt(mean(x^2) + eps)`` in fp32."""
    x32 = x.float()
    x_hat = x32 * ops.rsqrt(ops.mean_sq(x32) + eps)
    if zero_centered:
        return (x_hat * (1.0 + weight.float())).to(x.dtype)
    return weight * x_hat.to(x.dtype)


def add_rms_norm_torch(
    x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's add and the next norm: ``(s, rms_norm_torch(s))`` with ``s = x + h``."""
    s = x + h
    return s, rms_norm_torch(s, weight, eps, zero_centered)


def rotary_torch(x: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of the first ``R`` dims of ``x`` ``[T, heads, D]`` (the rest pass through):
    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x[R/2:R], x[:R/2]]``, in x's dtype (HF's form)."""
    r = cos_TR.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
    out = x_rot * cos_TR[:, None, :] + rotated * sin_TR[:, None, :]
    return torch.cat([out, x_pass], dim=-1)


def rotary_transpose_torch(dy: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
    """The gradient of ``rotary_torch`` with respect to its ``x``, given the output's gradient ``dy``."""
    r = cos_TR.shape[-1]
    half = r // 2
    d_rot, d_pass = dy[..., :r], dy[..., r:]
    ds = d_rot * sin_TR[:, None, :]
    return torch.cat([d_rot * cos_TR[:, None, :] + torch.cat([ds[..., half:], -ds[..., :half]], dim=-1), d_pass], dim=-1)


def rms_norm_rotary_torch(
    x: torch.Tensor, weight: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor, eps: float, zero_centered: bool
) -> torch.Tensor:
    """The attention's q/k path: ``rotary_torch(rms_norm_torch(x))``."""
    return rotary_torch(rms_norm_torch(x, weight, eps, zero_centered), cos_TR, sin_TR)


def gated_rms_norm_torch(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(w * x_hat.to(x.dtype)) * silu(gate)``, rounded to ``x.dtype`` (the GDN output norm)."""
    x32 = x.float()
    x_hat = x32 * ops.rsqrt(ops.mean_sq(x32) + eps)
    y = weight * x_hat.to(x.dtype)
    return (y * ops.silu(gate.float())).to(x.dtype)


def l2norm_torch(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim, in fp32 (fp32 result whatever ``x``'s dtype)."""
    x32 = x.float()
    return x32 * ops.rsqrt(ops.sum_sq(x32) + eps)


def silu_mul_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return ops.silu(gate) * up


def sigmoid_mul_torch(gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The attention's output gate: ``sigmoid(gate)`` rounded to the dtype, times ``x``."""
    return ops.sigmoid(gate) * x


def gdn_gates_torch(
    a_TH: torch.Tensor, b_TH: torch.Tensor, A_log_H: torch.Tensor, dt_bias_H: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's per-token decay ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32) and write
    strength ``beta = sigmoid(b)`` (b's dtype)."""
    g = -ops.exp(A_log_H.float()) * ops.softplus(a_TH.float() + dt_bias_H)
    return g, ops.sigmoid(b_TH.contiguous())


# ---------------------------------------------------------------------------------------------------
# dispatch


@functools.lru_cache(maxsize=1)
def _kernels() -> Any:
    try:
        from titan_rl_ext.kernels import rows_triton
    except Exception:  # no triton (CPU wheels), or one that cannot initialise
        return None
    return rows_triton


def fused_switched_on() -> bool:
    """``TITAN_FUSED_KERNELS`` is on (``settings.FUSED_KERNELS``: the one switch for every fused layer kernel, the conv's too)."""
    return settings.FUSED_KERNELS.get()


_fused_backward = True


def fused_backward_on() -> bool:
    """Whether the fused kernels that have a backward kernel of their own use it: always, outside
    ``reference_backward``."""
    return _fused_backward


@contextlib.contextmanager
def reference_backward() -> Iterator[None]:
    """Within the block, the fused kernels differentiate their torch references instead of running their backward
    kernels: the path the kernels are measured against (benchmarks, tests), not a setting of a run."""
    global _fused_backward
    before, _fused_backward = _fused_backward, False
    try:
        yield
    finally:
        _fused_backward = before


def fused_available(*ts: torch.Tensor | None) -> bool:
    """Whether the Triton kernels run for these tensors: all on CUDA, triton importable, not switched off."""
    return fused_switched_on() and all(t is None or t.is_cuda for t in ts) and _kernels() is not None


class _KernelForwardReferenceBackward(torch.autograd.Function):
    """Forward: ``kernel(*inputs)``. Backward: ``backward(*inputs, *grads)`` -- a backward kernel returning one
    gradient per input -- where one is given and ``fused_backward_on()``; else the gradient of ``reference`` at
    the saved inputs."""

    @staticmethod
    def forward(ctx, kernel, reference, backward, *inputs):  # type: ignore[no-untyped-def]
        ctx.reference, ctx.backward_kernel = reference, backward
        ctx.save_for_backward(*inputs)
        return kernel(*inputs)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[no-untyped-def]
        needs = ctx.needs_input_grad[3:]
        if ctx.backward_kernel is not None and fused_backward_on() and all(g is not None for g in grads):
            got = ctx.backward_kernel(*ctx.saved_tensors, *grads)
            return (None, None, None, *[g if n else None for g, n in zip(got, needs)])
        inputs = [None if t is None else t.detach().requires_grad_(bool(n)) for t, n in zip(ctx.saved_tensors, needs)]
        with torch.enable_grad():
            outs = ctx.reference(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o is not None and o.requires_grad]
        wrt = [t for t in inputs if t is not None and t.requires_grad]
        if not pairs or not wrt:
            return (None, None, None, *[None] * len(inputs))
        got = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True))
        return (None, None, None, *[next(got) if t is not None and t.requires_grad else None for t in inputs])


def kernel_with_reference_grad(
    kernel: Callable[..., Any], reference: Callable[..., Any], *inputs: torch.Tensor | None,
    backward: Callable[..., Any] | None = None,
) -> Any:
    """``kernel(*inputs)``, differentiable when any input requires grad: by ``backward`` (a backward kernel,
    outside ``reference_backward``) or else through ``reference``."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        return _KernelForwardReferenceBackward.apply(kernel, reference, backward, *inputs)
    return kernel(*inputs)


def _fits(x: torch.Tensor) -> bool:
    return x.shape[-1] <= _kernels().MAX_D and x.dtype in (torch.float32, torch.bfloat16, torch.float16)


def _norm_mode(x: torch.Tensor, weight: torch.Tensor, zero_centered: bool) -> tuple[int, torch.dtype]:
    """The RMSNorm flavour as the kernel's MODE, and its output dtype (``rms_norm_torch``'s)."""
    if zero_centered:
        return 1, x.dtype
    return 0, torch.promote_types(weight.dtype, x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    """``rms_norm_torch``; one Triton launch on CUDA."""
    if not (fused_available(x, weight) and _fits(x) and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        return rms_norm_torch(x, weight, eps, zero_centered)
    k = _kernels()
    mode, out = _norm_mode(x, weight, zero_centered)

    def kernel(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return k.norm_rows(x, w.contiguous(), eps, mode, out_dtype=out)

    def backward(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        dx, dw, _ = k.norm_rows_backward(x, w.contiguous(), eps, mode, dy)
        return dx, dw

    return kernel_with_reference_grad(kernel, functools.partial(rms_norm_torch, eps=eps, zero_centered=zero_centered),
                                      x, weight, backward=backward)


class _AddRMSNorm(torch.autograd.Function):
    """``(s, y) = (x + h, rms_norm(x + h))`` by the kernel; saves the sum (not both addends: one activation per
    add, as the unfused norm saved). Backward: the norm's backward kernel at ``s`` (in ``reference_backward``:
    the reference's gradient there), plus the sum's own gradient, to both addends."""

    @staticmethod
    def forward(ctx, x, h, w, eps, zero_centered):  # type: ignore[no-untyped-def]
        s, y = _add_rms_norm_kernel(x, h, w, eps, zero_centered)
        ctx.save_for_backward(s, w)
        ctx.eps, ctx.zero_centered = eps, zero_centered
        return s, y

    @staticmethod
    def backward(ctx, ds, dy):  # type: ignore[no-untyped-def]
        s, w = ctx.saved_tensors
        if fused_backward_on():
            mode = _norm_mode(s, w, ctx.zero_centered)[0]
            dn, dw, _ = _kernels().norm_rows_backward(s, w.contiguous(), ctx.eps, mode, dy)
        else:
            sg, wg = s.detach().requires_grad_(True), w.detach().requires_grad_(True)
            with torch.enable_grad():
                dn, dw = torch.autograd.grad(rms_norm_torch(sg, wg, ctx.eps, ctx.zero_centered), (sg, wg), dy)
        d = dn if ds is None else ds + dn  # the sum's gradient reaches both addends
        return d, d, dw, None, None


def _add_rms_norm_kernel(
    x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    mode, out = _norm_mode(x, weight, zero_centered)
    return _kernels().norm_rows(x, weight.contiguous(), eps, mode, out_dtype=out, residual=h)


def add_rms_norm(
    x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm_torch``: the residual add and the norm after it in one Triton launch on CUDA (one read of
    each input, one write of the sum and of the normalised rows; the sum's bits are torch's ``x + h``)."""
    if not (fused_available(x, h, weight) and _fits(x) and h.shape == x.shape and h.dtype == x.dtype
            and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        return add_rms_norm_torch(x, h, weight, eps, zero_centered)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, h, weight)):
        return _AddRMSNorm.apply(x, h, weight, eps, zero_centered)
    return _add_rms_norm_kernel(x, h, weight, eps, zero_centered)


def rms_norm_rotary(
    x: torch.Tensor, weight: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor, eps: float, zero_centered: bool
) -> torch.Tensor:
    """``rms_norm_rotary_torch`` (``x`` ``[T, heads, D]``, e.g. a head view of the attention's merged projection);
    one Triton launch on CUDA, where the norm and the rotary took eight (the norm, a negation, two concatenations,
    two products, a sum, the pass-through copy)."""
    mode, out = _norm_mode(x, weight, zero_centered)
    if not (fused_available(x, weight, cos_TR, sin_TR) and _fits(x)
            and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and _kernels().rotary_problem(x, mode, cos_TR, sin_TR, out) is None):
        return rms_norm_rotary_torch(x, weight, cos_TR, sin_TR, eps, zero_centered)
    k = _kernels()

    def kernel(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return k.norm_rows(x, w.contiguous(), eps, mode, out_dtype=out, cos=c, sin=s)

    def backward(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor, s: torch.Tensor,
                 dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None, None]:
        dx, dw, _ = k.norm_rows_backward(x, w.contiguous(), eps, mode, rotary_transpose_torch(dy, c, s))
        return dx, dw, None, None

    return kernel_with_reference_grad(
        kernel, functools.partial(rms_norm_rotary_torch, eps=eps, zero_centered=zero_centered),
        x, weight, cos_TR, sin_TR, backward=backward)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``gated_rms_norm_torch``; one Triton launch on CUDA."""
    if not (fused_available(x, gate, weight) and _fits(x) and gate.shape == x.shape
            and gate.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and weight.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        return gated_rms_norm_torch(x, gate, weight, eps)
    k = _kernels()
    mid = torch.promote_types(weight.dtype, x.dtype)

    def kernel(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return k.norm_rows(x, w.contiguous(), eps, 2, gate=z, mid_dtype=mid)

    def backward(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> tuple[Any, Any, Any]:
        dx, dw, dz = k.norm_rows_backward(x, w.contiguous(), eps, 2, dy, gate=z, mid_dtype=mid)
        return dx, dz, dw

    return kernel_with_reference_grad(kernel, functools.partial(gated_rms_norm_torch, eps=eps), x, gate, weight,
                                      backward=backward)


def l2norm(x: torch.Tensor, eps: float = 1e-6, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``l2norm_torch`` (fp32 result); one Triton launch on CUDA, reading 16-bit inputs in place. ``out_dtype`` (no
    gradient): the fp32 result rounded to it, written so by the kernel -- for a consumer that would cast it."""
    if out_dtype != torch.float32:
        if torch.is_grad_enabled() and x.requires_grad:
            raise ValueError("l2norm rounds its result to another dtype only without a gradient")
        if fused_available(x) and _fits(x):
            return _kernels().norm_rows(x, None, eps, 3, out_dtype=out_dtype)
        return l2norm_torch(x, eps).to(out_dtype)
    if not (fused_available(x) and _fits(x)):
        return l2norm_torch(x, eps)
    k = _kernels()

    def kernel(x: torch.Tensor) -> torch.Tensor:
        return k.norm_rows(x, None, eps, 3, out_dtype=torch.float32)

    def backward(x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor]:
        return (k.norm_rows_backward(x, None, eps, 3, dy)[0],)

    return kernel_with_reference_grad(kernel, functools.partial(l2norm_torch, eps=eps), x, backward=backward)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``; one Triton launch on CUDA (``gate``/``up`` may be views of one merged GEMM output)."""
    if not (fused_available(gate, up) and gate.shape == up.shape and gate.dtype == up.dtype
            and gate.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        return silu_mul_torch(gate, up)
    return kernel_with_reference_grad(_kernels().silu_mul, silu_mul_torch, gate, up, backward=_kernels().silu_mul_backward)


def sigmoid_mul(gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``sigmoid(gate) * x``; one Triton launch on CUDA (``gate`` read in place, e.g. a head view of the attention's
    merged projection: no copy of it, no separate sigmoid)."""
    if not (fused_available(gate, x) and gate.shape == x.shape and gate.dtype == x.dtype
            and gate.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        return sigmoid_mul_torch(gate, x)
    k = _kernels()
    return kernel_with_reference_grad(k.sigmoid_mul, sigmoid_mul_torch, gate, x, backward=k.sigmoid_mul_backward)


def gdn_gates(
    a_TH: torch.Tensor, b_TH: torch.Tensor, A_log_H: torch.Tensor, dt_bias_H: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gdn_gates_torch``; one Triton launch on CUDA (eight torch kernels otherwise)."""
    ok = (fused_available(a_TH, b_TH, A_log_H, dt_bias_H) and a_TH.dim() == 2 and a_TH.shape == b_TH.shape
          and a_TH.dtype in (torch.float32, torch.bfloat16, torch.float16) and b_TH.dtype == a_TH.dtype)
    if not ok:
        return gdn_gates_torch(a_TH, b_TH, A_log_H, dt_bias_H)
    return kernel_with_reference_grad(_kernels().gdn_gates, gdn_gates_torch, a_TH, b_TH, A_log_H, dt_bias_H)
