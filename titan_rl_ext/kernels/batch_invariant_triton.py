"""Triton batch-invariant (BI) kernels for CUDA: a GEMM and the RMSNorm / l2norm row reductions.

Batch invariance needs every output element to be reduced in one order whatever the other rows are.
Stock GPU GEMMs break it because their library picks tiles, and often split-K, from M. Here:

- ``bi_matmul``: one K step (``BLOCK_K``) per input dtype, never chosen by M, no split-K. Each output
  tile is computed by one program that walks K in ``BLOCK_K`` steps in ascending order with an fp32
  accumulator, so the bits of ``c[m, n]`` depend only on ``a[m, :]``, ``b[:, n]``, K and the dtype. The
  output tile (``BLOCK_M x BLOCK_N``) is smaller for decode-sized M; that changes which program computes
  an output, not how (measured bit-equal on the GPU: ``_SMALL_M_CONFIGS``).
  The grid is persistent (a fixed number of programs loop over the tiles) or one program per tile, and
  the operands come through pointers or TMA descriptors (``MMConfig``); which program computes a tile,
  and how its operands reach shared memory, change nothing in how it is computed. ``M`` is excluded from
  Triton's integer specialisation (``do_not_specialize``) so M == 1 or M % 16 == 0 compiles the same kernel.
- ``row_sum_sq`` / ``row_mean_sq``: one program per row, a fixed ``BLOCK_D`` strip looping over D,
  fp32 lane accumulators then one tree reduction. The order depends on D alone.

Both are wrapped in autograd functions. Batch invariance is promised for forward values only: the
GEMM's backward (dgrad, wgrad) runs on cuBLAS, the reductions' backward on elementwise torch ops.

Works under the Triton interpreter (``TRITON_INTERPRET=1`` set before this module is imported) on
CPU tensors, which is how the CPU test suite checks it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from titan_rl_ext.kernels.gpu_tables import table_entry

# fp32 inputs: full-precision FMA dot (matches torch's default, TF32 off). "tf32" is faster and just as
# batch invariant, but changes the bits; every process of a run must use the same setting.
FP32_INPUT_PRECISION = "ieee"


@dataclass(frozen=True)
class MMConfig:
    """How ``bi_matmul`` tiles one launch. A row's bits depend on how its K reduction runs (``BLOCK_K`` steps in
    ascending order into one fp32 accumulator), not on which program computes its tile: every configuration
    ``tests/gpu/bi_gemm_tiles.py`` checks on the GPU gives the default's bits, which is what lets the
    tile follow M. ``persistent``: a fixed number of programs (one per SM) loop over the tiles; otherwise one
    program per tile. ``tma``: operands arrive through TMA descriptors (Hopper and later; the weight must be a
    row-major ``[N, K]`` with 16-byte aligned rows, else the pointer kernel runs)."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int = 8
    num_warps: int = 8
    num_stages: int = 3
    persistent: bool = True
    tma: bool = False


_MM_CONFIGS: dict[torch.dtype, MMConfig] = {
    torch.bfloat16: MMConfig(128, 128, 64),
    torch.float16: MMConfig(128, 128, 64),
    torch.float32: MMConfig(128, 128, 32),
}
# Decode-sized M: smaller output tiles, more of them (one 128x128 tile per program leaves most SMs idle when M
# is 1 and N is 4096). Every configuration ``tests/gpu/bi_gemm_tiles.py`` checks gives the default's bits on
# every Qwen3.5-9B projection and the LM head (the runs: docs/gpu_runs.md §8b, "BI GEMM tiles");
# tests/gpu/test_batch_invariant_cuda.py sweeps M across these bounds.
# (largest M, config), first match wins; larger M takes _MM_CONFIGS.
_SMALL_M_CONFIGS: dict[torch.dtype, tuple[tuple[int, MMConfig], ...]] = {
    torch.bfloat16: ((16, MMConfig(16, 128, 64, 8, 4, 4)), (64, MMConfig(64, 128, 64, 8, 4, 4))),
    torch.float16: ((16, MMConfig(16, 128, 64, 8, 4, 4)), (64, MMConfig(64, 128, 64, 8, 4, 4))),
}
ROW_BLOCK_D_MAX = 1024


