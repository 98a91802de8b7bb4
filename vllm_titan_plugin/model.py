"""The vLLM model class that serves the titan model definition (``--model-impl titan``).

It builds the titan ``Decoder`` from the checkpoint's HF config, fills the kernel slots of its
full-attention layers with vLLM's paged attention, wraps its Gated DeltaNet layers as vLLM Mamba-type
layers (vLLM owns their state), and otherwise runs the titan blocks unchanged: embedding, blocks,
final norm and LM head are titan code, so the logits are the titan model's logits.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from titan_rl_ext.kernels import batch_invariant as bi
from titan_rl_ext.models.common.batch import SeqBatch
from titan_rl_ext.models.common.decoder import FULL_ATTENTION, Decoder
from titan_rl_ext.models.common.lora import is_lora_param, lora_from_hf_config, zero_lora
from titan_rl_ext.models.common.state_dict_adapter import CheckpointMismatchError
from titan_rl_ext.models.architectures import architecture_of
from titan_rl_ext.models.hf import adapter_for, config_from_hf
from vllm_titan_plugin import checks, compat
from vllm_titan_plugin.attention import VllmAttentionKernel
from vllm_titan_plugin.gdn_layer import INNER, VllmGatedDeltaNet, gdn_state_dtypes, gdn_state_shapes, grid_state

logger = logging.getLogger("vllm.titan_plugin")

_WRAPPED_GDN = re.compile(rf"^(layers\.\d+\.linear_attn)\.{INNER}\.")


class TitanForCausalLM(nn.Module, compat.SupportsMRoPE):
    """Text generation with the titan ``Decoder``; vLLM's module prefix for it is ``model``."""

    def __init__(self, *, vllm_config: compat.VllmConfig, prefix: str = "") -> None:
        super().__init__()
        mc = vllm_config.model_config
        self._check_supported(vllm_config)
        self.hf_config: dict[str, Any] = mc.hf_config.to_dict()
        self.architecture = architecture_of(self.hf_config).name
        cfg = config_from_hf(self.hf_config)
        # LoRA adapters named by ``--hf-overrides '{"titan_lora": {...}}'`` (a bad value stops the server here): the
        # trainer's adapter modules, so that the trainer's adapter pushes (``swap``) land in the same computation
        cfg.lora = lora_from_hf_config(self.hf_config)
        self.adapter = adapter_for(self.hf_config, cfg)
        # M-RoPE checkpoints (Qwen3.5 VLM) make vLLM pass positions [num_dims, T]; text rows are equal.
        self._mrope_dims: int = getattr(mc, "mrope_num_dims", 3) if getattr(mc, "uses_mrope", False) else 0

        # Build on meta and materialise once on vLLM's target device: the checkpoint overwrites every
        # parameter, so the titan random init would be wasted work (minutes for large MoE models).
        # Parameters take vLLM's default dtype (the model dtype); A_log stays fp32 (titan keeps it so).
        device = torch.get_default_device()
        with torch.device("meta"):
            decoder = cfg.build()
        decoder.to_empty(device=device)
        decoder.rope.reset_parameters()  # inv_freq is a non-persistent fp32 buffer, recomputed
        # no checkpoint holds the adapters: they start as the identity (B = 0; A = 0 too, not to_empty's garbage,
        # which may be NaN and 0 * NaN is NaN) until the trainer pushes its own
        zero_lora(decoder)
        self.model: Decoder = decoder
        model_prefix = f"{prefix}.model" if prefix else "model"
        self._install_vllm_layers(vllm_config, model_prefix)

    # -- construction ------------------------------------------------------------------------------
    @staticmethod
    def _check_supported(vllm_config: compat.VllmConfig) -> None:
        par = vllm_config.parallel_config
        if par.tensor_parallel_size != 1 or par.pipeline_parallel_size != 1:
            raise NotImplementedError(
                "--model-impl titan runs unsharded: tensor/pipeline parallel size must be 1 "
                f"(got tp={par.tensor_parallel_size}, pp={par.pipeline_parallel_size})"
            )
        if vllm_config.speculative_config is not None:
            raise NotImplementedError("--model-impl titan does not support speculative decoding")
        if getattr(vllm_config.model_config, "enable_prompt_embeds", False):
            raise NotImplementedError("--model-impl titan does not support prompt embeddings")
        if bi.is_batch_invariant() and (problem := checks.batch_invariance_problem(vllm_config)) is not None:
            raise ValueError(problem)
        if (problem := checks.settings_problem()) is not None:  # a bad TITAN_* value, before any request
            raise ValueError(problem)
        if (problem := checks.gdn_bi_form_problem(vllm_config, bi.is_batch_invariant())) is not None:
            raise ValueError(problem)

    def _install_vllm_layers(self, vllm_config: compat.VllmConfig, model_prefix: str) -> None:
        cache_config = vllm_config.cache_config
        for i, block in enumerate(self.model.layers):
            if block.layer_type == FULL_ATTENTION:
                a = block.attention
                block.attention.kernel = VllmAttentionKernel(
                    a.n_heads, a.n_kv_heads, a.head_dim, getattr(a.kernel, "scale", a.head_dim**-0.5),
                    cache_config=cache_config, prefix=f"{model_prefix}.layers.{i}.attention.kernel",
                )
            else:
                block.linear_attn = VllmGatedDeltaNet(
                    block.linear_attn, prefix=f"{model_prefix}.layers.{i}.linear_attn",
                    state_dtypes=gdn_state_dtypes(vllm_config),
                )

    # -- vLLM model interface ----------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.tok_embeddings(input_ids)

    get_input_embeddings = embed_input_ids  # name used by older vLLM releases

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: object,
    ) -> torch.Tensor:
        if inputs_embeds is not None or input_ids is None:
            raise NotImplementedError("--model-impl titan takes token ids, not input embeddings")
        if positions.dim() == 2:  # M-RoPE positions [num_dims, T]: identical rows for text
            positions = positions[0]
        T = input_ids.shape[0]
        # vLLM's kernels read their own per-layer metadata for sequence bounds; the titan batch only
        # carries the positions (rotary). cu_seqlens spans the whole step as one placeholder sequence,
        # made on the device ([0, T] by arange, not from a host list: no copy inside a CUDA graph).
        batch = SeqBatch(
            cu_seqlens=torch.arange(2, dtype=torch.int32, device=input_ids.device) * T,
            positions=positions,
            max_seqlen=T,
        )
        h_TD, _ = self.model.hidden(input_ids, batch)
        return h_TD

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # The titan LM head itself (no vocab padding, no TP gather): logits are the titan logits. In
        # batch-invariant mode in fp32, the same head the trainer's logprob function uses.
        return self.model.logits(hidden_states, fp32=bi.is_batch_invariant())

    def get_mrope_input_positions(self, input_tokens: list[int], mm_features: list[Any]) -> tuple[torch.Tensor, int]:
        if mm_features:
            raise ValueError("--model-impl titan serves the text model only; multimodal inputs are not supported")
        n = len(input_tokens)
        return torch.arange(n, dtype=torch.int64).expand(max(self._mrope_dims, 1), n).clone(), 0

    # -- weights -----------------------------------------------------------------------------------
    def titan_parameters(self) -> dict[str, tuple[str, nn.Parameter]]:
        """titan parameter name -> (name in this vLLM module, parameter)."""
        out: dict[str, tuple[str, nn.Parameter]] = {}
        for name, p in self.model.named_parameters():
            out[_WRAPPED_GDN.sub(r"\1.", name)] = (f"model.{name}", p)
        return out

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Strict: the whole checkpoint goes through the titan adapter, which raises on any missing,
        unexpected or misshapen tensor (vision tower and MTP head are skipped by the adapter)."""
        hf_sd: dict[str, torch.Tensor] = {}
        for name, t in weights:
            if name in hf_sd:
                raise CheckpointMismatchError(f"tensor {name!r} appears twice in the checkpoint")
            hf_sd[name] = t
        sd = self.adapter.from_hf(hf_sd)
        params = self.titan_parameters()
        # a base checkpoint has no adapter tensors: those stay as built (the identity) when it lacks them
        missing = sorted(k for k in set(params) - set(sd) if not is_lora_param(k))
        unexpected = sorted(set(sd) - set(params))
        if missing or unexpected:
            raise CheckpointMismatchError(f"titan parameters missing {missing[:10]}, unexpected {unexpected[:10]}")
        loaded: set[str] = set()
        for key, t in sd.items():
            name, p = params[key]
            if p.shape != t.shape:
                raise CheckpointMismatchError(f"{key}: checkpoint {tuple(t.shape)} vs model {tuple(p.shape)}")
            p.copy_(t)
            loaded.add(name)
        logger.info("titan: loaded %d tensors for %s", len(loaded), self.architecture)
        # adapters the checkpoint lacks are initialised (the identity, ``__init__``): reported as loaded, since vLLM
        # refuses a model with parameters the loader did not account for
        loaded |= {name for key, (name, _) in params.items() if key not in sd and is_lora_param(key)}
        return loaded


class TitanHybridForCausalLM(TitanForCausalLM, compat.HasInnerState, compat.IsHybrid):
    """Qwen3.5 (Gated DeltaNet + attention): declares its state layout to vLLM's cache allocator."""

    @classmethod
    def _gdn_config(cls, vllm_config: compat.VllmConfig) -> Any:
        return config_from_hf(vllm_config.model_config.hf_config.to_dict()).gdn

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: compat.VllmConfig) -> tuple[tuple[int, ...], ...]:
        return gdn_state_shapes(cls._gdn_config(vllm_config))

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: compat.VllmConfig) -> tuple[torch.dtype, ...]:
        return gdn_state_dtypes(vllm_config)

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple[Any, ...]:
        return compat.gdn_state_copy_funcs(grid=grid_state())
