"""What every RL recipe (``RLTrainer.Config``) is built from: the trainer config around an ``RLConfig``
(``_rl_trainer``), the CPU recipes' ``RLConfig`` (``_tiny_rl_config``), the tiny checkpoint they start from
(``tiny_rl_checkpoint``), a ``ModelSpec`` read from an HF checkpoint (``model_spec_from_hf``), a checkpoint built
and warmed up once into ``cache_dir()`` (``_built_and_warmed``) and a server flag set (``_set_arg``).

The recipe families (``rl_cpu``, ``rl_dapo_math``, ``rl_demo``, ``rl_gpu``, ``rl_long``, ``rl_lora``) import this
module and it imports none of them; ``titan_rl_ext.configs`` hands their recipes to ``--config``. Heavy imports
(torchtitan, the trainer, the model code) stay inside the functions: the module imports with torch alone, and
building a recipe never touches the network (a missing checkpoint is built into ``cache_dir()``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from titan_rl_ext.configs.tiny_data import TINY_DATASET, register_tiny_dataset
from titan_rl_ext.paths import cache_dir


def tiny_rl_checkpoint(tool_tokens: bool = False) -> str:
    """The tiny Qwen3.5 (VLM layout) checkpoint the CPU RL demo starts from (built once, cached).
    ``tool_tokens``: a text-layout one whose tokenizer also has Qwen3's think/tool special tokens, for
    verifiers' Qwen3 renderer (the VLM layout's tokenizer class defaults its unknown token to one the
    renderer needs)."""
    from titan_rl_ext.tools.make_tiny import make_tiny
    from titan_rl_ext.tools.tiny_tokenizer import add_qwen3_tool_tokens

    d = cache_dir() / ("rl_tiny_qwen3_5_tools" if tool_tokens else "rl_tiny_qwen3_5")
    if not (d / "config.json").exists() or not list(d.glob("*.safetensors")):
        make_tiny("qwen3_5", d, seed=0, layout="text" if tool_tokens else "vlm")
        if tool_tokens:
            add_qwen3_tool_tokens(d)
    return str(d)


def model_spec_from_hf(model_dir: str) -> Any:
    """A torchtitan ``ModelSpec`` whose architecture is read from an HF checkpoint's config.json."""
    from titan_rl_ext.models.architectures import architecture_of
    from titan_rl_ext.models.common.titan_protocol import make_model_spec
    from titan_rl_ext.models.hf import config_from_hf, read_config

    hf = read_config(model_dir)
    family = architecture_of(hf).family  # an architecture outside the table fails here, naming the supported ones
    return make_model_spec(family.name, "hf:" + Path(model_dir).name, config_from_hf(hf), family.adapter_class())


def _rl_trainer(model_spec: Any, hf_dir: str, rl: Any, *, steps: int, lr: float, warmup: int,
                batch_invariant: bool, dump: str, checkpoint_interval: int) -> Any:
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import DebugConfig, TrainingConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    from titan_rl_ext.rl.trainer import RLTrainer

    register_tiny_dataset()  # torchtitan builds a text dataloader; RL never reads it
    model_spec.model.batch_invariant = batch_invariant
    optimizer = default_adamw(lr=lr)
    optimizer.implementation = "foreach"  # "fused" is CUDA-only
    return RLTrainer.Config(
        model_spec=model_spec,
        loss=CrossEntropyLoss.Config(),
        hf_assets_path=hf_dir,
        dataloader=HuggingFaceTextDataLoader.Config(dataset=TINY_DATASET),
        optimizer=optimizer,
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=warmup),
        # compute in the stored dtype (fp32 here): torchtitan's default mixed_precision_param is bf16, which would
        # put FSDP's bf16 cast between these fp32 recipes and their fp32 generators
        training=TrainingConfig(local_batch_size=1, seq_len=64, steps=steps, max_norm=1.0, disable_cuda_graphs=True,
                                mixed_precision_param="float32"),
        metrics=MetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        checkpoint=CheckpointManager.Config(enable=False, interval=checkpoint_interval, last_save_model_only=False),
        debug=DebugConfig(seed=0),
        dump_folder=dump,
        rl=rl,
    )


def _tiny_rl_config(hf_dir: str, **changes: Any) -> Any:
    """The CPU recipes' ``RLConfig``: a spawned fp32 server, 4 prompts x G=8, 4 new tokens, off-policy
    window 2, DAPO, batch invariant on both sides for the whole run; ``changes`` override fields."""
    from titan_rl_ext.rl.config import RLConfig
    from titan_rl_ext.rl.losses import loss_config

    base = RLConfig(
        spawn_server=True,
        server_args=["--dtype", "float32", "--max-model-len", "512", "--seed", "0"],
        model_dir=hf_dir,
        task="synthetic_sum",
        prompts_per_step=4,
        group_size=8,
        max_tokens=4,
        temperature=1.0,
        offpolicy=2,
        num_producers=4,
        loss=loss_config("dapo"),
        batch_invariant_steps=1_000_000,  # the whole run
        run_dir="",
    )
    return dataclasses.replace(base, **changes)


def _built_and_warmed(name: str, shape: dict[str, Any], toy: bool, warm_name: str,
                      warm: Callable[[Path, Path, str], Any]) -> str:
    """``cache_dir()/<name>_init`` (``make_tiny`` of ``shape``, HF's own initialisation; ``toy``: the tiny shape
    with noise) and its warm-up ``cache_dir()/<warm_name>`` by ``warm(init, out, device)``, each built once, on
    the GPU when there is one."""
    import torch

    from titan_rl_ext.tools.make_tiny import make_tiny

    device = "cuda" if torch.cuda.is_available() else "cpu"
    init = cache_dir() / f"{name}_init"
    if not (init / "config.json").exists():
        make_tiny("qwen3_5", init, seed=0, layout="vlm", device=device, noise=0.1 if toy else 0.0, **shape)
    out = cache_dir() / warm_name
    if not (out / "warmup.json").exists():
        warm(init, out, device)
    return str(out)


def _set_arg(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with ``flag``'s value replaced, or the pair appended."""
    out = list(args)
    if flag in out:
        out[out.index(flag) + 1] = value
    else:
        out += [flag, value]
    return out
