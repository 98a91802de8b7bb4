"""Batch invariance for model code the project does not own (torchtitan's modules).

The project's own layers call ``kernels.ops``; torchtitan's call torch directly. Of what its Qwen3 and
Llama 3 forwards call (embedding, linear, rms_norm, silu, view/cat/mul/add, complex mul for the rotary),
three can change a row's bits with the rows beside it on these machines: the GEMM behind ``linear`` (its
blocking follows M), ``rms_norm``'s reduction, and ``silu``'s vector/scalar-tail split. This mode routes
those three to the batch-invariant kernels; the exact ops need nothing. Attention goes through
``inner_attention``, which the caller fills with a batch-invariant kernel; an SDPA call reaching this mode
means it did not, and raises rather than break parity silently.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from titan_rl_ext.kernels import ops


def _rms_norm(x: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,
              eps: float | None = None) -> torch.Tensor:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if len(shape) != 1:
        raise ValueError(f"batch-invariant rms_norm normalises over the last dim only, got {shape}")
    e = torch.finfo(x.dtype).eps if eps is None else eps
    x32 = x.float()
    y = (x32 * ops.rsqrt(ops.mean_sq(x32) + e)).to(x.dtype)
    return y * weight if weight is not None else y


def _no_sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
    raise RuntimeError("scaled_dot_product_attention under batch-invariant ops: install a batch-invariant "
                       "inner_attention in every attention module first")


_ROUTES = {F.linear: ops.linear, F.rms_norm: _rms_norm, F.silu: lambda x, inplace=False: ops.silu(x),
           F.scaled_dot_product_attention: _no_sdpa}


class BatchInvariantOps(TorchFunctionMode):
    """``with BatchInvariantOps(): model(...)`` -- the ops above through ``kernels.ops`` (which follow the
    batch-invariance switch), everything else untouched. (While a handler runs, torch takes the mode off
    its stack, so the kernels' own torch calls are not routed again.)"""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return _ROUTES.get(func, func)(*args, **(kwargs or {}))
