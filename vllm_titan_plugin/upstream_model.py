"""The vLLM model class serving torchtitan's own model definitions (``--model-impl titan`` with
``--hf-overrides '{"titan_model_spec": "torchtitan.models.qwen3"}'``).

It builds the spec's model from the checkpoint's HF config (``titan_rl_ext.models.upstream.build``) and
puts a paged-KV kernel into the ``inner_attention`` slot of every attention module: that slot is torchtitan's
seam for the sequence kernel, and it receives keys after torchtitan's projections, norms and rotary, which is
exactly what belongs in vLLM's cache. Nothing else of the model is replaced, copied or wrapped: the served
modules are torchtitan's classes. Weights come through the spec's own state-dict adapter. Under batch
invariance the forward runs inside ``BatchInvariantOps`` and the kernel is the plugin's BI attention, as in
the trainer (``models.upstream.packed``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from titan_rl_ext.kernels import batch_invariant as bi
from titan_rl_ext.models.common.state_dict_adapter import CheckpointMismatchError
from vllm_titan_plugin import compat
from vllm_titan_plugin.attention import VllmAttentionKernel

logger = logging.getLogger("vllm.titan_plugin")


class PagedInnerAttention(nn.Module):
    """torchtitan's ``inner_attention(q, k, v, *, attention_masks, scale, enable_gqa)`` on ``[1, T, N, H]``,
    backed by vLLM's paged ``Attention`` (sequence bounds come from vLLM's per-layer metadata)."""

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, scale: float, *, cache_config: object,
                 prefix: str) -> None:
        super().__init__()
        self.kernel = VllmAttentionKernel(n_heads, n_kv_heads, head_dim, scale, cache_config=cache_config,
                                          prefix=f"{prefix}.kernel")

    def forward(self, q_BTNH: torch.Tensor, k_BTKH: torch.Tensor, v_BTKH: torch.Tensor, *, attention_masks: Any = None,
                scale: float | None = None, enable_gqa: bool = False, **_: Any) -> torch.Tensor:
        o_TNH, _ = self.kernel(q_BTNH[0], k_BTKH[0].contiguous(), v_BTKH[0].contiguous(), None, None)
        return o_TNH[None]


def spec_of(model_config: Any) -> str | None:
    """The ``titan_model_spec`` the checkpoint's (overridden) HF config names, if any."""
    from titan_rl_ext.models.upstream.build import SPEC_KEY

    value = getattr(getattr(model_config, "hf_config", None), SPEC_KEY, None)
    return None if value is None else str(value)


class TorchtitanForCausalLM(nn.Module):
    """An upstream torchtitan model in vLLM; vLLM's module prefix for it is ``model``."""

    def __init__(self, *, vllm_config: compat.VllmConfig, prefix: str = "") -> None:
        super().__init__()
        from titan_rl_ext.models.upstream import build as B
        from vllm_titan_plugin.model import TitanForCausalLM

        TitanForCausalLM._check_supported(vllm_config)
        mc = vllm_config.model_config
        hf = mc.hf_config.to_dict()
        self.spec = B.spec_name(spec_of(mc) or "")
        B.check_architecture(self.spec, (hf.get("architectures") or ["?"])[0])
        with torch.device("meta"):  # the checkpoint overwrites every parameter
            model, self.adapter = B.build(self.spec, hf, max_seq_len=max(mc.max_model_len, 1))
        model.to_empty(device=torch.get_default_device())
        for m in model.modules():  # rotary caches are non-persistent buffers: recompute them for real
            if hasattr(m, "_precompute_cache") and hasattr(m, "cache"):
                m.cache = m._precompute_cache().to(m.cache.device)
        model._skip_lm_head = True  # forward returns hidden states; compute_logits applies the head
        self.model = model
        model_prefix = f"{prefix}.model" if prefix else "model"
        attention = B.attention_modules(model)
        for path, a in attention:
            scale = a.scaling if getattr(a, "scaling", None) is not None else a.head_dim**-0.5
            a.inner_attention = PagedInnerAttention(
                a.n_heads, a.n_kv_heads, a.head_dim, scale, cache_config=vllm_config.cache_config,
                prefix=f"{model_prefix}.{path}.inner_attention")
        logger.info("titan: serving torchtitan.models.%s (%s) with paged inner attention in %d modules",
                    self.spec, type(model).__name__, len(attention))

    def _ops(self) -> Any:
        from titan_rl_ext.models.upstream.bi_ops import BatchInvariantOps

        return BatchInvariantOps() if bi.is_batch_invariant() else contextlib.nullcontext()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.tok_embeddings(input_ids)

    get_input_embeddings = embed_input_ids

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: Any = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs: object) -> torch.Tensor:
        if inputs_embeds is not None or input_ids is None:
            raise NotImplementedError("--model-impl titan takes token ids, not input embeddings")
        with self._ops():
            return self.model(input_ids[None], positions=positions[None])[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        with self._ops():
            return self.model.lm_head(hidden_states)

    def titan_parameters(self) -> dict[str, tuple[str, nn.Parameter]]:
        """torchtitan parameter name -> (name in this vLLM module, parameter): what a weight push carries."""
        return {name: (f"model.{name}", p) for name, p in self.model.named_parameters() if ".inner_attention." not in name}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Through the spec's own adapter, strictly: any missing or unexpected tensor is an error."""
        hf_sd: dict[str, torch.Tensor] = {}
        for name, t in weights:
            if name in hf_sd:
                raise CheckpointMismatchError(f"tensor {name!r} appears twice in the checkpoint")
            hf_sd[name] = t
        sd = {k: v for k, v in self.adapter.from_hf(hf_sd).items() if v is not None}
        # tied weights appear under both names; vLLM's attention layers keep their own (scale) buffers
        targets = {k: v for k, v in self.model.state_dict(keep_vars=True).items() if ".inner_attention." not in k}
        missing, unexpected = sorted(set(targets) - set(sd)), sorted(set(sd) - set(targets))
        if missing or unexpected:
            raise CheckpointMismatchError(f"torchtitan parameters missing {missing[:10]}, unexpected {unexpected[:10]}")
        for key, t in sd.items():
            if targets[key].shape != t.shape:
                raise CheckpointMismatchError(f"{key}: checkpoint {tuple(t.shape)} vs model {tuple(targets[key].shape)}")
            targets[key].data.copy_(t)
        return {f"model.{k}" for k in sd}
