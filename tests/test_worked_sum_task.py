"""The long-answer task (``worked_sum``): found by name, seeded, its reference chain scores 1.0, a chain wrong from
step k scores the right steps before k, and its answers run 1-4K tokens with the tiny tokenizer (the long-reasoning
regime at a small model's cost). Seconds, no engine."""

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
