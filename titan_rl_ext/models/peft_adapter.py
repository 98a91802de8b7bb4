"""LoRA adapters in and out in HF PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``.

PEFT saves a LoRA on module ``M`` (its name in the HF model) as ``base_model.model.M.lora_A.weight`` ``[r, in]``
and ``base_model.model.M.lora_B.weight`` ``[out, r]`` (the adapter name is stripped on save:
``BaseTuner._remove_adapter_name_from_key``). The titan adapter of a projection maps onto ``M`` through the
model's state-dict adapter (``HFStateDictAdapter.hf_modules``: a merged titan linear's part ``j`` is the ``j``-th
HF projection), so the file names the modules of the checkpoint the base was loaded from, text
(``model.layers.*``) or VLM (``model.language_model.layers.*``) layout alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from titan_rl_ext.models.common.lora import LoRAConfig, LoRAConfigError, lora_modules
from titan_rl_ext.models.common.state_dict_adapter import CheckpointMismatchError, HFStateDictAdapter

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_PREFIX = "base_model.model."

# adapter_config.json fields whose non-default value changes the computation this model does not do
_MUST_BE = {"use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "bias": "none", "modules_to_save": None,
            "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}, "use_qalora": False}


def to_peft_config(cfg: LoRAConfig, base_model_name_or_path: str | None = None) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted(cfg.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }


def from_peft_config(peft: dict[str, Any]) -> LoRAConfig:
    """The ``LoRAConfig`` of an ``adapter_config.json``; refuses what this model would compute differently."""
    if peft.get("peft_type") != "LORA":
        raise LoRAConfigError(f"not a LoRA adapter: peft_type {peft.get('peft_type')!r}")
    odd = {k: peft[k] for k, ok in _MUST_BE.items() if peft.get(k, ok) not in (ok, None, {})}
    if odd:
        raise LoRAConfigError(f"adapter settings not supported (this model computes plain LoRA only): {odd}")
    targets = peft.get("target_modules")
    if not isinstance(targets, list):
        raise LoRAConfigError(f"target_modules must be a list of module names, got {targets!r}")
    return LoRAConfig(rank=int(peft["r"]), alpha=float(peft["lora_alpha"]), targets=tuple(targets),
                      dropout=float(peft.get("lora_dropout", 0.0)))


def _peft_keys(path: str, hf_adapter: HFStateDictAdapter) -> tuple[str, str]:
    """PEFT keys (A, B) of the titan adapter at ``path`` (``layers.0.attention.wqkv.lora.1``)."""
    module, _, part = path.rpartition(".lora.")
    hf = hf_adapter.hf_modules(module)[int(part)]
    return f"{_PREFIX}{hf}.lora_A.weight", f"{_PREFIX}{hf}.lora_B.weight"


def adapter_state_dict(model: torch.nn.Module, hf_adapter: HFStateDictAdapter) -> dict[str, torch.Tensor]:
    """The model's adapters under PEFT's keys."""
    out: dict[str, torch.Tensor] = {}
    for path, m in lora_modules(model).items():
        ka, kb = _peft_keys(path, hf_adapter)
        out[ka], out[kb] = m.lora_A.detach(), m.lora_B.detach()
    return out


def _write(sd: dict[str, torch.Tensor], cfg: LoRAConfig, out_dir: str | Path, base_model_name_or_path: str | None) -> Path:
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to("cpu").contiguous() for k, v in sd.items()}, str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    (out / CONFIG_NAME).write_text(json.dumps(to_peft_config(cfg, base_model_name_or_path), indent=2) + "\n")
    return out


def save_peft_adapter(
    model: torch.nn.Module, hf_adapter: HFStateDictAdapter, out_dir: str | Path, base_model_name_or_path: str | None = None
) -> Path:
    cfg: LoRAConfig | None = getattr(model.config, "lora", None)  # type: ignore[union-attr]
    if cfg is None:
        raise ValueError("the model has no LoRA adapters")
    return _write(adapter_state_dict(model, hf_adapter), cfg, out_dir, base_model_name_or_path)


def save_peft_adapter_tensors(
    lora_sd: dict[str, torch.Tensor], cfg: LoRAConfig, hf_adapter: HFStateDictAdapter, out_dir: str | Path,
    base_model_name_or_path: str | None = None,
) -> Path:
    """``save_peft_adapter`` from the adapter tensors under their titan names (``layers.0.attention.wqkv.lora.1.
    lora_A``), e.g. gathered from a sharded trainer, rather than from a model's modules."""
    out: dict[str, torch.Tensor] = {}
    for name, t in lora_sd.items():
        path, _, which = name.rpartition(".")
        if which not in ("lora_A", "lora_B") or ".lora." not in path:
            raise ValueError(f"{name!r} is not a LoRA adapter tensor")
        ka, kb = _peft_keys(path, hf_adapter)
        out[ka if which == "lora_A" else kb] = t.detach()
    return _write(out, cfg, out_dir, base_model_name_or_path)


@torch.no_grad()
def load_peft_adapter(model: torch.nn.Module, hf_adapter: HFStateDictAdapter, adapter_dir: str | Path) -> None:
    """Copy a PEFT adapter into a model built with the same ``LoRAConfig``. Strict: every adapter of the model
    gets a tensor of its shape and every tensor of the file is used, or nothing is copied."""
    from safetensors.torch import load_file

    d = Path(adapter_dir)
    want = from_peft_config(json.loads((d / CONFIG_NAME).read_text()))
    have: LoRAConfig | None = getattr(model.config, "lora", None)  # type: ignore[union-attr]
    if have is None or (have.rank, have.alpha, set(have.targets)) != (want.rank, want.alpha, set(want.targets)):
        raise LoRAConfigError(f"adapter in {d} is {want}; the model was built with {have}")
    sd = load_file(str(d / WEIGHTS_NAME))
    plan: list[tuple[torch.Tensor, torch.Tensor]] = []
    used: set[str] = set()
    bad: list[str] = []
    for path, m in lora_modules(model).items():
        for key, p in zip(_peft_keys(path, hf_adapter), (m.lora_A, m.lora_B)):
            t = sd.get(key)
            if t is None or t.shape != p.shape:
                bad.append(f"{key}: {'missing' if t is None else f'{tuple(t.shape)} vs model {tuple(p.shape)}'}")
                continue
            plan.append((p, t))
            used.add(key)
    bad += [f"{k}: unexpected" for k in sorted(set(sd) - used)]
    if bad:
        raise CheckpointMismatchError(f"adapter in {d} does not fit the model -- {'; '.join(bad[:20])}")
    for p, t in plan:
        p.copy_(t)

