"""torchtitan model configs from HF checkpoint configs, for torchtitan's own Qwen3 and Llama 3 definitions.

A spec is named like its package (``torchtitan.models.qwen3``; ``qwen3`` and ``torchtitan.models.qwen3:<attr>``
are accepted too). The model is built with torchtitan's public config helpers (``make_gqa_config``,
``make_ffn_config``) from the checkpoint's dimensions; its ``inner_attention`` is a placeholder that the caller
replaces in every attention module (the paged-KV kernel in vLLM, the packed kernel in the trainer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
import torch.nn as nn

from titan_rl_ext.compat import patch_torch_for_torchtitan

SPEC_KEY = "titan_model_spec"
"""The HF-config key (set with ``--hf-overrides``) that names the torchtitan spec to serve."""

# spec -> the HF architecture its adapter reads
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama3": "LlamaForCausalLM"}

# specs the generic path cannot serve, and why (what the plugin would have to manage that it does not)
UNSERVABLE = {
    "qwen3_5": "its GatedDeltaNet layers (linear_attn) take no initial recurrent state and return no final "
               "state, so a decode step cannot continue a sequence; serve Qwen3.5 with the project's own "
               "definition (--model-impl titan without titan_model_spec)",
    "deepseek_v3": "its MLA attention keeps a compressed latent KV that vLLM's paged cache layout for "
                   "inner_attention (per-head keys and values) does not hold, and its MoE routing is not built here",
    "gpt_oss": "its attention sinks and sliding windows are not expressed through inner_attention's arguments",
}
# module classes a served model may contain: everything that holds state across tokens goes through
# inner_attention (whose KV vLLM pages); anything else could keep state the plugin does not manage
SERVABLE_MODULES = {
    "Qwen3Model", "Llama3Model", "Decoder", "ModuleDict", "ModuleList", "Qwen3TransformerBlock",
    "Llama3TransformerBlock", "TransformerBlock", "GQAttention", "QKVLinear", "FusedQKVLinear", "Linear",
    "Embedding", "RMSNorm", "CosSinRoPE", "ComplexRoPE", "FeedForward",
}


class UnservableSpec(ValueError):
    """A spec, or a module in it, that the plugin cannot serve; the message names which and why."""


def spec_name(value: str) -> str:
    """``torchtitan.models.qwen3`` / ``qwen3`` / ``torchtitan.models.qwen3:model_registry`` -> ``qwen3``."""
    name = value.split(":", 1)[0].strip()
    if name.startswith("torchtitan.models."):
        name = name[len("torchtitan.models."):]
    if name in UNSERVABLE:
        raise UnservableSpec(f"{SPEC_KEY}={value!r}: torchtitan.models.{name} cannot be served: {UNSERVABLE[name]}")
    if name not in ARCHITECTURES:
        raise UnservableSpec(f"{SPEC_KEY}={value!r}: no HF-config builder for it; servable torchtitan specs: "
                             + ", ".join(f"torchtitan.models.{n}" for n in ARCHITECTURES))
    return name


def check_architecture(name: str, architecture: str) -> None:
    if ARCHITECTURES[name] != architecture:
        raise UnservableSpec(f"torchtitan.models.{name} loads {ARCHITECTURES[name]} checkpoints; this one is {architecture}")


def _rope_theta(hf: Mapping[str, Any]) -> float:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", None):
        raise UnservableSpec(f"rope_type {rope_type!r} is not built here (only the default rotary embedding)")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise UnservableSpec("the checkpoint's config has no rope_theta")
    return float(theta)


def _check_plain(hf: Mapping[str, Any]) -> None:
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise UnservableSpec(f"{key}=True is not built here")
    if hf.get("sliding_window") and hf.get("use_sliding_window", True):
        raise UnservableSpec("sliding-window attention is not built here")


def model_config(name: str, hf: Mapping[str, Any], max_seq_len: int | None = None) -> Any:
    """The torchtitan ``Qwen3Model.Config`` / ``Llama3Model.Config`` with the checkpoint's dimensions.
    ``max_seq_len`` (default: ``max_position_embeddings``) sizes the rotary cache."""
    patch_torch_for_torchtitan()  # torchtitan's model packages import names torch 2.11 lacks
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config

    _check_plain(hf)
    dim, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    n_kv = int(hf.get("num_key_value_heads") or n_heads)
    head_dim = int(hf.get("head_dim") or dim // n_heads)
    vocab, eps = int(hf["vocab_size"]), float(hf.get("rms_norm_eps", 1e-6))
    seq = int(max_seq_len or hf.get("max_position_embeddings") or 4096)
    init = {"weight": partial(nn.init.normal_, std=0.02)}
    ones = {"weight": nn.init.ones_}

    def norm(d: int) -> Any:
        return RMSNorm.Config(normalized_shape=d, eps=eps, param_init=ones)

    if name == "qwen3":
        from torchtitan.models.qwen3.model import Qwen3Model as M, Qwen3TransformerBlock as Block

        rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=seq, theta=_rope_theta(hf))
        qk_norm: Any = norm(head_dim)
    else:
        from torchtitan.models.llama3.model import Llama3Model as M, Llama3TransformerBlock as Block

        rope = ComplexRoPE.Config(dim=head_dim, max_seq_len=seq, theta=_rope_theta(hf))
        qk_norm = None
    attention = make_gqa_config(
        dim=dim, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim if name == "qwen3" else None,
        wqkv_param_init=init, wo_param_init=init, inner_attention=ScaledDotProductAttention.Config(),
        rope=rope, fuse_qkv=False, **({"qk_norm": qk_norm} if qk_norm is not None else {}),
    )
    layers = [Block.Config(attention_norm=norm(dim), ffn_norm=norm(dim), attention=attention,
                           feed_forward=make_ffn_config(dim=dim, hidden_dim=int(hf["intermediate_size"]),
                                                        w1_param_init=init, w2w3_param_init=init))
              for _ in range(int(hf["num_hidden_layers"]))]
    fields = {f.name for f in dataclasses.fields(M.Config)}
    extra = {"enable_weight_tying": bool(hf.get("tie_word_embeddings", False))} if "enable_weight_tying" in fields else {}
    if not extra and hf.get("tie_word_embeddings"):
        raise UnservableSpec(f"torchtitan.models.{name} has no tied-embedding option; the checkpoint ties them")
    return M.Config(
        dim=dim, vocab_size=vocab, norm=norm(dim), layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=init),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=init), **extra,
    )


def adapter(name: str, cfg: Any) -> Any:
    """The spec's own state-dict adapter (HF keys <-> torchtitan keys)."""
    patch_torch_for_torchtitan()
    if name == "qwen3":
        from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter as A
    else:
        from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter as A
    return A(cfg, None)


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, module) of every module with an ``inner_attention`` slot."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "inner_attention")]


def servability_problems(model: nn.Module) -> list[str]:
    """Modules of a built model the generic path cannot vouch for: each could keep state across tokens
    that neither vLLM's paged KV nor the plugin manages."""
    problems = []
    for path, m in model.named_modules():
        cls = type(m).__name__
        if hasattr(m, "inner_attention") or path.endswith(".inner_attention") or cls in SERVABLE_MODULES:
            continue
        problems.append(f"{path or '(root)'} ({type(m).__module__}.{cls}): not a module the plugin knows to be "
                        "stateless across tokens")
    return problems


def build(name: str, hf: Mapping[str, Any], device: torch.device | str | None = None, max_seq_len: int | None = None) -> tuple[nn.Module, Any]:
    """(torchtitan model with placeholder inner attentions, its state-dict adapter). On ``meta`` the
    parameters are left unmaterialised (the caller loads a checkpoint into ``to_empty`` storage); the
    rotary cache is always real."""
    cfg = model_config(name, hf, max_seq_len)
    model = cfg.build()
    if problems := servability_problems(model):
        raise UnservableSpec(f"torchtitan.models.{name}: " + "; ".join(problems))
    if device is not None:
        model = model.to(device)
    return model, adapter(name, cfg)
