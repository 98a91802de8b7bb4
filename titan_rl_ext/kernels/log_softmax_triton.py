"""The sampled token's log-softmax with torch's bits, without writing the ``[T, V]`` log-softmax.

The trainer's logprob of a sampled token must equal the generator's bit for bit, and vLLM's sampler takes it
from ``logits.log_softmax(-1)`` on fp32 logits (torch's CUDA kernel). Calling that kernel in the trainer costs
a full ``[T, V]`` fp32 output and three reads of the logits (torch's row kernel finds the max, then the sum of
exponentials, then writes every output: 16 GB per 4 GB chunk of the 9B head's logits). The trainer needs only
the target column of each row, plus what its backward needs to rebuild any column. This kernel computes, per
row, torch's ``max`` and ``logsum = log(sum(exp(x - max)))`` in torch's own summation order, then
``lp[target] = (x[target] - max) - logsum`` -- torch's epilogue, so the value written is the one torch would
have written: two reads of the logits, no ``[T, V]`` output. The backward rebuilds any row's log-softmax from
the kept logits with the same epilogue (``lm_head_triton.head_grad``), so gradients keep their bits too.

The order is torch's (``kernels.log_softmax``: its description, ``replicates`` -- which logits it holds for --
and ``log_softmax_stats_reference``, the same order in plain PyTorch); each "thread" of torch's block is a lane of
a ``[32, 32]`` tile here. ``exp`` / ``log`` are libdevice's ``expf`` / ``logf``, what nvcc compiles ``std::exp`` /
``std::log`` to. Whether a given torch build still takes that path is not assumed: ``lm_head`` compares this
kernel with ``torch.log_softmax`` on a probe the first time it runs on a device and keeps torch's kernel
if any bit differs (``tests/gpu/test_bi_kernels_cuda.py`` compares them on many rows).

Runs under the Triton interpreter (``TRITON_INTERPRET=1``) on CPU tensors, against the reference with the
interpreter's ``exp`` (``tests/test_fused_triton_interp.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from titan_rl_ext.kernels.log_softmax import ILP, MIN_V, THREADS, WARP, replicates

# How nvcc built torch's kernel, as far as it matters here, is not read from anywhere: whether denormals are
# flushed (exp of a logit ~90 below the max is a denormal, or 0) and whether a multiply-add is contracted (the
# last multiply inside expf with the sum's add, once inlined; nvcc's default -fmad=true, Triton's
# enable_fp_fusion). The build variants, most likely first; the head's probe keeps the first that gives torch's
# bits (``lm_head._probe_variant``).
VARIANTS: tuple[dict[str, bool], ...] = (
    {"fp_fusion": True, "ftz": False}, {"fp_fusion": False, "ftz": False},
    {"fp_fusion": True, "ftz": True}, {"fp_fusion": False, "ftz": True},
)


@triton.jit
def _tree32(v, LEAD: tl.constexpr):
    """``v [LEAD, 32] -> [LEAD]``: a warp-shuffle-down sum per row (lane i += lane i + 16, + 8, ..., + 1)."""
    v = tl.sum(tl.reshape(v, (LEAD, 2, 16)), axis=1)
    v = tl.sum(tl.reshape(v, (LEAD, 2, 8)), axis=1)
    v = tl.sum(tl.reshape(v, (LEAD, 2, 4)), axis=1)
    v = tl.sum(tl.reshape(v, (LEAD, 2, 2)), axis=1)
    return tl.sum(v, axis=1)


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:  # CUDA's expf, what torch's kernel calls (tl.exp is ex2.approx-based: other bits)
        return libdevice.exp(x)
    return tl.exp(x)  # the interpreter (numpy's exp; it has no libdevice)


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.log(x)
    return tl.log(x)


@triton.jit
def _stats_kernel(x_ptr, tgt_ptr, lp_ptr, max_ptr, logsum_ptr, V, N_MAIN, stride_row,
                  HAS_TGT: tl.constexpr, N_TAIL: tl.constexpr, LIBDEVICE: tl.constexpr,
                  _THREADS: tl.constexpr, _ILP: tl.constexpr, _WARP: tl.constexpr):
    # _THREADS, _ILP, _WARP: torch's launch (``kernels.log_softmax``), parameters because a jitted function
    # reads no plain global
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride_row
    chunk = tl.arange(0, 4096)
    # pass 1: the row's max (exact in any order)
    mx = tl.full((4096,), float("-inf"), tl.float32)
    for off in range(0, V, 4096):
        mx = tl.maximum(mx, tl.load(base + off + chunk, mask=off + chunk < V, other=float("-inf")))
    m = tl.max(mx, axis=0)
    # pass 2: exp-sums per torch thread t = 32 * warp + lane, in torch's order
    t = tl.arange(0, _WARP)[:, None] * _WARP + tl.arange(0, _WARP)[None, :]  # [32, 32]
    acc = tl.zeros((_WARP, _WARP), tl.float32)
    for k in range(N_MAIN):
        # thread t's float4 of this round, one 16-byte load, split into its 4 columns j = 2p + q
        g = tl.load(base + ((k * _THREADS + t) * _ILP)[:, :, None] + tl.arange(0, _ILP)[None, None, :])
        even, odd = tl.split(tl.reshape(g, (_WARP, _WARP, 2, 2)))  # q = 0: j = 0, 2; q = 1: j = 1, 3
        x0, x2 = tl.split(even)
        x1, x3 = tl.split(odd)
        acc = acc + _exp(x0 - m, LIBDEVICE)
        acc = acc + _exp(x1 - m, LIBDEVICE)
        acc = acc + _exp(x2 - m, LIBDEVICE)
        acc = acc + _exp(x3 - m, LIBDEVICE)
    for j in tl.static_range(N_TAIL):  # the columns past the last full 4096: one per thread per round
        col = N_MAIN * _THREADS * _ILP + j * _THREADS + t
        acc = tl.where(col < V, acc + _exp(tl.load(base + col, mask=col < V, other=0.0) - m, LIBDEVICE), acc)
    total = _tree32(tl.reshape(_tree32(acc, _WARP), (1, _WARP)), 1)
    logsum = _log(tl.sum(total, axis=0), LIBDEVICE)
    tl.store(max_ptr + row, m)
    tl.store(logsum_ptr + row, logsum)
    if HAS_TGT:
        xt = tl.load(base + tl.load(tgt_ptr + row))
        tl.store(lp_ptr + row, (xt - m) - logsum)


def cuda_options(fp_fusion: bool, ftz: bool) -> dict[str, bool]:
    """The Triton compile options of a build variant."""
    return {"enable_fp_fusion": fp_fusion, "enable_reflect_ftz": ftz}


def log_softmax_stats(x_TV: torch.Tensor, targets_T: torch.Tensor | None = None, *, num_warps: int = 16,
                      fp_fusion: bool = True, ftz: bool = False
                      ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(lp [T] at targets or None, max [T], logsum [T])``, fp32, such that ``(x - max) - logsum`` is
    ``torch.log_softmax(x, -1)`` bit for bit (where ``replicates(x)``, else a ``ValueError``; and for the
    ``VARIANTS`` entry -- ``fp_fusion``, ``ftz`` -- that matches how torch was built). ``num_warps`` changes the
    speed only (the order is fixed by the kernel's index arithmetic; ``benchmarks/head_lse.py``)."""
    if not replicates(x_TV):
        raise ValueError(f"logits [T, V>={MIN_V}] fp32 with aligned unit-stride rows needed; got {x_TV.dtype} "
                         f"{tuple(x_TV.shape)} strides {x_TV.stride()}")
    T, V = x_TV.shape
    if targets_T is not None and targets_T.shape != (T,):
        raise ValueError(f"targets must be [T={T}]; got {tuple(targets_T.shape)}")
    mx = torch.empty(T, dtype=torch.float32, device=x_TV.device)
    logsum = torch.empty_like(mx)
    lp = torch.empty_like(mx) if targets_T is not None else None
    if T:
        last = V % (THREADS * ILP)
        tgt = targets_T.contiguous() if targets_T is not None else mx
        _stats_kernel[(T,)](x_TV, tgt, lp if lp is not None else mx, mx, logsum, V, (V - last) // (THREADS * ILP),
                            x_TV.stride(0), HAS_TGT=targets_T is not None, N_TAIL=triton.cdiv(last, THREADS),
                            LIBDEVICE=x_TV.is_cuda, _THREADS=THREADS, _ILP=ILP, _WARP=WARP, num_warps=num_warps,
                            **cuda_options(fp_fusion, ftz) if x_TV.is_cuda else {})
    return lp, mx, logsum
