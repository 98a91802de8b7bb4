"""``terminal``: a bash agent (``envs.terminal``), each task a folder (instruction, optional setup, test
script) run in a fresh process sandbox per episode; the shipped toy tasks when no folder is given."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from titan_rl_ext.rl.envs.terminal import TerminalEnv, load_tasks, toy_tasks
from titan_rl_ext.rl.tasks import register_task
from titan_rl_ext.rl.tasks.base import EnvFactory, ListTask

if TYPE_CHECKING:
    from titan_rl_ext.rl.config import RLConfig


class TerminalTaskSet(ListTask):
    def items(self, path: str) -> list[Any]:
        return load_tasks(path) if path else toy_tasks()

    def env_factory(self, rl: RLConfig, tokenizer: Any) -> tuple[EnvFactory | None, tuple[str, ...]]:
        return (functools.partial(TerminalEnv, tokenizer, max_turns=rl.max_turns, open_with_command=rl.open_with_tool),
                TerminalEnv.STOP)


register_task("terminal", TerminalTaskSet())
