"""``verifiers``: a ``verifiers`` 0.4 taskset as the rollout source (``envs.verifiers_source``): its
harness runs the episodes in verifiers' own Python, every model call served by the generator fleet."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from titan_rl_ext.rl.tasks import register_task
from titan_rl_ext.rl.tasks.base import EnvFactory, RolloutSource, Task, epochs

if TYPE_CHECKING:
    from titan_rl_ext.rl.config import RLConfig


class VerifiersTask(Task):
    def prompts(self, rl: RLConfig, tokenizer: Any, start: int, source: RolloutSource | None) -> Iterator[Any]:
        num_tasks = getattr(source, "num_tasks", None)
        if num_tasks is None:
            raise ValueError("task='verifiers': the taskset's size comes from its runner (open_source)")
        return epochs(list(range(num_tasks)), rl.seed, start)  # items are task indices

    def eval_items(self, rl: RLConfig, tokenizer: Any) -> list[Any]:
        raise ValueError("task='verifiers' has no held-out set here: evaluate with verifiers' own eval (eval_every=0)")

    def env_factory(self, rl: RLConfig, tokenizer: Any) -> tuple[EnvFactory | None, tuple[str, ...]]:
        return None, ()  # verifiers' harness runs the episode

    async def open_source(self, generator: Any, rl: RLConfig, model_name: str) -> RolloutSource | None:
        from titan_rl_ext.rl.envs.verifiers_source import VerifiersSource, default_python

        source = VerifiersSource(
            generator, taskset=rl.verifiers_taskset, harness=rl.verifiers_harness, model=model_name,
            tokenizer_dir=rl.model_dir, renderer=rl.verifiers_renderer, python=rl.verifiers_python or default_python(),
            taskset_args=json.loads(rl.verifiers_taskset_args or "{}"))
        await source.start()
        return source


register_task("verifiers", VerifiersTask())
