"""Training recipes: zero-argument functions returning a torchtitan ``Trainer.Config``.

    torchrun --standalone --nproc_per_node=1 -m torchtitan.train --module titan_rl_ext --config qwen3_5_debug

(torchtitan resolves ``--module titan_rl_ext`` to ``titan_rl_ext.config_registry``.) Any field can
be overridden on the command line, e.g. ``--training.steps 20``.

This module holds the pre-training debug recipes; the RL recipes (``RLTrainer.Config``, run with
``-m titan_rl_ext.train --module titan_rl_ext.configs --config <name>``) live one family a module and are imported
at the bottom, so torchtitan finds every ``--config`` name here: ``rl_cpu`` (the tiny CPU recipes), ``rl_demo``
(the README demo), ``rl_gpu`` (one GPU, trainer and generator side by side), ``rl_long`` (long answers), ``rl_lora``
(LoRA), ``rl_dapo_math`` (Qwen3.5-9B on DAPO-Math), over the shared builders in ``rl_common``. A new recipe is a
function in its family's module (or a new module) and one import line below.
"""

from __future__ import annotations

from typing import Any

from titan_rl_ext.configs.tiny_data import TINY_DATASET, register_tiny_dataset, tiny_tokenizer_dir
from titan_rl_ext.paths import cache_dir


def _debug_trainer(model_spec: Any) -> Any:
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import DebugConfig, TrainingConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.trainer import Trainer

    register_tiny_dataset()
    optimizer = default_adamw(lr=3e-3)
    optimizer.implementation = "foreach"  # "fused" is CUDA-only
    return Trainer.Config(
        model_spec=model_spec,
        loss=CrossEntropyLoss.Config(),
        hf_assets_path=tiny_tokenizer_dir(),
        dataloader=HuggingFaceTextDataLoader.Config(dataset=TINY_DATASET),
        optimizer=optimizer,
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=2),
        training=TrainingConfig(local_batch_size=4, seq_len=128, steps=10, disable_cuda_graphs=True,
                                mixed_precision_param="float32"),  # CPU: fp32 throughout, no FSDP cast
        metrics=MetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        checkpoint=CheckpointManager.Config(enable=False),
        debug=DebugConfig(seed=0),
        dump_folder=str(cache_dir() / "outputs"),
    )


def qwen3_5_debug() -> Any:
    """Tiny hybrid Qwen3.5 (GDN + gated attention) pretraining smoke run on CPU."""
    from titan_rl_ext.models.qwen3_5 import model_registry

    return _debug_trainer(model_registry("qwen3_5-debug"))


def qwen3_5_moe_debug() -> Any:
    from titan_rl_ext.models.qwen3_5 import model_registry

    return _debug_trainer(model_registry("qwen3_5-moe-debug"))


def qwen3_debug() -> Any:
    from titan_rl_ext.models.qwen3 import model_registry

    return _debug_trainer(model_registry("qwen3-debug"))


# the RL recipes, one family a module (their shared builders in ``rl_common``); each name here is a ``--config``
from titan_rl_ext.configs.rl_cpu import rl_search_cpu, rl_terminal_cpu, rl_tiny_cpu, rl_verifiers_cpu  # noqa: E402,F401
from titan_rl_ext.configs.rl_dapo_math import qwen3_5_9b_dapo_math  # noqa: E402,F401
from titan_rl_ext.configs.rl_demo import rl_demo_cpu  # noqa: E402,F401
from titan_rl_ext.configs.rl_gpu import rl_gpu_hybrid, rl_gpu_hybrid_toy, rl_native_cpu  # noqa: E402,F401
from titan_rl_ext.configs.rl_long import rl_gpu_long, rl_gpu_long_toy  # noqa: E402,F401
from titan_rl_ext.configs.rl_lora import rl_lora_9b, rl_lora_toy  # noqa: E402,F401
