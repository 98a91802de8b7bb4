"""Environments: the protocol and the single-turn ones here, multi-turn retrieval in ``envs.search``.

An episode is ``reset(prompt) -> prompt token ids`` then, per turn, the generator continues the full
token history and ``step(completion ids) -> (observation ids | None, reward, done)``. Observation
tokens (tool output, a user turn) are part of the sequence the trainer sees but carry no loss:
``Sample.loss_mask`` is False on them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple, Protocol

__all__ = ["Tokenizer", "TaskItem", "StepResult", "Environment", "Scorer", "SingleTurnEnv", "GuessThenCorrectEnv"]


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class TaskItem(Protocol):
    """A prompt with its reference answer (``rewards.SyntheticExample`` is one)."""

    prompt: str | Sequence[int]
    answer: str


class StepResult(NamedTuple):
    observation: list[int] | None
    """Tokens the environment appends before the next turn (None: none)."""
    reward: float
    done: bool


class Environment(Protocol):
    """One episode's state. ``rollout_group`` makes a fresh one per sample through a factory. ``step`` may
    be a coroutine (``async def``): an environment whose tools do I/O or run processes awaits them there,
    so other episodes keep streaming."""

    def reset(self, prompt: Any) -> list[int]: ...

    def step(self, completion_ids: list[int]) -> StepResult | Awaitable[StepResult]: ...


Scorer = Callable[[str, str], float]
"""``score(completion_text, reference) -> reward``: ``SyntheticTask.score``, ``MathReward()``."""


def _encode(tokenizer: Tokenizer, prompt: str | Sequence[int]) -> list[int]:
    if isinstance(prompt, str):
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    return [int(t) for t in prompt]


class SingleTurnEnv:
    """Prompt in, one completion, scored by a task scorer against the item's answer."""

    def __init__(self, tokenizer: Tokenizer, scorer: Scorer) -> None:
        self.tokenizer = tokenizer
        self.scorer = scorer
        self._answer: str | None = None

    def reset(self, prompt: TaskItem) -> list[int]:
        self._answer = prompt.answer
        return _encode(self.tokenizer, prompt.prompt)

    def step(self, completion_ids: list[int]) -> StepResult:
        assert self._answer is not None, "reset() first"
        text = self.tokenizer.decode(completion_ids, skip_special_tokens=True)
        return StepResult(None, float(self.scorer(text, self._answer)), True)


class GuessThenCorrectEnv:
    """A two-turn toy game proving the multi-turn interface: a right first answer scores 1.0;
    otherwise the environment says so (tokens without loss) and the model, continuing from the whole
    history, gets a second try worth ``second_try_reward``."""

    def __init__(
        self, tokenizer: Tokenizer, scorer: Scorer, feedback: str = " Wrong. Try again. The answer is",
        second_try_reward: float = 0.5,
    ) -> None:
        self.tokenizer = tokenizer
        self.scorer = scorer
        self.feedback = feedback
        self.second_try_reward = second_try_reward
        self._answer: str | None = None
        self.turn = 0

    def reset(self, prompt: TaskItem) -> list[int]:
        self._answer, self.turn = prompt.answer, 0
        return _encode(self.tokenizer, prompt.prompt)

    def step(self, completion_ids: list[int]) -> StepResult:
        assert self._answer is not None, "reset() first"
        self.turn += 1
        right = self.scorer(self.tokenizer.decode(completion_ids, skip_special_tokens=True), self._answer) > 0
        if self.turn == 1:
            if right:
                return StepResult(None, 1.0, True)
            return StepResult(_encode(self.tokenizer, self.feedback), 0.0, False)
        return StepResult(None, self.second_try_reward if right else 0.0, True)
