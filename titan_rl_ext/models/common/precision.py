"""Mixed precision between the trainer (fp32 master weights, bf16 compute) and a bf16 generator.

A module whose own parameters must not all be cast to the compute dtype lists the ones that stay fp32 in a
class attribute ``FP32_PARAMS`` (Qwen3.5's GDN decay ``A_log``) and casts its other own parameters to the
activations' dtype in its forward. The served model holds exactly that: vLLM builds it in bf16 and the
module's ``_apply`` keeps the listed ones fp32. The trainer shards such a module's own parameters in an
fp32 FSDP group and everything else in bf16 groups (``titan_protocol.apply_fsdp``), and what it pushes,
checksums and recomputes stale tokens with is ``compute_view`` of its master weights: the same casts."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn

FP32_ATTR = "FP32_PARAMS"


def keeps_fp32(module: nn.Module) -> bool:
    return bool(getattr(module, FP32_ATTR, ()))


def fp32_param_names(model: nn.Module) -> set[str]:
    return {f"{mod_name}.{p}" if mod_name else p
            for mod_name, mod in model.named_modules() for p in getattr(mod, FP32_ATTR, ())}


def compute_view(sd: Mapping[str, torch.Tensor], compute: torch.dtype | None, keep: set[str]) -> dict[str, torch.Tensor]:
    """``sd`` with every floating tensor not in ``keep`` cast to ``compute`` (round to nearest, as FSDP's and
    vLLM's casts do); ``compute=None``: unchanged."""
    if compute is None:
        return dict(sd)
    return {k: v.to(compute) if v.is_floating_point() and k not in keep else v for k, v in sd.items()}
