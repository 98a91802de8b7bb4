"""Training recipes: zero-argument functions returning a torchtitan ``Trainer.Config``.

    torchrun --standalone --nproc_per_node=1 -m torchtitan.train --module titan_rl_ext --config qwen3_5_debug

(torchtitan resolves ``--module titan_rl_ext`` to ``titan_rl_ext.config_registry``.) Any field can
be overridden on the command line, e.g. ``--training.steps 20``.
"""

from __future__ import annotations

from typing import Any

from titan_rl_ext.paths import cache_dir

TINY_DATASET = "titan_tiny_corpus"


def tiny_tokenizer_dir() -> str:
    """The offline tiny tokenizer (built once, cached): torchtitan always loads a tokenizer directory."""
    from titan_rl_ext.tools.tiny_tokenizer import save_tokenizer

    d = cache_dir() / "tiny_tokenizer"
    if not (d / "tokenizer.json").exists():
        d.mkdir(parents=True, exist_ok=True)
        save_tokenizer(d)
    return str(d)


def register_tiny_dataset() -> None:
    """An in-memory text dataset (no files, no network) in torchtitan's dataset registry."""
    from datasets import Dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    from titan_rl_ext.tools.tiny_tokenizer import _corpus

    def load(_path: str) -> Dataset:
        lines = _corpus()
        docs = [" ".join(lines[i : i + 4]) for i in range(0, len(lines), 4)]
        return Dataset.from_dict({"text": docs})

    DATASETS[TINY_DATASET] = DatasetConfig(path="<in-memory>", loader=load, sample_processor=lambda s: s["text"])


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
from titan_rl_ext.configs.rl import (  # noqa: E402,F401
    qwen3_5_9b_dapo_math, rl_demo_cpu, rl_gpu_hybrid, rl_gpu_hybrid_toy, rl_gpu_long, rl_gpu_long_toy, rl_native_cpu,
    rl_lora_9b, rl_lora_toy, rl_search_cpu, rl_terminal_cpu, rl_tiny_cpu, rl_verifiers_cpu,
)