# Per-GPU bf16 tables measured by ``tests/gpu/bi_gemm_tiles.py --table-out``: ``{gpu name: [{"max_m": int,
# "max_n": int (optional), "config": MMConfig fields}, ...]}``, the first row with M <= max_m (and N <= max_n where
# given) wins, the last one unbounded. A row with ``max_n`` serves the narrow projections of a bucket (N = 4096 at
# M = 65-256: 64-wide tiles keep 2-4x more SMs streaming the weight than the 128x256 tile the wide ones and the LM
# head want). Only configurations that gave the default's bits on every shape at every M on that GPU enter a table,
# so a table changes speed, not bits. A GPU
# without an entry takes the entry of a GPU cut from the same die (an H100 the H200's: the same machine code,
# so the same bits), else the defaults above.
TABLES_FILE = Path(__file__).with_name("bi_gemm_tables.json")


_UNBOUNDED = 1 << 62


@functools.lru_cache(maxsize=None)
def device_table(gpu_name: str) -> tuple[tuple[int, int, MMConfig], ...]:
    """The measured bf16 table that serves ``gpu_name`` as ``(max_m, max_n, config)`` rows: its own, else one
    measured on a GPU of the same die (``kernels.gpu_tables``); empty when there is neither."""
    if not TABLES_FILE.exists():
        return ()
    found = table_entry(json.loads(TABLES_FILE.read_text()), gpu_name)
    entry = found[1] if found else []
    return tuple((int(row["max_m"]), int(row.get("max_n", _UNBOUNDED)), MMConfig(**row["config"])) for row in entry)


@functools.lru_cache(maxsize=None)
def _gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else ""


def mm_config(M: int, dtype: torch.dtype, device: torch.device | None = None, N: int | None = None) -> MMConfig:
    """The tile configuration ``bi_matmul`` uses for M rows (N output columns, where known) of ``dtype`` on
    ``device``: the GPU's measured table for bf16 where there is one (``TABLES_FILE``), else ``_SMALL_M_CONFIGS`` /
    ``_MM_CONFIGS``."""
    if dtype == torch.bfloat16 and device is not None:
        for max_m, max_n, cfg in device_table(_gpu_name(device)):
            if M <= max_m and (N is None and max_n == _UNBOUNDED or N is not None and N <= max_n):
                return cfg
    for max_m, cfg in _SMALL_M_CONFIGS.get(dtype, ()):
        if M <= max_m:
            return cfg
    return _MM_CONFIGS[dtype]


_INTERPRET_PROGRAMS = 4  # persistent grid size under the interpreter (CPU tensors)


@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # grouped ordering for L2 reuse: only decides which program computes a tile, not how
    tiles_per_group = GROUP_M * num_pid_n
    group = tile // tiles_per_group
    first_m = group * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % tiles_per_group) % group_m, (tile % tiles_per_group) // group_m


@triton.jit
def _acc_dot(acc, a, b, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        # interpreter only (CPU tensors): its numpy dot mishandles bf16, and numpy's BLAS does not round a row
        # the same at every position in a tile (OpenBLAS' AVX2 kernels); a float64 dot rounded once per K block
        # to the fp32 accumulator is exact for bf16/fp16 products and position-independent for fp32 ones, so
        # the checks see the kernel's tiling, not the BLAS
        return acc + tl.dot(a.to(tl.float64), b.to(tl.float64)).to(tl.float32)
    return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)


