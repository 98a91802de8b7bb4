"""The long-answer task (``worked_sum``): found by name, seeded, its reference chain scores 1.0, a chain wrong from
step k scores the right steps before k, and its answers run 1-4K tokens with the tiny tokenizer (the long-reasoning
regime at a small model's cost); the warm-up's reading of the expected reward off line probabilities; the
``rl_gpu_long`` recipe's model shape and memory split. Seconds, no engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from titan_rl_ext.rl.tasks import task_named
from titan_rl_ext.rl.tasks.worked_sum import WorkedSum, score


def test_reference_chain_scores_one_and_errors_cost_what_follows_them() -> None:
    task = task_named("worked_sum_short")
    assert isinstance(task, WorkedSum)
    items = task.sample(20, seed=3)
    assert items == task.sample(20, seed=3) and items != task.sample(20, seed=4)
    for item in items:
        ref = WorkedSum.solution(item)
        assert score(ref, item.answer) == 1.0
        lines = ref.splitlines()
        steps = len(lines) - 1
        # wrong at step 2 (index 1): one right step, a right final line
        bad = lines[:1] + [lines[1].replace("=", "= 1 +")] + lines[2:]
        assert score("\n".join(bad), item.answer) == pytest.approx(0.5 * 1 / steps + 0.5)
        # the chain alone, no final line; the final line alone
        assert score("\n".join(lines[:-1]), item.answer) == pytest.approx(0.5)
        assert score(lines[-1], item.answer) == pytest.approx(0.5)
        assert score("no idea", item.answer) == 0.0
        # a step that skips a term of the prompt is wrong even if its arithmetic is right
        first, x, _ = lines[0].replace("+", " ").replace("=", " ").split()
        assert score(f"{first} + {int(x) + 1} = {int(first) + int(x) + 1}", item.answer) == 0.0


def test_stream_is_seeded_resumable_and_the_long_variant_writes_1k_to_4k_tokens() -> None:
    from titan_rl_ext.tools.tiny_tokenizer import build_tokenizer

    task = task_named("worked_sum")
    rl = SimpleNamespace(seed=5, eval_items=8)
    stream = task.prompts(rl, None, 0, None)
    head = [next(stream) for _ in range(300)]
    resumed = task.prompts(rl, None, 260, None)
    assert [next(resumed) for _ in range(40)] == head[260:]
    with pytest.raises(ValueError, match="start"):
        task.prompts(rl, None, -1, None)
    assert task.eval_items(rl, None) == task.eval_items(rl, None) and task.eval_items(rl, None)[0] not in head
    tok = build_tokenizer()
    lengths = sorted(len(tok.encode(WorkedSum.solution(item))) for item in head[:64])
    assert 1000 <= lengths[0] and lengths[-1] <= 4500, (lengths[0], lengths[-1])
    assert lengths[len(lengths) // 2] >= 2000


def test_long_recipe_model_has_the_9b_heads_and_its_memory_split_counts_its_parameters() -> None:
    """``rl_gpu_long``'s model (registered as a recipe): the 9B's head shapes, and ``long_memory_split`` counts
    the parameters the HF model of that shape has (built on the meta device: no weights), 16 bytes of each in
    the trainer's fp32 master weights, gradients and AdamW state."""
    import torch

    from titan_rl_ext import configs
    from titan_rl_ext.configs.rl_long import GIB, hybrid_param_count, long_memory_split, long_shape
    from titan_rl_ext.tools.make_tiny import SHAPES, build_hf_model

    assert callable(configs.rl_gpu_long) and callable(configs.rl_gpu_long_toy)
    shape = long_shape()
    assert (shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]) == (16, 4, 256)
    assert (shape["linear_num_key_heads"], shape["linear_num_value_heads"], shape["linear_key_head_dim"],
            shape["linear_value_head_dim"]) == (16, 32, 128, 128)
    for s in (shape, {**SHAPES["qwen3_5-rl-1b"], "vocab_size": shape["vocab_size"], "linear_conv_kernel_dim": 4}):
        with torch.device("meta"):
            model = build_hf_model("qwen3_5", layout="text", **s)
        assert hybrid_param_count(s) == sum(p.numel() for p in model.parameters())
    split = long_memory_split(shape, seqs=256, max_model_len=6144, chunk_tokens=6144)
    n = hybrid_param_count(shape)
    assert split["trainer/params_fp32"] + split["trainer/grads_fp32"] + split["trainer/adam_fp32"] == 16 * n / GIB
    # 4 attention layers x (4 kv heads x 256 for k and for v) in bf16 for 256 sequences of 6144 tokens
    assert split["generator/kv_cache"] == 256 * 6144 * 4 * 2 * 4 * 256 * 2 / GIB
    assert split["total"] == split["trainer"] + split["generator"]


def test_chain_warmup_reads_the_expected_reward_off_each_lines_probability() -> None:
    """The warm-up's stopping rule (``rl/chain_warmup.py``): every token of a reference chain is assigned to the
    line it writes, and the expected reward of line probabilities is the scorer's: half for the expected number of
    right steps before the first wrong one, half for a chain right to its final line."""
    import math

    from titan_rl_ext.rl.chain_warmup import encode_chain, line_reward
    from titan_rl_ext.tools.tiny_tokenizer import build_tokenizer

    tok = build_tokenizer()
    item = task_named("worked_sum_short").sample(1, seed=0)[0]
    chain = WorkedSum.solution(item)
    lines = chain.split("\n")
    ids, line_of = encode_chain(tok, item.prompt, chain)
    assert tok.decode([t for t, n in zip(ids, line_of) if n == -1]) == item.prompt
    for i, text in enumerate(lines):
        assert tok.decode([t for t, n in zip(ids, line_of) if n == i]) == text + ("\n" if i < len(lines) - 1 else "")
    assert ids[-1] == tok.eos_token_id and line_of[-1] == len(lines)
    assert line_reward([0.0] * len(lines)) == 1.0
    # two steps right with probability 1/2 each, a sure final line: 0.5 * (1/2 + 1/4) / 2 + 0.5 * 1/4
    assert line_reward([math.log(0.5), math.log(0.5), 0.0]) == pytest.approx(0.3125)
    assert line_reward([-math.inf, 0.0, 0.0]) == 0.0  # a wrong first step: no credit, however sure the rest
