"""Triton batch-invariant (BI) kernels for CUDA: a GEMM and the RMSNorm / l2norm row reductions.

Batch invariance needs every output element to be reduced in one order whatever the other rows are.
Stock GPU GEMMs break it because their library picks tiles, and often split-K, from M. Here:

- ``bi_matmul``: one K step (``BLOCK_K``) per input dtype, never chosen by M, no split-K. Each output
  tile is computed by one program that walks K in ``BLOCK_K`` steps in ascending order with an fp32
  accumulator, so the bits of ``c[m, n]`` depend only on ``a[m, :]``, ``b[:, n]``, K and the dtype. The
  output tile (``BLOCK_M x BLOCK_N``) is smaller for decode-sized M; that changes which program computes
  an output, not how (measured bit-equal on the GPU: ``_SMALL_M_CONFIGS``).
  The grid is persistent (a fixed number of programs loop over the tiles); which program computes a
  tile changes with M, how it is computed does not. ``M`` is excluded from Triton's integer
  specialisation (``do_not_specialize``) so M == 1 or M % 16 == 0 compiles the same kernel.
- ``row_sum_sq`` / ``row_mean_sq``: one program per row, a fixed ``BLOCK_D`` strip looping over D,
  fp32 lane accumulators then one tree reduction. The order depends on D alone.

Both are wrapped in autograd functions. Batch invariance is promised for forward values only: the
GEMM's backward (dgrad, wgrad) runs on cuBLAS, the reductions' backward on elementwise torch ops.

Works under the Triton interpreter (``TRITON_INTERPRET=1`` set before this module is imported) on
CPU tensors, which is how the CPU test suite checks it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# fp32 inputs: full-precision FMA dot (matches torch's default, TF32 off). "tf32" is faster and just as
# batch invariant, but changes the bits; every process of a run must use the same setting.
FP32_INPUT_PRECISION = "ieee"

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) per input dtype. Fixed: never tuned by M.
_MM_CONFIGS: dict[torch.dtype, tuple[int, int, int, int, int, int]] = {
    torch.bfloat16: (128, 128, 64, 8, 8, 3),
    torch.float16: (128, 128, 64, 8, 8, 3),
    torch.float32: (128, 128, 32, 8, 8, 3),
}
# Decode-sized M: smaller output tiles, more of them (one 128x128 tile per program leaves most SMs idle when M
# is 1 and N is 4096). Tiles in M and N decide which program computes an output, not how: every configuration
# keeps BLOCK_K = 64 and the ascending K walk, and on the H200 all ten measured give the default's bits on
# every Qwen3.5-9B projection and the LM head at M = 1, 8, 64, 256 (tests/gpu/bi_gemm_tiles.py,
# benchmarks/results/bi_gemm_tiles.json); tests/gpu/test_batch_invariant_cuda.py sweeps M across these bounds.
# (largest M, config), first match wins; larger M takes _MM_CONFIGS.
_SMALL_M_CONFIGS: dict[torch.dtype, tuple[tuple[int, tuple[int, int, int, int, int, int]], ...]] = {
    torch.bfloat16: ((16, (16, 128, 64, 8, 4, 4)), (64, (64, 128, 64, 8, 4, 4))),
    torch.float16: ((16, (16, 128, 64, 8, 4, 4)), (64, (64, 128, 64, 8, 4, 4))),
}
ROW_BLOCK_D_MAX = 1024


def mm_config(M: int, dtype: torch.dtype) -> tuple[int, int, int, int, int, int]:
    """The tile configuration ``bi_matmul`` uses for M rows of ``dtype`` (see ``_SMALL_M_CONFIGS``)."""
    for max_m, cfg in _SMALL_M_CONFIGS.get(dtype, ()):
        if M <= max_m:
            return cfg
    return _MM_CONFIGS[dtype]
_INTERPRET_PROGRAMS = 4  # persistent grid size under the interpreter (CPU tensors)


@triton.jit(do_not_specialize=["M"])
def _bi_mm_kernel(
    a_ptr, b_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    num_k = tl.cdiv(K, BLOCK_K)
    tiles_per_group = GROUP_M * num_pid_n
    for tile in range(pid, num_tiles, NUM_PROGRAMS):
        # grouped ordering for L2 reuse: only decides which program computes a tile, not how
        group = tile // tiles_per_group
        first_m = group * GROUP_M
        group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % tiles_per_group) % group_m
        pid_n = (tile % tiles_per_group) // group_m
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        rows = offs_m.to(tl.int64)
        cols = offs_n.to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, num_k):
            offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            a = tl.load(
                a_ptr + rows[:, None] * stride_am + offs_k[None, :] * stride_ak,
                mask=mask_m[:, None] & mask_k[None, :], other=0.0,
            )
            # b may be narrower than a (a bf16 LM head under fp32 activations): widened per tile, which is
            # exact, so the bits equal those of a full-width copy of b, without writing that copy
            b = tl.load(
                b_ptr + offs_k[:, None] * stride_bk + cols[None, :] * stride_bn,
                mask=mask_k[:, None] & mask_n[None, :], other=0.0,
            ).to(a_ptr.dtype.element_ty)
            if UPCAST:
                # interpreter only (CPU tensors): its numpy dot mishandles bf16, and numpy's BLAS does not
                # round a row the same at every position in a tile (OpenBLAS' AVX2 kernels); a float64 dot
                # rounded once per K block to the fp32 accumulator is exact for bf16/fp16 products and
                # position-independent for fp32 ones, so the checks see the kernel's tiling, not the BLAS
                acc += tl.dot(a.to(tl.float64), b.to(tl.float64)).to(tl.float32)
            else:
                acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        tl.store(
            c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn,
            acc.to(c_ptr.dtype.element_ty),
            mask=mask_m[:, None] & mask_n[None, :],
        )


@functools.lru_cache(maxsize=None)
def _num_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _INTERPRET_PROGRAMS


def bi_matmul(
    a_MK: torch.Tensor, b_KN: torch.Tensor, out_dtype: torch.dtype | None = None,
    config: tuple[int, int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """``a @ b`` (bf16/fp16/fp32; fp32 accumulation; output in the promoted dtype), batch invariant in M.
    ``b`` may have any strides (a transposed weight is read in place); ``a`` is made contiguous. Mixed
    dtypes compute in the promoted one, bit for bit as if both were cast first; a narrower ``b`` (the
    bf16 LM head of an fp32 head) is widened tile by tile instead of copied (4 GB at a 248k vocabulary).
    ``out_dtype=torch.float32`` with bf16/fp16 operands stores the fp32 accumulator itself (the fp32 LM
    head over bf16 hidden states and weights: tensor-core products, which are exact, and fp32 sums).
    ``config`` overrides the dtype's tile configuration (``tests/gpu/bi_gemm_tiles.py`` measures which
    configurations give the default's bits)."""
    if a_MK.dim() != 2 or b_KN.dim() != 2 or a_MK.shape[1] != b_KN.shape[0]:
        raise ValueError(f"bi_matmul expects [M, K] @ [K, N]; got {tuple(a_MK.shape)} @ {tuple(b_KN.shape)}")
    if a_MK.device != b_KN.device:
        raise ValueError(f"operands on different devices: {a_MK.device} and {b_KN.device}")
    dtype = torch.promote_types(a_MK.dtype, b_KN.dtype)
    if dtype not in _MM_CONFIGS:
        raise TypeError(f"bi_matmul supports {sorted(map(str, _MM_CONFIGS))}; got {a_MK.dtype} and {b_KN.dtype}")
    if out_dtype not in (None, dtype, torch.float32):
        raise TypeError(f"bi_matmul writes {dtype} or float32; got out_dtype={out_dtype}")
    a = a_MK.to(dtype).contiguous()
    b = b_KN  # never wider than dtype; a narrower one is widened inside the kernel
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty(M, N, dtype=out_dtype or dtype, device=a.device)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_()
    BM, BN, BK, GM, warps, stages = config or mm_config(M, dtype)
    n_prog = _num_programs(a.device)
    n_tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    _bi_mm_kernel[(min(n_prog, n_tiles),)](
        a, b, c, M, N, K,
        K, 1,  # a is contiguous: row stride K (a size-1 dim may report any stride)
        b.stride(0), b.stride(1), N, 1,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=GM, NUM_PROGRAMS=n_prog,
        INPUT_PRECISION=FP32_INPUT_PRECISION if dtype == torch.float32 else "tf32",
        UPCAST=a.device.type != "cuda",
        num_warps=warps, num_stages=stages,
    )
    return c


