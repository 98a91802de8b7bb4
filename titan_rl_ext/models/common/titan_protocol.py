"""torchtitan's model protocol for the titan decoder. Imports torchtitan: load it only from
``model_registry`` (the model code itself stays importable with torch alone)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
from torchtitan.protocols import BaseModel
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from titan_rl_ext.models.common.batch import SeqBatch
from titan_rl_ext.models.common.decoder import FULL_ATTENTION, Decoder, DecoderConfig
from titan_rl_ext.models.common.state_dict_adapter import HFStateDictAdapter


def _default_arch() -> DecoderConfig:
    raise ValueError("TitanDecoder.Config needs arch=<DecoderConfig>")


def batch_from_positions(positions_BS: torch.Tensor) -> SeqBatch:
    """torchtitan's text loader packs documents into rows and restarts ``positions`` at 0 for each
    document; every (row, document) becomes its own sequence, so attention and GDN state never
    cross a document boundary."""
    B, S = positions_BS.shape
    flat = positions_BS.reshape(-1)
    starts = (flat == 0) | (torch.arange(B * S, device=flat.device) % S == 0)
    idx = torch.nonzero(starts).flatten()
    cu = torch.cat([idx, torch.tensor([B * S], device=flat.device)]).to(torch.int32)
    lengths = cu[1:] - cu[:-1]
    return SeqBatch(cu, flat, int(lengths.max()))


class TitanDecoder(Decoder, BaseModel):
    """The titan ``Decoder`` under torchtitan's ``BaseModel`` protocol (same parameter names)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseModel.Config):
        arch: DecoderConfig = field(default_factory=_default_arch)
        # Batch-invariant kernels in this process (and, via the environment, in engines it starts):
        # the trainer half of the switch; vLLM workers read TITAN_BATCH_INVARIANT=1.
        batch_invariant: bool = False

        def update_from_config(self, *, config: Any, **kwargs: Any) -> None:
            if config.parallelism.pipeline_parallel_degree > 1:
                raise NotImplementedError("titan models do not implement pipeline parallelism yet")
            if self.batch_invariant:
                from titan_rl_ext.kernels.batch_invariant import set_batch_invariant

                set_batch_invariant(True)

        def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
            a = self.arch
            nparams = sum(p.numel() for p in model.parameters())
            n_emb = a.vocab_size * a.dim
            if a.moe is not None:  # count only the experts a token visits
                per_expert = 3 * a.dim * a.moe.expert_ffn_dim
                inactive = (a.moe.num_experts - a.moe.top_k) * per_expert
                n_moe_layers = sum(a.moe.is_moe_layer(i) for i in range(a.n_layers))
                nparams_active = nparams - inactive * n_moe_layers
            else:
                nparams_active = nparams
            n_full = sum(t == FULL_ATTENTION for t in a.layer_types)
            attn = 12 * n_full * a.n_heads * a.head_dim * seq_len
            return nparams, 6 * (nparams_active - n_emb) + attn

    def __init__(self, config: Config) -> None:
        Decoder.__init__(self, config.arch)

    def forward(  # type: ignore[override]
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, **kwargs: Any
    ) -> torch.Tensor:
        if positions is None:
            return Decoder.forward(self, tokens)
        B, S = tokens.shape
        h, _ = self.hidden(tokens.reshape(-1), batch_from_positions(positions))
        return self.logits(h).view(B, S, -1)

    def init_states(self, *, buffer_device: torch.device | None = None) -> None:
        Decoder.init_weights(self, buffer_device=buffer_device)

    def init_weights(self, **kwargs: Any) -> None:
        self.init_states(buffer_device=kwargs.get("buffer_device"))

    def verify_module_protocol(self) -> None:
        # Layers are plain torch modules (so they run without torchtitan); nothing to verify.
        pass


def compute_dtype(training: Any) -> torch.dtype | None:
    """The dtype FSDP casts the parameters to for compute when it differs from the stored (master) one:
    torchtitan's ``training.mixed_precision_param`` vs ``training.dtype``; None: compute in the stored dtype."""
    param = getattr(training, "mixed_precision_param", None)
    stored = getattr(training, "dtype", "float32")
    return getattr(torch, param) if param and param != stored else None


