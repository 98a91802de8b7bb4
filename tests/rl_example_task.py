"""A task defined outside ``titan_rl_ext.rl.tasks``, the way a user adds one: this file alone. It asks the
model to reverse a short word and scores the exact reversal (``tests/test_rl_registries.py``)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from titan_rl_ext.rl.config import RLConfig
from titan_rl_ext.rl.envs import Scorer
from titan_rl_ext.rl.tasks import register_task
from titan_rl_ext.rl.tasks.base import RolloutSource, Task, epochs

NAME = "example_reverse"
WORDS = ("abc", "stop", "level", "tram", "wolf", "deer")


@dataclass(frozen=True)
class ReverseItem:
    prompt: str
    answer: str


def _items() -> list[ReverseItem]:
    return [ReverseItem(f"Reverse {w}:", w[::-1]) for w in WORDS]


class ReverseTask(Task):
    def prompts(self, rl: RLConfig, tokenizer: Any, start: int, source: RolloutSource | None) -> Iterator[Any]:
        return epochs(_items(), rl.seed, start)

    def eval_items(self, rl: RLConfig, tokenizer: Any) -> list[Any]:
        return random.Random(0).sample(_items(), k=min(rl.eval_items, len(WORDS)))

    def scorer(self) -> Scorer:
        return lambda text, answer: float(text.strip() == answer)


register_task(NAME, ReverseTask())
