"""Triton kernels for the per-row ops of the layers: RMSNorm (both Qwen flavours; the attention's q/k norms with
their rotary embedding), the GDN output's gated RMSNorm, l2norm, SwiGLU's ``silu(gate) * up`` and the attention's
output gate ``sigmoid(gate) * o``. Each replaces 5-10 torch kernels (casts, pow, mean,
rsqrt, muls) with one read and one write of the row: in a prefill those torch chains were a large share of
all kernel time (docs/gpu_runs.md §8b, "Where the time went, and the fused layer kernels"). References and dispatch: ``titan_rl_ext.kernels.rows``.

Batch invariance: a tile is ``ROWS x BLOCK_D`` with ``BLOCK_D`` the whole row (power of two), and
``ROWS`` and ``num_warps`` are chosen from D alone, so the reduction of a row is laid out the same way
whatever the number of rows is or where the row sits; a row's bits depend only on the row.

Runs under the Triton interpreter (``TRITON_INTERPRET=1``) on CPU tensors, which is how the CPU suite
checks it (``tests/test_rows_triton_interp.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

MAX_D = 16384  # one row per block; wider rows (none in the Qwen models) take the torch path


def row_tile(D: int) -> tuple[int, int, int]:
    """``(BLOCK_D, ROWS, num_warps)`` for rows of width D; depends on D only (batch invariance)."""
    block = triton.next_power_of_2(D)
    rows = max(1, min(16, 2048 // block))
    warps = 8 if block >= 4096 else 4
    return block, rows, warps


@triton.jit
def _rms_scaled(x, rstd, w, MODE: tl.constexpr, X_DTYPE: tl.constexpr):
    """Modes 0 and 1 of the norm (fp32 result, before the output's rounding), for rows ``x`` with their ``rstd``."""
    x_hat = x * rstd[:, None]
    if MODE == 1:
        return x_hat * (1.0 + w)[None, :]
    # torch: weight * x_hat.to(x.dtype), rounded to the promoted dtype
    return w[None, :] * x_hat.to(X_DTYPE).to(tl.float32)


@triton.jit(do_not_specialize=["R"])
def _norm_rows_kernel(
    x_ptr, w_ptr, z_ptr, y_ptr, cos_ptr, sin_ptr, res_ptr, sum_ptr,
    R, D, B, sxa, sxb, sza, szb, sra, srb, s_rot, inv_d, eps,
    BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
    MODE: tl.constexpr,  # 0 RMSNorm w*(x_hat in x dtype); 1 zero-centred RMSNorm x_hat*(1+w); 2 gated; 3 l2norm
    X_DTYPE: tl.constexpr,  # the input's dtype (x_hat is rounded to it in modes 0 and 2)
    MID_DTYPE: tl.constexpr,  # mode 2: dtype of weight * x_hat (torch's promotion of weight and x)
    ROT: tl.constexpr,  # modes 0/1: rotary embedding over the first ROT dims of the output (0: none)
    RES: tl.constexpr,  # modes 0/1: the row normalised is x + res, rounded to x's dtype and stored to sum_ptr
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    # row r of a [A, B, D] view (strides sa, sb, 1): a strided head view is read in place
    ra, rb = rows // B, rows % B
    x_row = x_ptr + (ra * sxa + rb * sxb)[:, None]
    x = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if RES:
        # the residual add (torch: x + res in x's dtype), its sum kept for the stream and normalised here
        r = tl.load(res_ptr + (ra * sra + rb * srb)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(X_DTYPE).to(tl.float32)
        tl.store(sum_ptr + rows[:, None] * D + cols[None, :], x.to(sum_ptr.dtype.element_ty), mask=mask)
    ss = tl.sum(x * x, axis=1)
    if MODE == 3:
        y = x * tl.math.rsqrt(ss + eps)[:, None]
    else:
        rstd = tl.math.rsqrt(ss * inv_d + eps)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        y = _rms_scaled(x, rstd, w, MODE, X_DTYPE)
        if MODE == 2:
            y = y.to(MID_DTYPE).to(tl.float32)
            z = tl.load(z_ptr + (ra * sza + rb * szb)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            y = y * (z * tl.sigmoid(z))
        if ROT > 0:
            # torch's rotate-half rotary on the rounded norm output (row a's token = a: rows are [T, heads, D]):
            # out = y * cos + rot(y) * sin, rot(y)[c] = -y[c + ROT/2] (c < ROT/2) or y[c - ROT/2] (c < ROT), each
            # product and the sum rounded to the output dtype. The partner column is normalised again from x.
            HALF: tl.constexpr = ROT // 2
            pcols = tl.where(cols < HALF, cols + HALF, tl.where(cols < ROT, cols - HALF, cols))
            xp = tl.load(x_row + pcols[None, :], mask=mask, other=0.0).to(tl.float32)
            wp = tl.load(w_ptr + pcols, mask=pcols < D, other=0.0).to(tl.float32)
            yr = y.to(y_ptr.dtype.element_ty).to(tl.float32)
            yp = _rms_scaled(xp, rstd, wp, MODE, X_DTYPE).to(y_ptr.dtype.element_ty).to(tl.float32)
            rmask = (rows < R)[:, None] & (cols < ROT)[None, :]
            cs = tl.load(cos_ptr + ra[:, None] * s_rot + cols[None, :], mask=rmask, other=0.0).to(tl.float32)
            sn = tl.load(sin_ptr + ra[:, None] * s_rot + cols[None, :], mask=rmask, other=0.0).to(tl.float32)
            sgn = tl.where(cols < HALF, -1.0, 1.0)[None, :]
            a = (yr * cs).to(y_ptr.dtype.element_ty).to(tl.float32)
            b = (sgn * yp * sn).to(y_ptr.dtype.element_ty).to(tl.float32)
            y = tl.where((cols < ROT)[None, :], a + b, yr)
    tl.store(y_ptr + rows[:, None] * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["R", "num_programs"])
def _norm_rows_bwd_kernel(
    x_ptr, w_ptr, z_ptr, dy_ptr, dx_ptr, dz_ptr, dw_part_ptr,
    R, D, B, sxa, sxb, sza, szb, inv_d, eps, num_programs,
    BLOCK_D: tl.constexpr, ROWS: tl.constexpr, MODE: tl.constexpr, X_DTYPE: tl.constexpr, MID_DTYPE: tl.constexpr,
):
    """Backward of ``_norm_rows_kernel`` (same MODE), x_hat recomputed per row. With ``x_hat = x r``:

        dx = r (g - x_hat sum(g x_hat) / D)      g = dL/dx_hat; l2norm (MODE 3): sum instead of mean
        dw = sum over rows of dy * x_hat (MODE 1) or dy' * x_hat in x's dtype (MODES 0, 2; dy' = dy * silu(z))
        dz = dy * (w x_hat) * silu'(z)           MODE 2

    The roundings of the forward (x_hat to x's dtype, w x_hat to MID) pass gradients straight through, as
    autograd does for a cast. A fixed number of programs loop over the row tiles, each keeping its share of dw
    in fp32 and writing it once; the caller sums the shares in order."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    if MODE != 3:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for tile in range(pid, tl.cdiv(R, ROWS), num_programs):
        rows = (tile * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        mask = (rows < R)[:, None] & cmask[None, :]
        ra, rb = rows // B, rows % B
        x = tl.load(x_ptr + (ra * sxa + rb * sxb)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        ss = tl.sum(x * x, axis=1)
        if MODE == 3:
            r = tl.math.rsqrt(ss + eps)
            y = x * r[:, None]
            dx = r[:, None] * (dy - y * tl.sum(dy * y, axis=1)[:, None])
        else:
            r = tl.math.rsqrt(ss * inv_d + eps)
            x_hat = x * r[:, None]
            if MODE == 1:
                g = dy * (1.0 + w)[None, :]
                dw += tl.sum(dy * x_hat, axis=0)
            else:
                x_r = x_hat.to(X_DTYPE).to(tl.float32)
                if MODE == 2:
                    z = tl.load(z_ptr + (ra * sza + rb * szb)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                    sz = tl.sigmoid(z)
                    y_mid = (w[None, :] * x_r).to(MID_DTYPE).to(tl.float32)
                    dz = dy * y_mid * (sz + z * sz * (1.0 - sz))
                    tl.store(dz_ptr + rows[:, None] * D + cols[None, :], dz.to(dz_ptr.dtype.element_ty), mask=mask)
                    dy = dy * (z * sz)
                g = dy * w[None, :]
                dw += tl.sum(dy * x_r, axis=0)
            dx = r[:, None] * (g - x_hat * (tl.sum(g * x_hat, axis=1) * inv_d)[:, None])
        tl.store(dx_ptr + rows[:, None] * D + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if MODE != 3:
        tl.store(dw_part_ptr + pid.to(tl.int64) * D + cols, dw, mask=cmask)


@triton.jit
def _act_mul_offsets(B, sg0, sg1, su0, su1, BLOCK: tl.constexpr):
    """This program's row (of ``[A, B, D]`` rows, two-level strided) and column block: offsets into gate and up,
    the row's offset in a contiguous output, the columns."""
    row = tl.program_id(0).to(tl.int64)
    a, b = row // B, row % B
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    return a * sg0 + b * sg1, a * su0 + b * su1, cols


@triton.jit(do_not_specialize=["B"])
def _act_mul_bwd_kernel(g_ptr, u_ptr, dy_ptr, dg_ptr, du_ptr, D, B, sg0, sg1, su0, su1,
                        BLOCK: tl.constexpr, SILU: tl.constexpr):
    """``dg = dy * u * act'(g)``, ``du = dy * act(g)`` (act(g) rounded to the input dtype, as the forward);
    act = silu (``SILU``) or sigmoid."""
    g_off, u_off, cols = _act_mul_offsets(B, sg0, sg1, su0, su1, BLOCK)
    out_off = tl.program_id(0).to(tl.int64) * D
    mask = cols < D
    g = tl.load(g_ptr + g_off + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + u_off + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + out_off + cols, mask=mask, other=0.0).to(tl.float32)
    sg = tl.sigmoid(g)
    if SILU:
        act = g * sg
        dact = sg + g * sg * (1.0 - sg)
    else:
        act = sg
        dact = sg * (1.0 - sg)
    s = act.to(du_ptr.dtype.element_ty).to(tl.float32)
    tl.store(dg_ptr + out_off + cols, (dy * u * dact).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + out_off + cols, (dy * s).to(du_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["B"])
def _act_mul_kernel(g_ptr, u_ptr, y_ptr, D, B, sg0, sg1, su0, su1, BLOCK: tl.constexpr, SILU: tl.constexpr):
    g_off, u_off, cols = _act_mul_offsets(B, sg0, sg1, su0, su1, BLOCK)
    mask = cols < D
    g = tl.load(g_ptr + g_off + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + u_off + cols, mask=mask, other=0.0).to(tl.float32)
    # torch: act(gate) rounded to the input dtype, then the product rounded again
    act = g * tl.sigmoid(g) if SILU else tl.sigmoid(g)
    s = act.to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + tl.program_id(0).to(tl.int64) * D + cols, (s * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["T"])
def _gdn_gates_kernel(a_ptr, b_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, T, H, stride_a, stride_b,
                      BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    mask = (t < T)[:, None] & (h < H)[None, :]
    a = tl.load(a_ptr + t[:, None] * stride_a + h[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + t[:, None] * stride_b + h[None, :], mask=mask, other=0.0).to(tl.float32)
    alog = tl.load(alog_ptr + h, mask=h < H, other=0.0).to(tl.float32)
    dtb = tl.load(dtb_ptr + h, mask=h < H, other=0.0).to(tl.float32)
    x = a + dtb[None, :]
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # torch's softplus (beta 1, threshold 20)
    g = -tl.exp(alog)[None, :] * softplus
    tl.store(g_ptr + t[:, None] * H + h[None, :], g, mask=mask)
    tl.store(beta_ptr + t[:, None] * H + h[None, :], tl.sigmoid(b).to(beta_ptr.dtype.element_ty), mask=mask)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _rows_2d(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[R, D]`` without a copy where its last dim is contiguous and the rows are evenly strided."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _rows_3d(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[A, B, D]`` with a unit last stride, a view where possible: the rows of a head view
    ``[T, H, D]`` cut out of a wider ``[T, C]`` buffer are not evenly strided, but are in two levels."""
    if x.dim() >= 3:
        x3 = x.reshape(-1, x.shape[-2], x.shape[-1])
    else:
        x3 = x.reshape(-1, 1, x.shape[-1])
    return x3 if x3.stride(-1) == 1 else x3.contiguous()


def rotary_problem(
    x: torch.Tensor, mode: int, cos: torch.Tensor, sin: torch.Tensor | None, out_dtype: torch.dtype
) -> str | None:
    """Why ``norm_rows`` cannot apply this rotary embedding (None: it can): it needs x ``[T, heads, D]`` in modes
    0/1 and cos/sin ``[T, R]`` (R even, at most D) in the output's dtype, with one layout and a unit last stride."""
    rot, D = cos.shape[-1], x.shape[-1]
    if (mode not in (0, 1) or sin is None or x.dim() != 3 or cos.shape != (x.shape[0], rot) or sin.shape != cos.shape
            or rot % 2 or rot > D or cos.dtype != out_dtype or sin.dtype != out_dtype or cos.stride(-1) != 1
            or sin.stride() != cos.stride()):
        return (f"rotary needs x [T, heads, D] (modes 0/1) and cos/sin [T, R<=D] (R even) in the output's dtype with "
                f"one layout; got x {tuple(x.shape)}, mode {mode}, cos {tuple(cos.shape)} {cos.dtype}, "
                f"sin {None if sin is None else (tuple(sin.shape), sin.dtype)}")
    return None


def norm_rows(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, mode: int,
    gate: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, mid_dtype: torch.dtype | None = None,
    cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, residual: torch.Tensor | None = None,
) -> Any:
    """One launch of ``_norm_rows_kernel`` over the rows of ``x`` (any leading dims; see MODE). Output is
    contiguous, shape of ``x``, dtype ``out_dtype`` (default ``x.dtype``); ``mid_dtype``: mode 2's rounding
    of ``weight * x_hat`` (default ``x.dtype``). ``cos``/``sin`` ``[T, R]`` (modes 0 and 1, ``x`` ``[T, heads, D]``,
    the output's dtype): the rotate-half rotary embedding of the first R dims, applied to the rounded output.
    ``residual`` (modes 0 and 1, x's shape and dtype): the rows normalised are ``x + residual`` rounded to x's
    dtype, and ``(sum, output)`` is returned -- the residual stream's add fused with the next norm."""
    D = x.shape[-1]
    if D > MAX_D:
        raise ValueError(f"row width {D} > {MAX_D}")
    if x.dtype not in _TL_DTYPES:
        raise TypeError(f"norm_rows takes fp32/bf16/fp16 rows, got {x.dtype}")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gate {tuple(gate.shape)} does not match x {tuple(x.shape)}")
    x3 = _rows_3d(x)
    A, B = x3.shape[0], x3.shape[1]
    R = A * B
    y = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    if R == 0 or D == 0:
        return (torch.empty_like(x), y) if residual is not None else y
    z3 = _rows_3d(gate) if gate is not None else x3
    w = weight if weight is not None else x3  # unused in mode 3
    if weight is not None and (weight.shape != (D,) or not weight.is_contiguous()):
        raise ValueError(f"weight must be a contiguous [{D}] vector, got {tuple(weight.shape)}")
    rot = 0
    if cos is not None:
        if (problem := rotary_problem(x, mode, cos, sin, y.dtype)) is not None:
            raise ValueError(problem)
        rot = cos.shape[-1]
    if residual is not None and (mode not in (0, 1) or residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x {tuple(x.shape)} {x.dtype} (modes 0/1); got "
                         f"{tuple(residual.shape)} {residual.dtype}, mode {mode}")
    r3 = _rows_3d(residual) if residual is not None else x3
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else y
    block, rows, warps = row_tile(D)
    _norm_rows_kernel[(triton.cdiv(R, rows),)](
        x3, w, z3, y, cos if rot else w, sin if rot else w, r3, total,
        R, D, B, x3.stride(0), x3.stride(1), z3.stride(0), z3.stride(1), r3.stride(0), r3.stride(1),
        cos.stride(0) if rot else 0, 1.0 / D, eps,
        BLOCK_D=block, ROWS=rows, MODE=mode, X_DTYPE=_TL_DTYPES[x.dtype],
        MID_DTYPE=_TL_DTYPES[mid_dtype or x.dtype], ROT=rot, RES=residual is not None, num_warps=warps,
    )
    return (total, y) if residual is not None else y


def norm_rows_backward(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, mode: int, dy: torch.Tensor,
    gate: torch.Tensor | None = None, mid_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dw, dz)`` of ``norm_rows`` (dx in x's dtype and shape, dw in the weight's dtype or None in mode 3,
    dz in the gate's dtype in mode 2 else None), one launch plus the sum of the per-program dw shares."""
    D = x.shape[-1]
    x3 = _rows_3d(x)
    A, B = x3.shape[0], x3.shape[1]
    R = A * B
    dy2 = dy.reshape(R, D).contiguous()
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dz = torch.empty(gate.shape, dtype=gate.dtype, device=x.device) if mode == 2 and gate is not None else None
    block, rows, warps = row_tile(D)
    n_prog = max(1, min(triton.cdiv(R, rows), 4 * _sm_count(x.device)))
    dw_part = torch.zeros(n_prog, D, dtype=torch.float32, device=x.device) if mode != 3 else None
    if R and D:
        z3 = _rows_3d(gate) if gate is not None else x3
        _norm_rows_bwd_kernel[(n_prog,)](
            x3, weight if weight is not None else x3, z3, dy2, dx, dz if dz is not None else dx,
            dw_part if dw_part is not None else dx,
            R, D, B, x3.stride(0), x3.stride(1), z3.stride(0), z3.stride(1), 1.0 / D, eps, n_prog,
            BLOCK_D=block, ROWS=rows, MODE=mode, X_DTYPE=_TL_DTYPES[x.dtype],
            MID_DTYPE=_TL_DTYPES[mid_dtype or x.dtype], num_warps=warps,
        )
    dw = None if dw_part is None or weight is None else dw_part.sum(0).to(weight.dtype)
    return dx, dw, dz


def _act_mul_args(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ")
    g3, u3 = _rows_3d(gate), _rows_3d(up)
    return g3, u3, g3.shape[0] * g3.shape[1], g3.shape[1], gate.shape[-1]


def _act_mul(gate: torch.Tensor, up: torch.Tensor, silu: bool) -> torch.Tensor:
    g3, u3, R, B, D = _act_mul_args(gate, up)
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if R == 0 or D == 0:
        return y
    block = min(4096, triton.next_power_of_2(D))
    _act_mul_kernel[(R, triton.cdiv(D, block))](g3, u3, y, D, B, g3.stride(0), g3.stride(1), u3.stride(0), u3.stride(1),
                                                 BLOCK=block, SILU=silu, num_warps=4)
    return y


def _act_mul_backward(gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor, silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g3, u3, R, B, D = _act_mul_args(gate, up)
    dy2 = dy.reshape(R, D).contiguous()
    dg = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    du = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    if R and D:
        block = min(4096, triton.next_power_of_2(D))
        _act_mul_bwd_kernel[(R, triton.cdiv(D, block))](g3, u3, dy2, dg, du, D, B, g3.stride(0), g3.stride(1),
                                                         u3.stride(0), u3.stride(1), BLOCK=block, SILU=silu, num_warps=4)
    return dg, du


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` over rows (row-strided views, e.g. the halves of a merged GEMM's output)."""
    return _act_mul(gate, up, True)


def silu_mul_backward(gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d gate, d up)`` of ``silu_mul``, one launch (contiguous, the inputs' dtype)."""
    return _act_mul_backward(gate, up, dy, True)


def sigmoid_mul(gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``sigmoid(gate) * x`` over rows; ``gate`` may be a head view cut out of a wider buffer (two-level strides:
    the attention's output gate, read where the projection wrote it)."""
    return _act_mul(gate, x, False)


def sigmoid_mul_backward(gate: torch.Tensor, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d gate, d x)`` of ``sigmoid_mul``, one launch."""
    return _act_mul_backward(gate, x, dy, False)


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2


def gdn_gates(a_TH: torch.Tensor, b_TH: torch.Tensor, A_log_H: torch.Tensor, dt_bias_H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GDN decay and write strength in one launch: ``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32) and
    ``beta = sigmoid(b)`` (b's dtype); ``a``/``b`` may be column slices of the merged projection."""
    T, H = a_TH.shape
    if b_TH.shape != (T, H) or A_log_H.shape != (H,) or dt_bias_H.shape != (H,):
        raise ValueError(f"gdn_gates: a {tuple(a_TH.shape)}, b {tuple(b_TH.shape)}, A_log {tuple(A_log_H.shape)}, "
                         f"dt_bias {tuple(dt_bias_H.shape)}")
    a2 = a_TH if a_TH.stride(-1) == 1 else a_TH.contiguous()
    b2 = b_TH if b_TH.stride(-1) == 1 else b_TH.contiguous()
    g = torch.empty(T, H, dtype=torch.float32, device=a_TH.device)
    beta = torch.empty(T, H, dtype=b_TH.dtype, device=a_TH.device)
    if T == 0:
        return g, beta
    block_h = triton.next_power_of_2(H)
    block_t = max(1, 1024 // block_h)
    _gdn_gates_kernel[(triton.cdiv(T, block_t),)](
        a2, b2, A_log_H.contiguous(), dt_bias_H.contiguous(), g, beta, T, H, a2.stride(0), b2.stride(0),
        BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4,
    )
    return g, beta