def parallelize_titan(model: TitanDecoder, *, parallel_dims: Any, training: Any = None, **kwargs: Any) -> nn.Module:
    """Data parallelism only: FSDP2 on every block when there is more than one rank, and on one rank too when
    the config asks for mixed precision (``compute_dtype``: fp32 master weights, bf16 compute, fp32
    gradient reduction)."""
    compute = compute_dtype(training)
    if parallel_dims.world_size == 1 and compute is None:
        return model
    unsupported = [n for n in ("tp", "cp", "pp", "ep", "dp_replicate") if getattr(parallel_dims, f"{n}_enabled", False)]
    if unsupported:
        raise NotImplementedError(f"titan models support FSDP data parallelism only; got {unsupported}")
    if parallel_dims.world_size == 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (1,))
    else:
        # torchtitan 0.3 names the sharding axis by backend: the legacy path folds it into "fsdp", the
        # full_dtensor/spmd_types paths keep "dp_shard" (no cp/tp here, so it is the whole data-parallel axis)
        legacy = getattr(parallel_dims, "spmd_backend", None) not in ("full_dtensor", "spmd_types")
        mesh = parallel_dims.get_mesh("fsdp" if legacy else "dp_shard")
    return apply_fsdp(model, mesh, compute)


def apply_fsdp(model: TitanDecoder, mesh: Any, compute: torch.dtype | None) -> nn.Module:
    """FSDP2 groups: every block, and the root. With ``compute`` (mixed precision), a module that keeps some
    of its own parameters fp32 (``precision.FP32_PARAMS``) gets its children in ``compute`` groups and its own
    parameters in an fp32 group, so that the compute weights are exactly the served bf16 model's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    from titan_rl_ext.models.common.precision import keeps_fp32

    low = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if compute else MixedPrecisionPolicy()
    if compute is not None:
        fp32 = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        for module in [m for m in model.modules() if keeps_fp32(m)]:
            for child in module.children():
                if any(True for _ in child.parameters()):
                    fully_shard(child, mesh=mesh, mp_policy=low)
            fully_shard(module, mesh=mesh, mp_policy=fp32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=low)
    fully_shard(model, mesh=mesh, mp_policy=low)
    # the RL losses reach the model through packed_logits, not forward: gather the root's weights there too
    register_fsdp_forward_method(model, "packed_logits")
    register_fsdp_forward_method(model, "packed_token_logprobs")
    return model


def adapter_class(base: type[HFStateDictAdapter]) -> type[StateDictAdapter]:
    """torchtitan instantiates adapters as ``cls(model_config, hf_assets_path)``."""

    class _Adapter(StateDictAdapter):
        def __init__(self, model_config: TitanDecoder.Config, hf_assets_path: str | None) -> None:
            super().__init__(model_config, hf_assets_path)
            layout = "text"
            if hf_assets_path:
                import json
                from pathlib import Path

                from titan_rl_ext.models.architectures import architecture_of

                cfg_file = Path(hf_assets_path) / "config.json"
                if cfg_file.exists():
                    layout = architecture_of(json.loads(cfg_file.read_text())).layout
            self.inner = base(model_config.arch, layout=layout)  # type: ignore[arg-type]

        def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
            return self.inner.to_hf(state_dict)

        def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
            return self.inner.from_hf(hf_state_dict)

    _Adapter.__name__ = base.__name__ + "ForTorchtitan"
    return _Adapter


def make_model_spec(
    name: str, flavor: str, arch: DecoderConfig, adapter: type[HFStateDictAdapter], **spec_kwargs: Callable[..., Any]
) -> ModelSpec:
    return ModelSpec(
        name=name,
        flavor=flavor,
        model=TitanDecoder.Config(arch=arch),
        parallelize_fn=parallelize_titan,
        pipelining_fn=None,
        post_optimizer_build_fn=None,
        state_dict_adapter=adapter_class(adapter),
        **spec_kwargs,
    )


def flavor_model_spec(family_name: str, flavor: str) -> ModelSpec:
    """torchtitan ``ModelSpec`` of one of a model family's named flavors (``models.architectures``)."""
    from titan_rl_ext.models.architectures import family_named

    family = family_named(family_name)
    flavors = family.flavor_configs()
    if flavor not in flavors:
        raise ValueError(f"unknown {family.name} flavor {flavor!r}; choose from {sorted(flavors)}")
    return make_model_spec(family.name, flavor, flavors[flavor], family.adapter_class())
