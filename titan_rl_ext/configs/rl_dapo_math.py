"""Qwen3.5-9B on DAPO-Math-17k (``qwen3_5_9b_dapo_math``): the at-scale math recipe (bf16 weights, 16 K-token
answers, generators from ``GENERATOR_URLS`` or a spawned server). Building it only names paths (the checkpoint
directory from ``QWEN3_5_9B_DIR``, the data from ``DAPO_MATH_PATH``; both are read when training starts), so it
builds on a machine without the files.
"""

from __future__ import annotations

import os
from typing import Any

from titan_rl_ext.configs.rl_common import _rl_trainer
from titan_rl_ext.paths import cache_dir


def qwen3_5_9b_dapo_math() -> Any:
    """Qwen3.5-9B on DAPO-Math-17k: 8 prompts x 16 rollouts, off-policy window 12, DAPO loss,
    eval every 10 steps (config only; needs GPUs, generators and the data).

    Checkpoint: ``QWEN3_5_9B_DIR`` (default ``<cache>/Qwen3.5-9B``); generators: ``GENERATOR_URLS``
    (comma-separated) or a spawned local server; data: ``DAPO_MATH_PATH`` (parquet/jsonl) or the hub."""
    from titan_rl_ext.models.qwen3_5 import model_registry
    from titan_rl_ext.rl.config import RLConfig
    from titan_rl_ext.rl.losses import loss_config

    hf_dir = os.environ.get("QWEN3_5_9B_DIR", str(cache_dir() / "Qwen3.5-9B"))
    urls = [u for u in os.environ.get("GENERATOR_URLS", "").split(",") if u]
    rl = RLConfig(
        generator_urls=urls,
        spawn_server=not urls,
        server_args=["--dtype", "bfloat16", "--max-model-len", "20480", "--enable-prefix-caching",
                     "--mamba-cache-mode", "align"],
        model_dir=hf_dir,
        served_model_name="",
        task="math",
        dataset_path=os.environ.get("DAPO_MATH_PATH", ""),
        prompts_per_step=8,
        group_size=16,
        max_tokens=16384,
        temperature=1.0,
        offpolicy=12,
        num_producers=32,
        loss=loss_config("dapo", eps_low=0.2, eps_high=0.28),
        batch_invariant_steps=0,
        seeded_sampling=False,  # per-request seeds make vLLM sample those requests one by one; off at scale
        eval_every=10,  # AIME-style held-out set: jsonl/parquet of {"problem"/"prompt", "answer"}
        eval_path=os.environ.get("AIME_EVAL_PATH", ""),
        eval_items=64,
    )
    # the flavor, not the checkpoint's config.json: building the recipe must work without the files
    cfg = _rl_trainer(model_registry("qwen3_5-9b"), hf_dir, rl, steps=500, lr=1e-6, warmup=10, batch_invariant=False,
                      dump=str(cache_dir() / "outputs" / "qwen3_5_9b_dapo_math"), checkpoint_interval=20)
    cfg.training.dtype = cfg.training.mixed_precision_param = "bfloat16"  # bf16 weights, no fp32 master copy
    cfg.checkpoint.enable = True
    return cfg
