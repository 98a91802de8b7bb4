"""HF checkpoint directories -> titan models: config, state-dict adapter (by the table in ``models.architectures``), safetensors I/O."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from titan_rl_ext.models.architectures import architecture_of
from titan_rl_ext.models.common.decoder import Decoder, DecoderConfig
from titan_rl_ext.models.common.lora import is_lora_param, reset_lora
from titan_rl_ext.models.common.state_dict_adapter import CheckpointMismatchError, HFStateDictAdapter


def config_from_hf(hf_config: dict[str, Any]) -> DecoderConfig:
    return architecture_of(hf_config).family.config_class().from_hf(hf_config)


def adapter_for(hf_config: dict[str, Any], cfg: DecoderConfig) -> HFStateDictAdapter:
    arch = architecture_of(hf_config)
    return arch.family.adapter_class()(cfg, layout=arch.layout)


def read_config(model_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(model_dir) / "config.json").read_text())


def read_safetensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        part = load_file(str(f))
        dup = set(part) & set(sd)
        if dup:
            raise CheckpointMismatchError(f"tensors stored twice across shards: {sorted(dup)[:10]}")
        sd.update(part)
    return sd


def load_hf_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    **overrides: Any,
) -> tuple[Decoder, HFStateDictAdapter]:
    """Build the titan model for an HF checkpoint directory and load its weights strictly.

    ``overrides`` set config fields (e.g. ``gdn_mode="recurrent"``)."""
    hf_config = read_config(model_dir)
    cfg = config_from_hf(hf_config)
    for k, v in overrides.items():
        if not hasattr(cfg, k):
            raise AttributeError(f"{type(cfg).__name__} has no field {k!r}")
        setattr(cfg, k, v)
    adapter = adapter_for(hf_config, cfg)
    sd = adapter.from_hf(read_safetensors(model_dir))
    with torch.device("meta"):
        model = cfg.build()
    model.to_empty(device=device)
    if cfg.lora is None:
        model.load_state_dict(sd, strict=True, assign=False)
    else:  # the base checkpoint has no adapters: they start fresh (``models.peft_adapter`` loads trained ones)
        result = model.load_state_dict(sd, strict=False, assign=False)
        bad = [k for k in result.missing_keys if not is_lora_param(k)] + list(result.unexpected_keys)
        if bad:
            raise CheckpointMismatchError(f"checkpoint does not fit the LoRA model: {bad[:10]}")
        reset_lora(model)
    model.to(dtype)
    model.rope.reset_parameters()  # inv_freq stays fp32 whatever the model dtype (as in training and vLLM)
    return model, adapter


def save_hf(model: Decoder, adapter: HFStateDictAdapter, out_dir: str | Path) -> None:
    from safetensors.torch import save_file

    sd = adapter.to_hf({k: v.detach().contiguous() for k, v in model.state_dict().items()})
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    save_file(sd, str(Path(out_dir) / "model.safetensors"))
