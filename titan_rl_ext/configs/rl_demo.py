"""The README demo (``rl_demo_cpu``, ``python -m titan_rl_ext.demo``): the tiny Qwen3.5 after a short supervised
warm-up on ``synthetic_copy`` (``demo_rl_checkpoint``), so its reward starts at ~20 % and RL visibly raises it on a
CPU. ``DEMO_TASK`` and the warmed-up checkpoint are shared: the GPU recipes train on the same task, and the LoRA
toy starts from the same checkpoint.
"""

from __future__ import annotations

from typing import Any

from titan_rl_ext.configs.rl_common import _rl_trainer, _tiny_rl_config, model_spec_from_hf, tiny_rl_checkpoint
from titan_rl_ext.paths import cache_dir

DEMO_TASK = "copy"
DEMO_WARMUP_TARGET = 0.2


def demo_rl_checkpoint(verbose: bool = True) -> str:
    """``tiny_rl_checkpoint()`` after a short supervised warm-up on ``SyntheticTask(kind="copy")``
    (``titan_rl_ext.rl.warmup``) until it samples the right answer ~20 % of the time (built once, cached)."""
    from titan_rl_ext.rl.warmup import warmup

    d = cache_dir() / f"rl_demo_qwen3_5_{DEMO_TASK}_{int(DEMO_WARMUP_TARGET * 100)}"
    if not (d / "warmup.json").exists():
        warmup(tiny_rl_checkpoint(), d, kind=DEMO_TASK, target=DEMO_WARMUP_TARGET, verbose=verbose)
    return str(d)


def rl_demo_cpu() -> Any:
    """The README demo: the warmed-up tiny Qwen3.5 (``demo_rl_checkpoint``) on CPU, ``synthetic_copy``,
    8 prompts x G=8, off-policy window 2, batch invariant on both sides for the whole run, 40 steps, lr 2e-3."""
    hf_dir = demo_rl_checkpoint()
    # stale_gap_versions = offpolicy + 1: every off-policy token is recomputed with the weights that sampled it
    rl = _tiny_rl_config(hf_dir, task=f"synthetic_{DEMO_TASK}", prompts_per_step=8, num_producers=8,
                         eval_every=10, eval_items=64, stale_gap_versions=3)
    return _rl_trainer(model_spec_from_hf(hf_dir), hf_dir, rl, steps=40, lr=2e-3, warmup=2, batch_invariant=True,
                       dump=str(cache_dir() / "outputs" / "rl_demo_cpu"), checkpoint_interval=10)
