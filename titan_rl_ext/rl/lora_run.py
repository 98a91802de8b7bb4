"""LoRA in an RL run (``rl.lora_rank > 0``): what the trainer does differently, in one place.

- set-up (``setup_lora``): the run's ``LoRAConfig`` goes into the model config the trainer builds (adapters on
  ``rl.lora_targets``, base frozen: torchtitan's optimizer then holds the adapters alone) and, for a spawned
  generator, into its ``--hf-overrides`` (the titan model's ``titan_lora`` setting), so both sides serve the same
  adapters; what could not run exactly or at all stops the run here, before any model is built;
- loading (``check_loaded``): the base checkpoint has no adapters, so the load is non-strict, and anything missing
  besides the adapters (or unexpected) is still an error;
- admitting generators (``generator_problem``): each must serve these adapters over the trainer's base bit for
  bit, since an adapter-only run never pushes a base;
- pushing (``push_payload``): the adapter tensors alone, which the server takes all or none
  (``vllm_titan_plugin.swap.validate.push_spec``);
- exporting (``export_adapter``): PEFT's format, for the base checkpoint ``rl.model_dir``.

The trainer (``rl/trainer.py``) calls these at the matching points and otherwise does not know about LoRA.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from titan_rl_ext.models.common.lora import LoRAConfig
    from titan_rl_ext.rl.weight_sync import WeightPusher

logger = logging.getLogger(__name__)


def with_hf_override(args: list[str], key: str, value: Any) -> list[str]:
    """``args`` (vLLM server arguments) with ``key: value`` in their ``--hf-overrides`` JSON (added if absent)."""
    out = list(args)
    for i, a in enumerate(out):
        if a == "--hf-overrides" and i + 1 < len(out):
            out[i + 1] = json.dumps({**json.loads(out[i + 1]), key: value})
            return out
        if a.startswith("--hf-overrides="):
            out[i] = "--hf-overrides=" + json.dumps({**json.loads(a.partition("=")[2]), key: value})
            return out
    return [*out, "--hf-overrides", json.dumps({key: value})]


def setup_lora(config: Any) -> LoRAConfig | None:
    """The run's ``LoRAConfig`` (None: full fine-tuning), put into the model config the trainer builds
    (``config``: an ``RLTrainer.Config``) and into a spawned generator's arguments. Refuses what could not run
    exactly or at all, naming why."""
    from titan_rl_ext.models.common.lora import HF_CONFIG_KEY

    rl = config.rl
    lora = rl.lora()  # LoRAConfigError: dropout, rank, unknown targets
    if lora is None:
        if rl.export_adapter_dir:
            raise ValueError("rl.export_adapter_dir needs a LoRA run (rl.lora_rank > 0)")
        return None
    if rl.server_model_impl != "titan":
        raise ValueError(f"LoRA needs generators running --model-impl titan (the adapters are titan modules); "
                         f"rl.server_model_impl is {rl.server_model_impl!r}")
    if rl.export_hf_dir:
        raise ValueError("rl.export_hf_dir writes a full checkpoint; a LoRA run exports its adapter: use "
                         "rl.export_adapter_dir (PEFT format, for the base checkpoint rl.model_dir)")
    model_cfg = config.model_spec.model
    model_cfg.arch = dataclasses.replace(model_cfg.arch, lora=lora)
    if rl.spawn_server:
        rl.server_args = with_hf_override(rl.server_args, HF_CONFIG_KEY, lora.to_hf())
    return lora


def log_trainable(lora: LoRAConfig, model: torch.nn.Module) -> None:
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    logger.info("RL: LoRA %s: %d adapter tensors (%.2f M parameters) train, the base is frozen", lora,
                len(trainable), sum(p.numel() for _, p in trainable) / 1e6)


def check_loaded(result: Any, model_dir: str) -> None:
    """After a non-strict load of the base checkpoint (``result``: its missing and unexpected keys): only the
    adapters may be missing (they keep the fresh init torchtitan's ``init_weights`` gave them)."""
    from titan_rl_ext.models.common.lora import is_lora_param
    from titan_rl_ext.models.common.state_dict_adapter import CheckpointMismatchError

    bad = [k for k in result.missing_keys if not is_lora_param(k)] + list(result.unexpected_keys)
    if bad:
        raise CheckpointMismatchError(f"{model_dir} does not fit the LoRA model: {bad[:10]}")


def generator_problem(lora: LoRAConfig, model_dir: str, pusher: WeightPusher, ours: Mapping[str, str],
                      served: Mapping[str, Any]) -> str | None:
    """Rank 0: why a generator cannot take this run's adapter-only pushes (None: all can). Each must serve these
    adapters (same names: the same ``titan_lora`` setting) over the trainer's base weights (``ours``: the
    trainer's per-tensor checksums) bit for bit."""
    from titan_rl_ext.models.common.lora import HF_CONFIG_KEY, is_lora_param

    adapters = {k for k in ours if is_lora_param(k)}
    for url in served:
        try:
            theirs = pusher.checksums(url)
        except Exception as e:  # noqa: BLE001 -- reported as the reason
            return f"LoRA: cannot read the checksums of {url} ({type(e).__name__}: {e})"
        if {k for k in theirs if is_lora_param(k)} != adapters:
            return (f"LoRA: {url} does not serve this run's adapters; start it with --model-impl titan "
                    f"--hf-overrides '{json.dumps({HF_CONFIG_KEY: lora.to_hf()})}'")
        base = sorted(k for k in ours if k not in adapters and theirs.get(k) != ours[k])
        if base:
            return (f"LoRA: {url} serves other base weights than the trainer's ({len(base)} tensors differ, e.g. "
                    f"{base[:3]}); an adapter-only run never pushes the base: serve the checkpoint {model_dir}")
    return None


def push_payload(state_dict: dict[str, torch.Tensor], lora: LoRAConfig | None) -> dict[str, torch.Tensor]:
    """What a push carries: the whole served state dict, or with LoRA the adapter tensors alone (the base never
    moves)."""
    if lora is None:
        return state_dict
    from titan_rl_ext.models.common.lora import lora_state_dict

    return lora_state_dict(state_dict)


def export_adapter(full_state_dict: dict[str, torch.Tensor], lora: LoRAConfig, arch: Any, model_dir: str,
                   out_dir: str) -> None:
    """Rank 0: the adapters of ``full_state_dict`` (gathered by every rank) in PEFT's format for the base
    checkpoint ``model_dir``."""
    from titan_rl_ext.models.common.lora import lora_state_dict
    from titan_rl_ext.models.hf import adapter_for, read_config
    from titan_rl_ext.models.peft_adapter import save_peft_adapter_tensors

    hf_adapter = adapter_for(read_config(model_dir), arch)
    save_peft_adapter_tensors(lora_state_dict(full_state_dict), lora, hf_adapter, out_dir,
                              base_model_name_or_path=model_dir)
