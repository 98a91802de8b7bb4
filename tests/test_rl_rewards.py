"""Boxed-answer extraction, math equivalence, MathReward and the synthetic task (titan_rl_ext.rl.rewards)."""

from __future__ import annotations

import re

import pytest

from titan_rl_ext.rl.rewards import (
    MathReward,
    SyntheticTask,
    extract_boxed,
    format_reward,
    math_equal,
    math_verify_available,
)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so the answer is $\\boxed{42}$.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),                      # nested braces
        ("\\boxed{\\frac{\\sqrt{3}}{2^{n+1}}}", "\\frac{\\sqrt{3}}{2^{n+1}}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),                          # escaped braces do not count
        ("The answer is \\boxed 5", "5"),                              # braceless
        ("$\\boxed 17$.", "17"),
        ("\\(\\boxed 3.\\)", "3"),
        ("\\boxed5", "5"),
        ("\\fbox{7}", "7"),
        ("first \\boxed{1}, then corrected: \\boxed{ 2 }", "2"),       # the last one
        ("\\boxed{12} then a cut-off \\boxed{3", "12"),                 # last *parseable* one
        ("no box here, the answer is 4", None),
        ("\\boxed{}", None),
        ("\\boxedx{4}", None),                                         # another macro
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


BACKENDS = ["sympy", pytest.param("math_verify", marks=pytest.mark.skipif(
    not math_verify_available(), reason="math-verify not installed"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "pred,ref,equal",
    [
        ("\\frac{1}{2}", "0.5", True),
        ("0.5", "\\dfrac{1}{2}", True),
        ("\\frac12", "1/2", True),
        ("2\\sqrt{3}", "\\sqrt{12}", True),
        ("\\frac{\\sqrt 2}{2}", "\\sqrt{2}/2", True),
        ("2\\pi", "2 \\pi", True),
        ("1,000", "1000", True),
        ("x = 3", "3", True),
        ("(1, 2)", "(1,2)", True),
        ("x^2+1", "1+x^{2}", True),
        ("10", "10.0", True),
        ("3", "4", False),
        ("-3", "3", False),
        ("\\frac{1}{3}", "0.5", False),
        ("(1, 2)", "(2, 1)", False),
    ],
)
def test_math_equal(backend: str, pred: str, ref: str, equal: bool) -> None:
    assert math_equal(pred, ref, backend=backend) is equal


def test_sympy_fallback_never_evaluates_python() -> None:
    # parse_expr is an eval: names outside the whitelist are refused before it runs
    assert not math_equal("exec(bytes((112,)))", "1", backend="sympy")
    assert not math_equal("9^9^9^9", "1", backend="sympy")  # would hang an exact power


def test_math_reward() -> None:
    reward = MathReward.Config().build()
    assert reward("... so $x = \\boxed{\\frac{1}{2}}$", "0.5") == 1.0
    assert reward("\\boxed{0.5}", "The answer is \\boxed{\\frac12}.") == 1.0  # boxed reference
    assert reward("\\boxed{3}", "4") == 0.0
    assert reward("the answer is 0.5", "0.5") == 0.0  # no boxed answer
    partial = MathReward.Config(format_reward=0.1).build()
    assert partial("\\boxed{3}", "4") == 0.1
    assert partial("no answer", "4") == 0.0
    assert partial("\\boxed{4}", "4") == 1.0
    assert format_reward("\\boxed{x}") == 1.0 and format_reward("x") == 0.0


def test_synthetic_task_sum() -> None:
    task = SyntheticTask()
    ex = task.sample(50, seed=1)
    assert ex == task.sample(50, seed=1) and ex != task.sample(50, seed=2)
    for e in ex:
        a, b = map(int, re.findall(r"\d+", e.prompt))
        assert str(a + b) == e.answer and len(e.answer) == 1  # a single digit: one token
        assert task.score(f" {e.answer}.", e.answer) == 1.0
    copy = SyntheticTask(kind="copy").sample(5)
    assert all(re.findall(r"\d+", e.prompt) == [e.answer] for e in copy)


@pytest.mark.parametrize(
    "completion,score",
    [(" 7", 1.0), (" 7.", 1.0), ("7 apples", 1.0), ("=7.0", 1.0), (" 78", 0.0), (" 8, no 7", 0.0), ("seven", 0.0),
     ("", 0.0)],
)
def test_synthetic_score_first_number(completion: str, score: float) -> None:
    assert SyntheticTask.score(completion, "7") == score
