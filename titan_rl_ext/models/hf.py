"""HF checkpoint directories -> titan models: architecture dispatch, safetensors I/O."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from titan_rl_ext.models.common.decoder import Decoder, DecoderConfig
from titan_rl_ext.models.common.state_dict_adapter import CheckpointMismatchError, HFStateDictAdapter

# architecture -> (family, key layout of its checkpoints)
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "Qwen3ForCausalLM": ("qwen3", "text"),
    "Qwen3MoeForCausalLM": ("qwen3", "text"),
    "Qwen3_5ForCausalLM": ("qwen3_5", "text"),
    "Qwen3_5ForConditionalGeneration": ("qwen3_5", "vlm"),
    "Qwen3_5MoeForCausalLM": ("qwen3_5", "text"),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_5", "vlm"),
}


class UnsupportedArchitectureError(ValueError):
    pass


def architecture_of(hf_config: dict[str, Any]) -> str:
    archs = hf_config.get("architectures") or []
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {archs or '(none given)'}; titan supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return archs[0]


def config_from_hf(hf_config: dict[str, Any]) -> DecoderConfig:
    family, _ = SUPPORTED_ARCHITECTURES[architecture_of(hf_config)]
    if family == "qwen3":
        from titan_rl_ext.models.qwen3.model import Qwen3Config

        return Qwen3Config.from_hf(hf_config)
    from titan_rl_ext.models.qwen3_5.model import Qwen3_5Config

    return Qwen3_5Config.from_hf(hf_config)


def adapter_for(hf_config: dict[str, Any], cfg: DecoderConfig) -> HFStateDictAdapter:
    family, layout = SUPPORTED_ARCHITECTURES[architecture_of(hf_config)]
    if family == "qwen3":
        from titan_rl_ext.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

        return Qwen3StateDictAdapter(cfg)
    from titan_rl_ext.models.qwen3_5.state_dict_adapter import Qwen3_5StateDictAdapter

    return Qwen3_5StateDictAdapter(cfg, layout=layout)  # type: ignore[arg-type]


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
    model.load_state_dict(sd, strict=True, assign=False)
    model.to(dtype)
    model.rope.reset_parameters()  # inv_freq stays fp32 whatever the model dtype (as in training and vLLM)
    return model, adapter


def save_hf(model: Decoder, adapter: HFStateDictAdapter, out_dir: str | Path) -> None:
    from safetensors.torch import save_file

    sd = adapter.to_hf({k: v.detach().contiguous() for k, v in model.state_dict().items()})
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    save_file(sd, str(Path(out_dir) / "model.safetensors"))
