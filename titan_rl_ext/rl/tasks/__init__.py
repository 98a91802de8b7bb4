"""RL tasks by name (``--rl.task NAME``; ``RLConfig.task``).

A task is one module of this package: a ``Task`` (``base``) registered with ``register_task("name",
task)``; one module may register several names (``synthetic_sum``, ``synthetic_copy``). Nothing else
names it: the first lookup imports every module here, and the trainer and the rollout service find it by
that name. A task defined elsewhere registers the same way and is found once its module is imported.
"""

from __future__ import annotations

from titan_rl_ext.rl.registry import Registry
from titan_rl_ext.rl.tasks.base import Task

TASK_REGISTRY: Registry[Task] = Registry("task", __name__)
register_task = TASK_REGISTRY.add


def task_named(name: str) -> Task:
    """The registered task; an unknown name is an error listing the registered ones."""
    return TASK_REGISTRY.get(name)


def task_names() -> list[str]:
    return TASK_REGISTRY.names()
