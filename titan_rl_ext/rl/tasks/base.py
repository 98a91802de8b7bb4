"""What a task is (``Task``): the prompt stream, the held-out set and the episode environment a name in
``--rl.task`` stands for; and ``RolloutSource``, for tasks whose own harness runs the episodes."""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from titan_rl_ext.rl.envs import Environment, Scorer, SingleTurnEnv

if TYPE_CHECKING:
    from titan_rl_ext.rl.config import RLConfig
    from titan_rl_ext.rl.samples import Sample, SamplingConfig

EnvFactory = Callable[[], Environment]


class RolloutSource(Protocol):
    """Episodes run by the task's own harness (every model call still served by the generator fleet),
    instead of ``rollout_group`` over the task's environment."""

    async def group(self, item: Any, G: int, sampling: SamplingConfig, group_id: int) -> list[Sample]: ...

    def metrics(self) -> dict[str, float]:
        """Running totals, logged with the rollout metrics."""
        ...

    async def close(self) -> None: ...


class Task:
    """A task by name. ``prompts`` is the training stream; the rest have defaults a single-turn task with a
    scorer (``scorer``) keeps."""

    def prompts(self, rl: RLConfig, tokenizer: Any, start: int, source: RolloutSource | None) -> Iterator[Any]:
        """An endless, seeded stream of items (what an environment's ``reset`` or the source's ``group``
        takes), from item ``start`` on: a resumed run seeks to its checkpointed position without
        materialising the items before it. ``source``: what ``open_source`` returned."""
        raise NotImplementedError

    def eval_items(self, rl: RLConfig, tokenizer: Any) -> list[Any]:
        """The fixed held-out set (``rl.eval_every > 0``)."""
        raise ValueError(f"task {rl.task!r} has no held-out set: set rl.eval_every=0")

    def scorer(self) -> Scorer:
        """``score(completion_text, answer) -> reward`` of the default single-turn environment."""
        raise NotImplementedError

    def env_factory(self, rl: RLConfig, tokenizer: Any) -> tuple[EnvFactory | None, tuple[str, ...]]:
        """A fresh environment per episode (None: ``open_source`` runs them) and the strings a turn stops at."""
        return functools.partial(SingleTurnEnv, tokenizer, self.scorer()), ()

    async def open_source(self, generator: Any, rl: RLConfig, model_name: str) -> RolloutSource | None:
        """The task's own episode runner, started (None: ``rollout_group`` over ``env_factory``)."""
        return None


class ListTask(Task):
    """A task whose items are a finite list read from ``rl.dataset_path`` (the held-out set from
    ``rl.eval_path``, else the same list), each pass over it in its own seeded order."""

    def items(self, path: str) -> list[Any]:
        """The items at ``path`` ("": the task's shipped set)."""
        raise NotImplementedError

    def prompts(self, rl: RLConfig, tokenizer: Any, start: int, source: RolloutSource | None) -> Iterator[Any]:
        return epochs(self.items(rl.dataset_path), rl.seed, start)

    def eval_items(self, rl: RLConfig, tokenizer: Any) -> list[Any]:
        return self.items(rl.eval_path or rl.dataset_path)[: rl.eval_items]


def epochs(items: list[Any], seed: int, start: int) -> Iterator[Any]:
    """``items`` over and over, each pass in its own seeded order, from position ``start`` on."""
    check_start(start)
    if not items:
        raise ValueError("a task's item list is empty")
    return _epochs(items, seed, start)


def seeded_stream(sample: Callable[[int, int], list[Any]], seed: int, start: int, epoch_size: int = 256
                  ) -> Iterator[Any]:
    """An endless stream of generated items, ``sample(epoch_size, seed * 100003 + epoch)`` epoch after epoch, from
    item ``start`` on (a resumed run seeks without generating the epochs before it)."""
    check_start(start)
    return _seeded(sample, seed, start, epoch_size)


def _seeded(sample: Callable[[int, int], list[Any]], seed: int, start: int, epoch_size: int) -> Iterator[Any]:
    first, skip = divmod(start, epoch_size)
    for epoch in itertools.count(first):
        yield from sample(epoch_size, seed * 100003 + epoch)[skip if epoch == first else 0:]


def check_start(start: int) -> None:
    # here rather than in the generators below: those would only raise at their first item
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")


def _epochs(items: list[Any], seed: int, start: int) -> Iterator[Any]:
    first, skip = divmod(start, len(items))
    for epoch in itertools.count(first):
        order = list(range(len(items)))
        random.Random(seed * 100003 + epoch).shuffle(order)
        for i in order[skip if epoch == first else 0:]:
            yield items[i]