class _BIMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(a, b)
        return bi_matmul(a, b)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        # Gradients need not be batch invariant (only the forward logprob must match the generator's):
        # dgrad and wgrad run on the vendor GEMM. Under the interpreter (CPU tensors) torch's CPU GEMM.
        a, b = ctx.saved_tensors
        ga = gb = None
        if ctx.needs_input_grad[0]:
            ga = torch.mm(g, b.t().to(g.dtype)).to(a.dtype)
        if ctx.needs_input_grad[1]:
            gb = torch.mm(a.to(g.dtype).t(), g).to(b.dtype)
        return ga, gb


def bi_mm(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    """Differentiable ``bi_matmul``."""
    if torch.is_grad_enabled() and (a_MK.requires_grad or b_KN.requires_grad):
        return _BIMatmul.apply(a_MK, b_KN)
    return bi_matmul(a_MK, b_KN)


# ---------------------------------------------------------------------------------------------------
# row reductions


@triton.jit(do_not_specialize=["R"])
def _row_sum_sq_kernel(x_ptr, out_ptr, R, D, scale, BLOCK_D: tl.constexpr, MEAN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(base + offs, mask=offs < D, other=0.0).to(tl.float32)
        acc += x * x
    s = tl.sum(acc, axis=0)
    if MEAN:
        s = s * scale
    tl.store(out_ptr + row, s)


def _row_sq(x: torch.Tensor, mean: bool) -> torch.Tensor:
    if x.dim() == 0:
        raise ValueError("row reductions need at least one dim")
    D = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, D).contiguous()
    R = x2.shape[0]
    out = torch.empty(R, dtype=torch.float32, device=x.device)
    if R == 0:
        return out.reshape(lead)
    if D == 0:
        return out.fill_(float("nan") if mean else 0.0).reshape(lead)
    block = min(ROW_BLOCK_D_MAX, triton.next_power_of_2(D))
    _row_sum_sq_kernel[(R,)](x2, out, R, D, 1.0 / D, BLOCK_D=block, MEAN=mean, num_warps=4)
    return out.reshape(lead)


class _RowSq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mean):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x)
        ctx.mean = mean
        return _row_sq(x, mean)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        (x,) = ctx.saved_tensors
        factor = 2.0 / x.shape[-1] if ctx.mean else 2.0
        return (x.float() * (g * factor).unsqueeze(-1)).to(x.dtype), None


def row_sum_sq(x: torch.Tensor) -> torch.Tensor:
    """``sum(x.float()**2, -1)`` in fp32, shape ``x.shape[:-1]``; batch invariant over the rows."""
    return _RowSq.apply(x, False)


def row_mean_sq(x: torch.Tensor) -> torch.Tensor:
    """``mean(x.float()**2, -1)`` in fp32, shape ``x.shape[:-1]``; batch invariant over the rows."""
    return _RowSq.apply(x, True)
