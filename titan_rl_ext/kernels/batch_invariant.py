"""Batch-invariant (BI) primitives: each output row's bits depend only on that row's inputs.

Why stock kernels are not: a GEMM library picks its blocking (and on GPUs split-K) from the shape,
so a token's logits change with the number of tokens beside it; CPU elementwise kernels run a
vector path on whole vectors and a scalar path on the tail, with different rounding, so an element's
bits depend on where the tensor ends.

CPU implementations here:
- ``mm``: rows are processed in tiles of exactly ``ROW_TILE`` rows (the last one zero padded), so
  every GEMM call has the same shape and every row sits in a full register block.
- ``elementwise``: flattens, pads to a multiple of ``PAD`` elements so no element of interest falls
  in a scalar tail, applies the op, strips the padding.
- row reductions (RMSNorm statistics, log-softmax) reduce along the last dim of a contiguous
  tensor; their order depends on that dim alone, so they are invariant as long as rows start on
  vector boundaries, which ``elementwise``-style padding of the last dim guarantees.

CUDA (``batch_invariant_triton``, imported lazily): ``mm`` runs the project's own Triton GEMM (one
fixed tile config, no split-K, persistent grid) and ``row_sum_sq`` / ``row_mean_sq`` a one-program-
per-row Triton reduction. Without triton, CUDA tensors take the torch paths below (the tiled GEMM is
invariant there too: every call has one shape, so the library picks one kernel; just slower).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Callable

import torch
import torch.nn.functional as F

from titan_rl_ext import settings

ROW_TILE = 32
PAD = 64

# Engine workers (vLLM spawns them) read the switch from the environment; the trainer may also set it
# in code. Every process of a run must agree.
ENV_VAR = settings.BATCH_INVARIANT.name
_enabled = settings.BATCH_INVARIANT.get()


def _pin_fp32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


if _enabled:  # a process started with BI on (an engine worker) pins TF32 off like set_batch_invariant
    _pin_fp32()


def set_batch_invariant(enabled: bool) -> None:
    """Process-wide; also exported to the environment so child processes (engine workers) follow.
    Turning it on pins TF32 off (torch's fp32 matmul and cuDNN flags): TF32 rounds fp32 products
    differently, and both sides of a run must do the same arithmetic. Turning it off leaves them."""
    global _enabled
    _enabled = bool(enabled)
    os.environ[ENV_VAR] = "1" if _enabled else "0"
    if _enabled:
        _pin_fp32()


def is_batch_invariant() -> bool:
    return _enabled


_triton_mod = None  # None: not tried yet; False: unavailable


def _triton():  # type: ignore[no-untyped-def]
    """The Triton kernels module, or None where triton cannot be imported."""
    global _triton_mod
    if _triton_mod is None:
        try:
            from titan_rl_ext.kernels import batch_invariant_triton

            _triton_mod = batch_invariant_triton
        except Exception:  # no triton, or a triton that cannot initialise: torch paths (still BI)
            _triton_mod = False
    return _triton_mod or None


def _use_triton(*ts: torch.Tensor) -> bool:
    return all(t.is_cuda for t in ts) and _triton() is not None


def mm(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with a per-row result independent of M (the number of rows), in the promoted dtype of
    the two. CUDA: the Triton GEMM (``batch_invariant_triton.bi_mm``); CPU: ``mm_torch``."""
    if a_MK.dim() != 2 or b_KN.dim() != 2 or a_MK.shape[1] != b_KN.shape[0]:
        raise ValueError(f"mm expects [M, K] @ [K, N]; got {tuple(a_MK.shape)} @ {tuple(b_KN.shape)}")
    if _use_triton(a_MK, b_KN):
        return _triton().bi_mm(a_MK, b_KN)  # mixed dtypes: b widened inside the kernel
    dtype = torch.promote_types(a_MK.dtype, b_KN.dtype)
    return mm_torch(a_MK.to(dtype), b_KN.to(dtype))


def mm_torch(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch BI GEMM (the reference): rows in zero-padded tiles of exactly ``ROW_TILE``."""
    if a_MK.dim() != 2 or b_KN.dim() != 2 or a_MK.shape[1] != b_KN.shape[0]:
        raise ValueError(f"mm expects [M, K] @ [K, N]; got {tuple(a_MK.shape)} @ {tuple(b_KN.shape)}")
    M = a_MK.shape[0]
    pad = (-M) % ROW_TILE
    a = F.pad(a_MK, (0, 0, 0, pad)) if pad else a_MK
    tiles = [a[i : i + ROW_TILE] @ b_KN for i in range(0, a.shape[0], ROW_TILE)]
    out = torch.cat(tiles) if tiles else a_MK.new_zeros(0, b_KN.shape[1])
    return out[:M]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` over any leading dims, batch invariant."""
    lead = x.shape[:-1]
    y = mm(x.reshape(-1, x.shape[-1]), weight.t())
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, weight.shape[0])


def elementwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Apply an elementwise op so each element takes the vectorised path wherever the tensor ends."""
    flat = x.reshape(-1)
    pad = (-flat.numel()) % PAD
    if pad:
        flat = F.pad(flat, (0, pad))
    return fn(flat)[: x.numel()].reshape(x.shape)


def log_softmax(logits: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """fp32 log-softmax along the last dim, rows padded to a multiple of ``PAD`` with -inf."""
    if dim not in (-1, logits.dim() - 1):
        raise ValueError("batch-invariant log_softmax reduces over the last dim only")
    x = logits.float()
    V = x.shape[-1]
    pad = (-V) % PAD
    if pad:
        x = F.pad(x, (0, pad), value=float("-inf"))
    return torch.log_softmax(x.contiguous(), dim=-1)[..., :V]


def row_sum_sq(x: torch.Tensor) -> torch.Tensor:
    """``sum(x.float()**2, -1)`` in fp32, shape ``x.shape[:-1]`` (l2norm). Each row's bits depend
    only on that row: CUDA runs the one-program-per-row Triton kernel; CPU the torch reduction."""
    if _use_triton(x):
        return _triton().row_sum_sq(x)
    xf = x.float()
    return (xf * xf).sum(dim=-1)


def row_mean_sq(x: torch.Tensor) -> torch.Tensor:
    """``mean(x.float()**2, -1)`` in fp32, shape ``x.shape[:-1]`` (RMSNorm statistics); see ``row_sum_sq``."""
    if _use_triton(x):
        return _triton().row_mean_sq(x)
    return x.float().pow(2).mean(dim=-1)


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """``with batch_invariant(): ...`` -- the switch for a block, restored afterwards."""
    before = _enabled
    set_batch_invariant(enabled)
    try:
        yield
    finally:
        set_batch_invariant(before)