@triton.jit(do_not_specialize=["M", "num_programs"])
def _bi_mm_kernel(
    a_ptr, b_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, num_programs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    for tile in range(pid, num_pid_m * num_pid_n, num_programs):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
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
            acc = _acc_dot(acc, a, b, INPUT_PRECISION, UPCAST)
        tl.store(
            c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn,
            acc.to(c_ptr.dtype.element_ty),
            mask=mask_m[:, None] & mask_n[None, :],
        )


@triton.jit(do_not_specialize=["M", "num_programs"])
def _bi_mm_tma_kernel(
    a_desc, w_desc, c_ptr,
    M, N, K, stride_cm, num_programs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    A_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    """``_bi_mm_kernel`` with both operands through TMA descriptors (out-of-bounds boxes read zeros, so K and
    N tails need no masks): ``a [M, K]`` and the weight ``w [N, K]`` row-major, ``c = a @ w^T``."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_k = tl.cdiv(K, BLOCK_K)
    for tile in range(pid, num_pid_m * num_pid_n, num_programs):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, num_k):
            a = a_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])
            w = w_desc.load([pid_n * BLOCK_N, kb * BLOCK_K]).to(A_DTYPE)
            acc = _acc_dot(acc, a, w.T, INPUT_PRECISION, UPCAST)
        rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=(rows < M)[:, None] & (cols < N)[None, :])


@functools.lru_cache(maxsize=None)
def _num_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _INTERPRET_PROGRAMS


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _tma_weight(b_KN: torch.Tensor) -> torch.Tensor | None:
    """``b``'s row-major ``[N, K]`` view when TMA can read it (unit K stride, 16-byte aligned rows and base)."""
    w = b_KN.t()
    if w.stride(1) != 1 or (w.stride(0) * w.element_size()) % 16 or w.data_ptr() % 16:
        return None
    return w


def bi_matmul(
    a_MK: torch.Tensor, b_KN: torch.Tensor, out_dtype: torch.dtype | None = None,
    config: MMConfig | None = None,
) -> torch.Tensor:
    """``a @ b`` (bf16/fp16/fp32; fp32 accumulation; output in the promoted dtype), batch invariant in M.
    ``b`` may have any strides (a transposed weight is read in place); ``a`` is made contiguous. Mixed
    dtypes compute in the promoted one, bit for bit as if both were cast first; a narrower ``b`` (the
    bf16 LM head of an fp32 head) is widened tile by tile instead of copied (4 GB at a 248k vocabulary).
    ``out_dtype=torch.float32`` with bf16/fp16 operands stores the fp32 accumulator itself (the fp32 LM
    head over bf16 hidden states and weights: tensor-core products, which are exact, and fp32 sums).
    ``config`` overrides the tile configuration ``mm_config`` picks (``tests/gpu/bi_gemm_tiles.py`` measures
    which configurations give the default's bits)."""
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
    cfg = config or mm_config(M, dtype, a.device, N)
    BM, BN, BK = cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K
    n_tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    n_prog = min(_num_programs(a.device), n_tiles) if cfg.persistent else n_tiles
    common = dict(
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=cfg.GROUP_M,
        INPUT_PRECISION=FP32_INPUT_PRECISION if dtype == torch.float32 else "tf32",
        UPCAST=a.device.type != "cuda", num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    w = _tma_weight(b) if cfg.tma and (K * a.element_size()) % 16 == 0 and a.data_ptr() % 16 == 0 else None
    if w is not None:
        from triton.tools.tensor_descriptor import TensorDescriptor

        _bi_mm_tma_kernel[(n_prog,)](
            TensorDescriptor.from_tensor(a, [BM, BK]), TensorDescriptor.from_tensor(w, [BN, BK]), c,
            M, N, K, N, n_prog, A_DTYPE=_TL_DTYPES[dtype], **common,
        )
        return c
    _bi_mm_kernel[(n_prog,)](
        a, b, c, M, N, K,
        K, 1,  # a is contiguous: row stride K (a size-1 dim may report any stride)
        b.stride(0), b.stride(1), N, 1, n_prog, **common,
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
            gb = _grad_in_layout_of(b, a.to(g.dtype), g).to(b.dtype)  # .to keeps the strides
        return ga, gb


def _grad_in_layout_of(b_KN: torch.Tensor, a_MK: torch.Tensor, g_MN: torch.Tensor) -> torch.Tensor:
    """``a.t() @ g``, the gradient of ``b``, laid out like ``b``. The linear layers pass ``weight.t()``
    (column-major): a row-major gradient would reach the weight as a transposed view, and autograd stores a
    ``.grad`` in its parameter's layout, so it would copy it -- a transposing copy of every weight per step
    (docs/decisions.md). ``(g.t() @ a).t()`` is the same product, written
    in the weight's own layout by the GEMM itself."""
    if b_KN.stride(0) == 1 and b_KN.stride(1) != 1:
        return torch.mm(g_MN.t(), a_MK).t()
    return torch.mm(a_MK.t(), g_MN)


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
