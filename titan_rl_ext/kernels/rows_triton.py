"""Triton kernels for the per-row ops of the layers: RMSNorm (both Qwen flavours), the GDN output's gated
RMSNorm, l2norm, and SwiGLU's ``silu(gate) * up``. Each replaces 5-10 torch kernels (casts, pow, mean,
rsqrt, muls) with one read and one write of the row: in a 16x2048 prefill of the 4-layer Qwen3.5-9B slice
those torch chains were ~40 % of all kernel time. References and dispatch: ``titan_rl_ext.kernels.rows``.

Batch invariance: a tile is ``ROWS x BLOCK_D`` with ``BLOCK_D`` the whole row (power of two), and
``ROWS`` and ``num_warps`` are chosen from D alone, so the reduction of a row is laid out the same way
whatever the number of rows is or where the row sits; a row's bits depend only on the row.

Runs under the Triton interpreter (``TRITON_INTERPRET=1``) on CPU tensors, which is how the CPU suite
checks it (``tests/test_rows_triton_interp.py``).
"""

from __future__ import annotations

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


@triton.jit(do_not_specialize=["R"])
def _norm_rows_kernel(
    x_ptr, w_ptr, z_ptr, y_ptr,
    R, D, B, sxa, sxb, sza, szb, inv_d, eps,
    BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
    MODE: tl.constexpr,  # 0 RMSNorm w*(x_hat in x dtype); 1 zero-centred RMSNorm x_hat*(1+w); 2 gated; 3 l2norm
    X_DTYPE: tl.constexpr,  # the input's dtype (x_hat is rounded to it in modes 0 and 2)
    MID_DTYPE: tl.constexpr,  # mode 2: dtype of weight * x_hat (torch's promotion of weight and x)
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    # row r of a [A, B, D] view (strides sa, sb, 1): a strided head view is read in place
    ra, rb = rows // B, rows % B
    x = tl.load(x_ptr + (ra * sxa + rb * sxb)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    ss = tl.sum(x * x, axis=1)
    if MODE == 3:
        y = x * tl.math.rsqrt(ss + eps)[:, None]
    else:
        x_hat = x * tl.math.rsqrt(ss * inv_d + eps)[:, None]
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        if MODE == 1:
            y = x_hat * (1.0 + w)[None, :]
        else:
            # torch: weight * x_hat.to(x.dtype), rounded to the promoted dtype
            y = w[None, :] * x_hat.to(X_DTYPE).to(tl.float32)
            if MODE == 2:
                y = y.to(MID_DTYPE).to(tl.float32)
                z = tl.load(z_ptr + (ra * sza + rb * szb)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                y = y * (z * tl.sigmoid(z))
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


@triton.jit(do_not_specialize=["R"])
def _silu_mul_bwd_kernel(g_ptr, u_ptr, dy_ptr, dg_ptr, du_ptr, R, D, stride_g, stride_u, BLOCK: tl.constexpr):
    """``dg = dy * u * silu'(g)``, ``du = dy * silu(g)`` (silu(g) rounded to the input dtype, as the forward)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    sg = tl.sigmoid(g)
    s = (g * sg).to(du_ptr.dtype.element_ty).to(tl.float32)
    tl.store(dg_ptr + row * D + cols, (dy * u * (sg + g * sg * (1.0 - sg))).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + row * D + cols, (dy * s).to(du_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["R"])
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, R, D, stride_g, stride_u, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    # torch: silu(gate) rounded to the input dtype, then the product rounded again
    s = (g * tl.sigmoid(g)).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * D + cols, (s * u).to(y_ptr.dtype.element_ty), mask=mask)


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


def norm_rows(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, mode: int,
    gate: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, mid_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One launch of ``_norm_rows_kernel`` over the rows of ``x`` (any leading dims; see MODE). Output is
    contiguous, shape of ``x``, dtype ``out_dtype`` (default ``x.dtype``); ``mid_dtype``: mode 2's rounding
    of ``weight * x_hat`` (default ``x.dtype``)."""
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
        return y
    z3 = _rows_3d(gate) if gate is not None else x3
    w = weight if weight is not None else x3  # unused in mode 3
    if weight is not None and (weight.shape != (D,) or not weight.is_contiguous()):
        raise ValueError(f"weight must be a contiguous [{D}] vector, got {tuple(weight.shape)}")
    block, rows, warps = row_tile(D)
    _norm_rows_kernel[(triton.cdiv(R, rows),)](
        x3, w, z3, y, R, D, B, x3.stride(0), x3.stride(1), z3.stride(0), z3.stride(1), 1.0 / D, eps,
        BLOCK_D=block, ROWS=rows, MODE=mode, X_DTYPE=_TL_DTYPES[x.dtype],
        MID_DTYPE=_TL_DTYPES[mid_dtype or x.dtype], num_warps=warps,
    )
    return y


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


def silu_mul_backward(gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d gate, d up)`` of ``silu_mul``, one launch (contiguous, the inputs' dtype)."""
    D = gate.shape[-1]
    g2, u2 = _rows_2d(gate), _rows_2d(up)
    R = g2.shape[0]
    dy2 = dy.reshape(R, D).contiguous()
    dg = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    du = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    if R and D:
        block = min(4096, triton.next_power_of_2(D))
        _silu_mul_bwd_kernel[(R, triton.cdiv(D, block))](g2, u2, dy2, dg, du, R, D, g2.stride(0), u2.stride(0),
                                                         BLOCK=block, num_warps=4)
    return dg, du


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` over ``[R, D]`` (row-strided views, e.g. the halves of a merged GEMM's output)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} differ")
    D = gate.shape[-1]
    g2, u2 = _rows_2d(gate), _rows_2d(up)
    R = g2.shape[0]
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if R == 0 or D == 0:
        return y
    block = min(4096, triton.next_power_of_2(D))
    _silu_mul_kernel[(R, triton.cdiv(D, block))](g2, u2, y, R, D, g2.stride(0), u2.stride(0), BLOCK=block, num_warps=4)
    return y


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
