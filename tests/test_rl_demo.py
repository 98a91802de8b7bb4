"""The README demo's ingredients, fast (the full demo is ``python -m titan_rl_ext.demo``): the supervised
warm-up raises the tiny model's sampled success on the copy task and writes a loadable checkpoint,
and the demo recipe trains on that task."""

from __future__ import annotations

import json

import pytest

from titan_rl_ext.rl.rewards import SyntheticTask


def test_copy_task_scores_the_repeated_digit() -> None:
    (ex,) = SyntheticTask(kind="copy").sample(1, seed=3)
    assert ex.prompt == f"Repeat {ex.answer}. The answer is"
    assert SyntheticTask.score(f" {ex.answer}.", ex.answer) == 1.0
    assert SyntheticTask.score(" x", ex.answer) == 0.0


def test_warmup_raises_answer_prob(tmp_path) -> None:
    pytest.importorskip("transformers")
    from titan_rl_ext.rl.warmup import warmup
    from titan_rl_ext.tools.make_tiny import make_tiny

    src = make_tiny("qwen3_5", tmp_path / "src", seed=0, layout="vlm")
    info = warmup(src, tmp_path / "warm", kind="copy", target=0.99, max_steps=10, eval_every=5, verbose=False)
    assert info["steps"] == 10
    assert info["answer_prob_after"] > 10 * info["answer_prob_before"]
    assert json.loads((tmp_path / "warm" / "warmup.json").read_text())["steps"] == 10
    for f in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (tmp_path / "warm" / f).is_file(), f
    from titan_rl_ext.models.hf import load_hf_model

    load_hf_model(tmp_path / "warm")  # the titan side (trainer and vLLM --model-impl titan) reads it
