"""``worked_sum`` (and ``worked_sum_short``): answers of thousands of tokens at a small model's cost -- the
long-reasoning regime, where generation dominates an RL step. The prompt lists numbers; the answer adds them one
at a time, a line a step (``"52 + 7 = 59"``), and ends with ``"Answer: N"``. Every line is checkable, so the
reward can credit a partly right chain and rise before whole chains come out right:

    reward = 0.5 * (steps right before the first wrong or missing one) / steps + 0.5 * [final answer right]

``worked_sum`` asks for 100-350 terms (answers of ~1.1-4K tokens with the tiny tokenizer); ``worked_sum_short`` for
4-12, for CPU runs. ``WorkedSum.solution`` writes the reference chain (the supervised warm-up's target).
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from titan_rl_ext.rl.envs import Scorer
from titan_rl_ext.rl.tasks import register_task
from titan_rl_ext.rl.tasks.base import RolloutSource, Task, seeded_stream

if TYPE_CHECKING:
    from titan_rl_ext.rl.config import RLConfig

_EVAL_SEED = 2_147_483_646  # training streams use seed * 100003 + epoch: never this
_STEP_RE = re.compile(r"^\s*(-?\d+)\s*\+\s*(-?\d+)\s*=\s*(-?\d+)\s*$")
_ANSWER_RE = re.compile(r"Answer:\s*(-?\d+)")


@dataclass(frozen=True)
class WorkedSumItem:
    prompt: str
    answer: str
    """The terms and their sum as the scorer reads them: ``"12,7,33=52"``."""


def _terms_of(answer: str) -> tuple[list[int], int]:
    terms, total = answer.split("=")
    return [int(t) for t in terms.split(",")], int(total)


def score(completion_text: str, answer: str) -> float:
    """Half for the chain's right steps before the first wrong one (step i must read ``s_{i-1} + x_i = s_i``
    with the prompt's ``x_i`` and the true running sums), half for the final ``Answer:`` line."""
    terms, total = _terms_of(answer)
    lines = [ln for ln in completion_text.splitlines() if ln.strip()]
    running, right = terms[0], 0
    for i, x in enumerate(terms[1:]):
        m = _STEP_RE.match(lines[i]) if i < len(lines) else None
        if m is None or (int(m.group(1)), int(m.group(2)), int(m.group(3))) != (running, x, running + x):
            break
        running += x
        right += 1
    final = _ANSWER_RE.search(completion_text)
    steps = max(len(terms) - 1, 1)
    return 0.5 * right / steps + 0.5 * float(final is not None and int(final.group(1)) == total)


class WorkedSum(Task):
    def __init__(self, min_terms: int, max_terms: int, max_term: int = 99) -> None:
        if not 2 <= min_terms <= max_terms:
            raise ValueError(f"need 2 <= min_terms <= max_terms, got {min_terms}, {max_terms}")
        self.min_terms, self.max_terms, self.max_term = min_terms, max_terms, max_term

    def sample(self, n: int, seed: int) -> list[WorkedSumItem]:
        """``n`` items, deterministic in ``seed``."""
        rng = random.Random(seed)
        out = []
        for _ in range(n):
            terms = [rng.randint(1, self.max_term) for _ in range(rng.randint(self.min_terms, self.max_terms))]
            prompt = ("Add these numbers one at a time, a line per step, then give the answer: "
                      + ", ".join(map(str, terms)) + ".\n")
            out.append(WorkedSumItem(prompt, ",".join(map(str, terms)) + f"={sum(terms)}"))
        return out

    @staticmethod
    def solution(item: WorkedSumItem) -> str:
        """The reference chain the scorer gives 1.0."""
        terms, total = _terms_of(item.answer)
        lines, running = [], terms[0]
        for x in terms[1:]:
            lines.append(f"{running} + {x} = {running + x}")
            running += x
        return "\n".join(lines) + f"\nAnswer: {total}"

    def prompts(self, rl: RLConfig, tokenizer: Any, start: int, source: RolloutSource | None) -> Iterator[Any]:
        return seeded_stream(self.sample, rl.seed, start)

    def eval_items(self, rl: RLConfig, tokenizer: Any) -> list[Any]:
        return self.sample(rl.eval_items, seed=_EVAL_SEED)

    def scorer(self) -> Scorer:
        return score


register_task("worked_sum", WorkedSum(100, 350))
register_task("worked_sum_short", WorkedSum(4, 12))
