"""A multi-turn terminal agent: up to ``max_turns`` bash commands in a fresh sandbox, rewarded by the task's
own test script.

A task is a folder: ``instruction.md`` (what the agent is asked), ``test.sh`` (run in the sandbox after
the episode; exit status 0 is reward 1.0, anything else 0.0; the agent never sees it) and an optional
``setup/`` whose files the sandbox starts with. Each turn the model writes ``<bash>command</bash>``; the
command runs in the episode's persistent shell and its output (clipped, with the exit code) comes back
between ``<output>`` and ``</output>`` as tokens without loss. A turn without a command ends the episode;
so do the turn limit and the episode's time limit. Then the test runs and the sandbox is destroyed.

The sandbox (``envs.sandbox``) is a process sandbox, not a container: read its docstring before running
untrusted tasks. At most ``TerminalEnv.max_concurrent`` sandboxes are live at once per event loop (16 by
default): further episodes wait for a slot at their first command. Commands run as subprocesses awaited
on the event loop, so other episodes keep streaming while one runs.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from titan_rl_ext.rl.envs import StepResult, Tokenizer
from titan_rl_ext.rl.envs.sandbox import Sandbox, SandboxLimits

__all__ = ["TerminalTask", "TerminalEnv", "load_tasks", "toy_tasks"]

TOY_DIR = Path(__file__).parent / "data" / "terminal_tasks"

PROMPT = ("You are in a bash shell in an empty working directory (files the task needs are already there). "
          "Run one command per turn as <bash> command </bash>; its output comes back between <output> and "
          "</output>. When the task is done, reply without a command.\nTask: {instruction}\n")


@dataclass(frozen=True)
class TerminalTask:
    """A task item (``envs.TaskItem``): ``prompt`` is the instruction; ``answer`` is unused (the test decides)."""

    name: str
    prompt: str
    test_script: Path
    setup_dir: Path | None
    answer: str = ""

    @classmethod
    def load(cls, folder: str | Path) -> TerminalTask:
        d = Path(folder)
        if not d.is_dir():
            raise FileNotFoundError(f"terminal task {d} is not a folder")
        instruction, test = d / "instruction.md", d / "test.sh"
        if not instruction.is_file():
            raise ValueError(f"terminal task {d} has no instruction.md")
        if not test.is_file():
            raise ValueError(f"terminal task {d} has no test.sh: without it no episode can be scored")
        setup = d / "setup"
        return cls(d.name, instruction.read_text().strip(), test, setup if setup.is_dir() else None)


def load_tasks(root: str | Path) -> list[TerminalTask]:
    """Every task folder under ``root`` (sorted by name)."""
    folders = sorted(p for p in Path(root).iterdir() if p.is_dir())
    if not folders:
        raise ValueError(f"no task folders under {root}")
    return [TerminalTask.load(p) for p in folders]


def toy_tasks() -> list[TerminalTask]:
    return load_tasks(TOY_DIR)


_BASH = re.compile(r"<bash>(.*?)(?:</bash>|$)", re.DOTALL)


class TerminalEnv:
    """One episode (``envs.Environment``, async ``step``). ``end_reason``: ``finished`` (a turn without a
    command), ``turn_limit``, ``time_limit`` or ``sandbox_error: ...``; ``test_output`` the test's output."""

    STOP = ("</bash>",)
    max_concurrent: ClassVar[int] = 16
    _slots: ClassVar[dict[asyncio.AbstractEventLoop, asyncio.Semaphore]] = {}

    def __init__(self, tokenizer: Tokenizer, limits: SandboxLimits = SandboxLimits(), max_turns: int = 64,
                 open_with_command: bool = False) -> None:
        """``open_with_command``: the prompt ends with ``<bash>``, so the first turn is a command (a model
        that does not know the protocol yet still gets multi-turn episodes)."""
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.tokenizer, self.limits, self.max_turns = tokenizer, limits, max_turns
        self.open_with_command = open_with_command
        self.task: TerminalTask | None = None
        self.sandbox: Sandbox | None = None
        self.turns = 0
        self.started = 0.0
        self.end_reason: str | None = None
        self.test_output = ""
        self._slot: asyncio.Semaphore | None = None

    def reset(self, task: TerminalTask) -> list[int]:
        self.task, self.turns, self.end_reason, self.test_output = task, 0, None, ""
        text = PROMPT.format(instruction=task.prompt) + ("<bash>" if self.open_with_command else "")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def step(self, completion_ids: list[int]) -> StepResult:
        if self.task is None:
            raise RuntimeError("reset() first")
        self.turns += 1
        text = self.tokenizer.decode(completion_ids, skip_special_tokens=True)
        if self.open_with_command and self.turns == 1:
            text = "<bash>" + text
        m = _BASH.search(text)
        if m is None:
            return await self._finish("finished")
        try:
            if self.sandbox is None:
                await self._open()
            assert self.sandbox is not None
            left = self.limits.episode_timeout_s - (time.monotonic() - self.started)
            if left <= 0:
                return await self._finish("time_limit")
            result = await self.sandbox.run(m.group(1).strip())
        except Exception as e:  # noqa: BLE001 - a broken sandbox ends this episode only
            await self.aclose()
            self.end_reason = f"sandbox_error: {type(e).__name__}: {e}"
            return StepResult(None, 0.0, True)
        if self.turns >= self.max_turns:
            return await self._finish("turn_limit")
        code = "none (see above)" if result.exit_code is None else str(result.exit_code)
        text = f"\n<output>\n{result.output}\n[exit code {code}]\n</output>\n"
        return StepResult(list(self.tokenizer.encode(text, add_special_tokens=False)), 0.0, False)

    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        self._slot = self._slots.setdefault(loop, asyncio.Semaphore(self.max_concurrent))
        await self._slot.acquire()
        try:
            assert self.task is not None
            self.sandbox = Sandbox(self.limits, self.task.setup_dir)
            await self.sandbox.start()
        except BaseException:
            await self.aclose()
            raise
        self.started = time.monotonic()

    async def _finish(self, reason: str) -> StepResult:
        assert self.task is not None
        self.end_reason = reason
        try:
            if self.sandbox is None:  # no command ran: the test judges the untouched setup
                await self._open()
            assert self.sandbox is not None
            code, self.test_output = await self.sandbox.run_test(self.task.test_script)
        except Exception as e:  # noqa: BLE001
            self.end_reason = f"sandbox_error: {type(e).__name__}: {e}"
            code = None
        finally:
            await self.aclose()
        return StepResult(None, 1.0 if code == 0 else 0.0, True)

    async def aclose(self) -> None:
        """Destroy the sandbox and free the slot (``rollout_episode`` calls it however the episode ended)."""
        if self.sandbox is not None:
            sandbox, self.sandbox = self.sandbox, None
            await sandbox.close()
        if self._slot is not None:
            slot, self._slot = self._slot, None
            slot.release()
