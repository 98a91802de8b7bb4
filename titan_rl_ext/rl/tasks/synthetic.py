"""``synthetic_sum`` and ``synthetic_copy``: the seeded arithmetic and copy prompts of the CPU demos
(``rewards.SyntheticTask``), scored exactly against their answer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

from titan_rl_ext.rl.envs import Scorer
from titan_rl_ext.rl.rewards import SyntheticTask
from titan_rl_ext.rl.tasks import register_task
from titan_rl_ext.rl.tasks.base import RolloutSource, Task, seeded_stream

if TYPE_CHECKING:
    from titan_rl_ext.rl.config import RLConfig

_EVAL_SEED = 2_147_483_647  # training streams use seed * 100003 + epoch: never this


class Synthetic(Task):
    def __init__(self, kind: Literal["sum", "copy"]) -> None:
        self.generator = SyntheticTask(kind=kind)

    def prompts(self, rl: RLConfig, tokenizer: Any, start: int, source: RolloutSource | None) -> Iterator[Any]:
        return seeded_stream(lambda n, seed: self.generator.sample(n, seed=seed), rl.seed, start)

    def eval_items(self, rl: RLConfig, tokenizer: Any) -> list[Any]:
        return list(self.generator.sample(rl.eval_items, seed=_EVAL_SEED))

    def scorer(self) -> Scorer:
        return SyntheticTask.score


register_task("synthetic_sum", Synthetic("sum"))
register_task("synthetic_copy", Synthetic("copy"))
