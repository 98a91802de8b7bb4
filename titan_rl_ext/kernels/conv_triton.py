"""Triton causal depthwise conv1d over packed sequences with carried state: the CUDA path of
``titan_rl_ext.kernels.conv.causal_conv1d`` (reference: ``causal_conv1d_torch`` beside it).

Forward, two launches: ``_conv_fwd_kernel`` writes every token's output (a ``BLOCK_T x BLOCK_C`` tile reads its
W shifted input rows; a tap before its sequence's start reads the sequence's initial state, or zero), and
``_conv_state_kernel`` writes each sequence's last ``W - 1`` inputs. Which sequence a token belongs to is
found by a binary search of ``cu_seqlens`` in the kernel: no host sync, nothing sized by the data, so a
decode step captures in a CUDA graph. The input may be a column slice of a wider buffer (row-strided).
Backward (the trainer's case: no initial state, no bias): ``_conv_bwd_kernel``, one launch for dx and
per-tile dw partials, instead of differentiating the torch reference (~20 GB of fp32 elementwise traffic
per layer at T = 8192 of the 9B shape, against ~0.4 GB here).

Arithmetic per output: ``acc = sum_j x[t - W + 1 + j] * w[:, j]`` in fp32, taps in ascending j, then bias
and SiLU in fp32, one rounding to the output dtype. Each output depends only on its own W inputs, in a fixed
order: a prefill split across steps (state carried between them) gives the same bits as in one step, and
a token's bits do not depend on the other sequences of the step.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

from titan_rl_ext.kernels.gpu_tables import table_entry

# The backward's launch per GPU model, measured by ``benchmarks/conv_kernels.py --table-out``: ``{gpu name:
# {"variant", "block_t", "block_c", "num_warps"}}``. Every entry gives dx the default's bits (checked before
# it is written; dx does not depend on the tiles) and dw within fp32 rounding of it (its per-tile partials
# follow block_t); a GPU without an entry takes that of a GPU cut from the same die (``kernels.gpu_tables``),
# else, like CPU tensors, BWD_DEFAULT.
BWD_TABLE_FILE = Path(__file__).with_name("conv_bwd_tables.json")
BWD_DEFAULT: dict[str, Any] = {"variant": "fused", "block_t": 32, "block_c": 128, "num_warps": 4}


@triton.jit
def _seq_of(cu_ptr, t, N, SEARCH_STEPS: tl.constexpr):
    """Largest n < N with cu[n] <= t (cu non-decreasing; empty sequences are skipped over)."""
    n = tl.zeros_like(t)
    step = 1 << (SEARCH_STEPS - 1)
    for _ in tl.static_range(SEARCH_STEPS):
        cand = n + step
        ok = cand < N
        start = tl.load(cu_ptr + cand, mask=ok, other=0)
        n = tl.where(ok & (start <= t), cand, n)
        step = step // 2
    return n


@triton.jit
def _state_row0(n, slot_ptr, keep_ptr, live, stride_s, SLOTS: tl.constexpr, KEEP: tl.constexpr):
    """Offset of sequence ``n``'s state (its first row) and whether it holds one: row ``n`` of a ``[N, W-1, C]``
    state, or with ``SLOTS`` the cache row ``slot[n]``, empty where ``keep[n]`` is false (a recycled slot)."""
    if SLOTS:
        idx = tl.load(slot_ptr + n, mask=live, other=0).to(tl.int64)
    else:
        idx = n.to(tl.int64)
    has = live
    if KEEP:
        has = has & (tl.load(keep_ptr + n, mask=live, other=0) != 0)
    return idx * stride_s, has


@triton.jit(do_not_specialize=["T", "N"])
def _conv_fwd_kernel(
    x_ptr, w_ptr, b_ptr, s_ptr, slot_ptr, keep_ptr, cu_ptr, y_ptr, y2_ptr,
    T, C, N, stride_x, stride_s, stride_sr, split,
    W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    HAS_STATE: tl.constexpr, SLOTS: tl.constexpr, KEEP: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    SPLIT: tl.constexpr,  # columns < split go to y [T, split], the rest to y2 [T, C - split] (both contiguous)
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_t = offs_t < T
    mask_c = offs_c < C
    n = _seq_of(cu_ptr, offs_t, N, SEARCH_STEPS)
    start = tl.load(cu_ptr + n, mask=mask_t, other=0)
    if HAS_STATE:
        s_row0, has_s = _state_row0(n, slot_ptr, keep_ptr, mask_t, stride_s, SLOTS, KEEP)
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(W):
        r = offs_t - start - (W - 1) + j  # tap position relative to the sequence start (< 0: the state)
        in_x = mask_t & (r >= 0)
        xv = tl.load(
            x_ptr + (offs_t - (W - 1) + j).to(tl.int64)[:, None] * stride_x + offs_c[None, :],
            mask=in_x[:, None] & mask_c[None, :], other=0.0,
        ).to(tl.float32)
        if HAS_STATE:
            sv = tl.load(
                s_ptr + (s_row0 + ((W - 1) + r).to(tl.int64) * stride_sr)[:, None] + offs_c[None, :],
                mask=(has_s & (r < 0))[:, None] & mask_c[None, :], other=0.0,
            ).to(tl.float32)
            xv = tl.where(in_x[:, None], xv, sv)
        wj = tl.load(w_ptr + offs_c * W + j, mask=mask_c, other=0.0).to(tl.float32)
        acc += xv * wj[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    if SPLIT:
        rows = offs_t.to(tl.int64)[:, None]
        tl.store(y_ptr + rows * split + offs_c[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mask_t[:, None] & (mask_c & (offs_c < split))[None, :])
        tl.store(y2_ptr + rows * (C - split) + (offs_c - split)[None, :], acc.to(y2_ptr.dtype.element_ty),
                 mask=mask_t[:, None] & (mask_c & (offs_c >= split))[None, :])
    else:
        tl.store(
            y_ptr + offs_t.to(tl.int64)[:, None] * C + offs_c[None, :],
            acc.to(y_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_c[None, :],
        )


@triton.jit
def _conv_state_kernel(
    x_ptr, s_ptr, slot_ptr, keep_ptr, cu_ptr, out_ptr, C, stride_x, stride_s, stride_sr, stride_o, stride_or,
    W: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_STATE: tl.constexpr, SLOTS: tl.constexpr, KEEP: tl.constexpr,
):
    """Final state row s of sequence ``seq`` = its input ``L - (W-1) + s`` (relative to its start), or where that
    is before the start, row ``L + s`` of its initial state (zero without one). With ``SLOTS`` the initial state
    and the output are the same cache rows: the whole tile is loaded before any of it is stored."""
    seq = tl.program_id(0)
    offs_s = tl.arange(0, BLOCK_S)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (offs_s < W - 1)[:, None] & (offs_c < C)[None, :]
    start = tl.load(cu_ptr + seq)
    L = tl.load(cu_ptr + seq + 1) - start
    r = L - (W - 1) + offs_s  # each final-state row's position relative to the sequence start
    v = tl.load(x_ptr + (start + r).to(tl.int64)[:, None] * stride_x + offs_c[None, :],
                mask=mask & (r >= 0)[:, None], other=0.0)
    if HAS_STATE:
        # the sequence's (scalar) state offset, broadcast over the tile's rows: masks stay tensors
        s_row0, has_s = _state_row0(seq + tl.zeros_like(offs_s), slot_ptr, keep_ptr, offs_s >= 0, stride_s, SLOTS, KEEP)
        sv = tl.load(s_ptr + (s_row0 + ((W - 1) + r).to(tl.int64) * stride_sr)[:, None] + offs_c[None, :],
                     mask=mask & (has_s & (r < 0))[:, None], other=0.0)
        v = tl.where((r >= 0)[:, None], v, sv.to(v.dtype))
        if SLOTS:
            o_row0 = s_row0[:, None]
            tl.debug_barrier()  # in place: every lane's loads of the old rows land before any row is overwritten
        else:
            o_row0 = seq.to(tl.int64) * stride_o
    else:
        o_row0 = seq.to(tl.int64) * stride_o
    tl.store(out_ptr + o_row0 + offs_s.to(tl.int64)[:, None] * stride_or + offs_c[None, :],
             v.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_tile(cu_ptr, T, C, N, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """This program's ``BLOCK_T x BLOCK_C`` tile: row and column offsets, their masks, each row's sequence."""
    offs_r = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_r = offs_r < T
    return offs_r, offs_c, mask_r, offs_c < C, _seq_of(cu_ptr, offs_r, N, SEARCH_STEPS)


@triton.jit
def _dz_of(x_ptr, w_ptr, dy_ptr, t, t_ok, start, offs_c, mask_c, stride_x, C,
           W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, SILU: tl.constexpr):
    """``dz[t] = dy[t] * silu'(z[t])`` in fp32 for a tile of outputs ``t`` (``z`` recomputed from its W taps in
    ascending order, as the forward does; taps before ``start``, the sequence's first row, are zero)."""
    z = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for i in tl.static_range(W):
        p = t - (W - 1) + i
        xv = tl.load(x_ptr + p.to(tl.int64)[:, None] * stride_x + offs_c[None, :],
                     mask=(t_ok & (p >= start))[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
        z += xv * tl.load(w_ptr + offs_c * W + i, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    dz = tl.load(dy_ptr + t.to(tl.int64)[:, None] * C + offs_c[None, :],
                 mask=t_ok[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
    if SILU:
        sig = tl.sigmoid(z)
        dz = dz * (sig + z * sig * (1.0 - sig))
    return dz


@triton.jit
def _store_dw_part(x_ptr, dw_part_ptr, dz, t, t_ok, start, offs_c, mask_c, stride_x, C, pid_t, W: tl.constexpr):
    """The tile's share of dw: ``dw_part[tile, j] = sum_t dz[t] * x[t - W + 1 + j]`` (fp32, summed over the tile)."""
    for j in tl.static_range(W):
        p = t - (W - 1) + j
        xv = tl.load(x_ptr + p.to(tl.int64)[:, None] * stride_x + offs_c[None, :],
                     mask=(t_ok & (p >= start))[:, None] & mask_c[None, :], other=0.0).to(tl.float32)
        tl.store(dw_part_ptr + (pid_t * W + j).to(tl.int64) * C + offs_c, tl.sum(dz * xv, axis=0), mask=mask_c)


@triton.jit(do_not_specialize=["T", "N"])
def _conv_bwd_kernel(
    x_ptr, w_ptr, cu_ptr, dy_ptr, dx_ptr, dw_part_ptr,
    T, C, N, stride_x,
    W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, SEARCH_STEPS: tl.constexpr, SILU: tl.constexpr,
):
    """Backward of the conv without initial state or bias, for one ``BLOCK_T x BLOCK_C`` tile of input rows r:

        dz[t] = dy[t] * silu'(z[t])                 z[t] recomputed from its W inputs, as the forward does
        dx[r] = sum_j dz[r + W - 1 - j] * w[:, j]   only outputs t of r's own sequence
        dw_part[tile, j] = sum_{t in tile} dz[t] * x[t - W + 1 + j]

    Each dz a tile needs (rows r .. r + W - 1) is recomputed here rather than stored: W^2 loads of rows that
    overlap (cache hits) instead of an fp32 [T, C] round trip. dx accumulates in fp32 and is rounded once;
    the dw partials are summed over tiles in a fixed order by the caller."""
    pid_t = tl.program_id(0)
    offs_r, offs_c, mask_r, mask_c, n = _row_tile(cu_ptr, T, C, N, BLOCK_T, BLOCK_C, SEARCH_STEPS)
    start = tl.load(cu_ptr + n, mask=mask_r, other=0)
    end = tl.load(cu_ptr + n + 1, mask=mask_r, other=0)
    dx = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for k in tl.static_range(W):
        t = offs_r + k  # an output of r's sequence that reads x[r] through tap W - 1 - k
        t_ok = mask_r & (t < end)
        dz = _dz_of(x_ptr, w_ptr, dy_ptr, t, t_ok, start, offs_c, mask_c, stride_x, C, W, BLOCK_T, BLOCK_C, SILU)
        dx += dz * tl.load(w_ptr + offs_c * W + (W - 1 - k), mask=mask_c, other=0.0).to(tl.float32)[None, :]
        if k == 0:  # t = r: this tile's own outputs give its share of dw
            _store_dw_part(x_ptr, dw_part_ptr, dz, t, t_ok, start, offs_c, mask_c, stride_x, C, pid_t, W)
    tl.store(dx_ptr + offs_r.to(tl.int64)[:, None] * C + offs_c[None, :], dx.to(dx_ptr.dtype.element_ty),
             mask=mask_r[:, None] & mask_c[None, :])


@triton.jit(do_not_specialize=["T", "N"])
def _conv_bwd_dz_kernel(
    x_ptr, w_ptr, cu_ptr, dy_ptr, dz_ptr, dw_part_ptr,
    T, C, N, stride_x,
    W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, SEARCH_STEPS: tl.constexpr, SILU: tl.constexpr,
):
    """Pass 1 of the two-pass backward: ``dz[t]`` of the tile's own rows (fp32, to ``dz_ptr``) and the tile's
    dw partials, from one load of each tap. The arithmetic is ``_conv_bwd_kernel``'s at ``k = 0``: same bits."""
    pid_t = tl.program_id(0)
    offs_t, offs_c, mask_t, mask_c, n = _row_tile(cu_ptr, T, C, N, BLOCK_T, BLOCK_C, SEARCH_STEPS)
    start = tl.load(cu_ptr + n, mask=mask_t, other=0)
    dz = _dz_of(x_ptr, w_ptr, dy_ptr, offs_t, mask_t, start, offs_c, mask_c, stride_x, C, W, BLOCK_T, BLOCK_C, SILU)
    tl.store(dz_ptr + offs_t.to(tl.int64)[:, None] * C + offs_c[None, :], dz, mask=mask_t[:, None] & mask_c[None, :])
    _store_dw_part(x_ptr, dw_part_ptr, dz, offs_t, mask_t, start, offs_c, mask_c, stride_x, C, pid_t, W)


@triton.jit(do_not_specialize=["T", "N"])
def _conv_bwd_dx_kernel(
    w_ptr, cu_ptr, dz_ptr, dx_ptr, T, C, N,
    W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):
    """Pass 2: ``dx[r] = sum_k dz[r + k] * w[:, W - 1 - k]`` over outputs of r's own sequence, k ascending in
    fp32, rounded once (``_conv_bwd_kernel``'s sum, from the stored dz instead of recomputed ones)."""
    offs_r, offs_c, mask_r, mask_c, n = _row_tile(cu_ptr, T, C, N, BLOCK_T, BLOCK_C, SEARCH_STEPS)
    end = tl.load(cu_ptr + n + 1, mask=mask_r, other=0)
    dx = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for k in tl.static_range(W):
        t = offs_r + k
        dz = tl.load(dz_ptr + t.to(tl.int64)[:, None] * C + offs_c[None, :],
                     mask=(mask_r & (t < end))[:, None] & mask_c[None, :], other=0.0)
        dx += dz * tl.load(w_ptr + offs_c * W + (W - 1 - k), mask=mask_c, other=0.0).to(tl.float32)[None, :]
    tl.store(dx_ptr + offs_r.to(tl.int64)[:, None] * C + offs_c[None, :], dx.to(dx_ptr.dtype.element_ty),
             mask=mask_r[:, None] & mask_c[None, :])


BWD_VARIANTS = ("fused", "two_pass")


@functools.lru_cache(maxsize=None)
def _bwd_table(gpu_name: str) -> tuple[tuple[str, Any], ...]:
    if not gpu_name or not BWD_TABLE_FILE.exists():
        return ()
    found = table_entry(json.loads(BWD_TABLE_FILE.read_text()), gpu_name)
    if found is None:
        return ()
    key, entry = found
    unknown = set(entry) - set(BWD_DEFAULT)
    if unknown or entry.get("variant", "fused") not in BWD_VARIANTS:
        raise ValueError(f"{BWD_TABLE_FILE.name}: bad entry for {key!r}: {entry}")
    return tuple(entry.items())


def bwd_config_for(gpu_name: str) -> dict[str, Any]:
    """The backward's launch on the GPU model ``gpu_name`` ("" for CPU): its entry of ``BWD_TABLE_FILE`` over
    ``BWD_DEFAULT``."""
    return {**BWD_DEFAULT, **dict(_bwd_table(gpu_name))}


def bwd_config(device: torch.device) -> dict[str, Any]:
    """The launch ``causal_conv1d_backward_triton`` uses on ``device``."""
    return bwd_config_for(torch.cuda.get_device_name(device) if device.type == "cuda" else "")


def causal_conv1d_backward_triton(
    x_TC: torch.Tensor, weight_CW: torch.Tensor, cu_seqlens: torch.Tensor, dy_TC: torch.Tensor,
    activation: str | None = "silu", *, variant: str | None = None, block_t: int | None = None,
    block_c: int | None = None, num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx [T, C] in x's dtype, dw [C, W] in the weight's dtype)`` of ``causal_conv1d_triton`` without initial
    state or bias, given the output's gradient ``dy``. dx sums its W contributions in fp32 and rounds once; dw
    sums each tile's fp32 partial, then the tiles in order (no atomics: the same bits every run).

    ``variant``: ``fused`` (one launch; each tile recomputes the W outputs its rows feed, W^2 tap loads) or
    ``two_pass`` (dz of every row stored in fp32, then dx from it: W + 1 tap loads and a [T, C] fp32 round
    trip). Both give the same bits; ``block_t`` sets the dw partials' tiles, so dw's bits depend on it (dx's do
    not). Each launch argument left ``None`` comes from ``bwd_config`` (the GPU's measured table, else
    ``BWD_DEFAULT``); ``benchmarks/conv_kernels.py`` times them."""
    if activation not in (None, "silu"):
        raise ValueError(f"unsupported activation {activation!r}")
    T, C = x_TC.shape
    W = weight_CW.shape[1]
    N = cu_seqlens.numel() - 1
    if dy_TC.shape != (T, C):
        raise ValueError(f"dy must be [T, C]={[T, C]}; got {tuple(dy_TC.shape)}")
    if x_TC.stride(1) != 1:
        x_TC = x_TC.contiguous()
    w = weight_CW.contiguous()
    dy = dy_TC.contiguous()
    cu = cu_seqlens.to(device=x_TC.device, dtype=torch.int32).contiguous()
    asked = {"variant": variant, "block_t": block_t, "block_c": block_c, "num_warps": num_warps}
    cfg = {**bwd_config(x_TC.device), **{k: v for k, v in asked.items() if v is not None}}
    variant, block_t, block_c, num_warps = cfg["variant"], cfg["block_t"], cfg["block_c"], cfg["num_warps"]
    if variant not in BWD_VARIANTS:
        raise ValueError(f"unknown conv backward variant {variant!r}; one of {BWD_VARIANTS}")
    dx = torch.empty(T, C, dtype=x_TC.dtype, device=x_TC.device)
    BLOCK_C = block_c
    BLOCK_T = block_t if T >= block_t else triton.next_power_of_2(max(T, 1))
    n_t = triton.cdiv(T, BLOCK_T)
    dw_part = torch.empty(n_t, W, C, dtype=torch.float32, device=x_TC.device)
    grid = (n_t, triton.cdiv(C, BLOCK_C))
    meta = dict(W=W, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, SEARCH_STEPS=max(1, N.bit_length()), num_warps=num_warps)
    if T > 0 and variant == "fused":
        _conv_bwd_kernel[grid](x_TC, w, cu, dy, dx, dw_part, T, C, N, x_TC.stride(0), SILU=activation == "silu", **meta)
    elif T > 0:
        dz = torch.empty(T, C, dtype=torch.float32, device=x_TC.device)
        _conv_bwd_dz_kernel[grid](x_TC, w, cu, dy, dz, dw_part, T, C, N, x_TC.stride(0), SILU=activation == "silu", **meta)
        _conv_bwd_dx_kernel[grid](w, cu, dz, dx, T, C, N, **meta)
    return dx, dw_part.sum(0).t().to(weight_CW.dtype)


def slotted_conv_state_ok(cache: torch.Tensor, x_TC: torch.Tensor, W: int) -> bool:
    """Whether ``causal_conv1d_triton`` can read and write ``cache`` by slot for inputs ``x``: ``[S, W-1, C]`` in
    x's dtype (the gather path casts the state to it first), each row contiguous."""
    return (cache.dim() == 3 and tuple(cache.shape[1:]) == (W - 1, x_TC.shape[1]) and cache.stride(2) == 1
            and cache.dtype == x_TC.dtype and cache.device == x_TC.device)


def causal_conv1d_triton(
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
    """Same contract as ``causal_conv1d_torch``: ``y [T, C]`` (x's dtype, contiguous) and the final states
    ``[N, W-1, C]`` (x's dtype). ``x`` needs a unit column stride; its rows may be strided. ``split``: ``y`` is
    written as two contiguous tensors instead, columns ``[:split]`` and ``[split:]`` (``(y_a, y_b)`` in place of
    ``y``): a consumer that needs one part contiguous (FLA's kernels copy a strided v) gets it without a copy.

    ``state_slots [N]`` (an engine's conv cache): ``initial_state`` is the cache ``[S, W-1, C]``
    (``slotted_conv_state_ok``), sequence n starts from cache row ``state_slots[n]`` -- from zeros where
    ``state_keep[n]`` is false -- and its final state is written back there in place; the cache is returned as
    the state. Same arithmetic as the gathered state's (the same loads), so the same bits; it saves the gather,
    the zeroing and the scatter around the kernel (three launches per layer and step)."""
    if activation not in (None, "silu"):
        raise ValueError(f"unsupported activation {activation!r}")
    T, C = x_TC.shape
    W = weight_CW.shape[1]
    N = cu_seqlens.numel() - 1
    if x_TC.stride(1) != 1:
        x_TC = x_TC.contiguous()
    w = weight_CW.contiguous()
    cu = cu_seqlens.to(device=x_TC.device, dtype=torch.int32).contiguous()
    slots = state_slots is not None
    if slots:
        if initial_state is None or not slotted_conv_state_ok(initial_state, x_TC, W):
            raise ValueError(f"state_slots need initial_state as a conv cache [S, {W - 1}, {C}] in {x_TC.dtype} with "
                             f"contiguous rows; got {None if initial_state is None else (tuple(initial_state.shape), initial_state.dtype)}")
        if state_slots.shape != (N,) or (state_keep is not None and state_keep.shape != (N,)):
            raise ValueError(f"state_slots and state_keep must be [N={N}]")
        state = final = initial_state
    else:
        if state_keep is not None:
            raise ValueError("state_keep goes with state_slots")
        state = None if initial_state is None else initial_state.to(x_TC.dtype).contiguous()
        final = torch.empty(N, W - 1, C, dtype=x_TC.dtype, device=x_TC.device)
    if split is not None and not 0 < split < C:
        raise ValueError(f"split must cut the {C} channels in two; got {split}")
    y = torch.empty(T, C if split is None else split, dtype=x_TC.dtype, device=x_TC.device)
    y2 = y if split is None else torch.empty(T, C - split, dtype=x_TC.dtype, device=x_TC.device)
    dummy = w  # stands in for absent pointers (never read: the constexpr flags drop those loads)
    s_arg = state if state is not None else dummy
    slot_arg = state_slots if slots else dummy
    keep_arg = state_keep if state_keep is not None else dummy
    s_strides = (state.stride(0), state.stride(1)) if state is not None else (0, 0)
    flags = dict(HAS_STATE=state is not None, SLOTS=slots, KEEP=state_keep is not None)
    BLOCK_C = 128
    if T > 0:
        BLOCK_T = 32 if T >= 32 else triton.next_power_of_2(T)
        _conv_fwd_kernel[(triton.cdiv(T, BLOCK_T), triton.cdiv(C, BLOCK_C))](
            x_TC, w, bias_C if bias_C is not None else dummy, s_arg, slot_arg, keep_arg, cu, y, y2,
            T, C, N, x_TC.stride(0), *s_strides, split or 0,
            W=W, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, SEARCH_STEPS=max(1, N.bit_length()),
            HAS_BIAS=bias_C is not None, SILU=activation == "silu", SPLIT=split is not None, num_warps=4, **flags,
        )
    if N > 0 and W > 1:
        _conv_state_kernel[(N, triton.cdiv(C, BLOCK_C))](
            x_TC, s_arg, slot_arg, keep_arg, cu, final, C, x_TC.stride(0), *s_strides, final.stride(0), final.stride(1),
            W=W, BLOCK_S=triton.next_power_of_2(W - 1), BLOCK_C=BLOCK_C, num_warps=4, **flags,
        )
    return (y if split is None else (y, y2)), final
