"""Where an RL run's prompts come from, and how far it has got through them.

- ``load_prompts``: the seeded prompt stream of a task (synthetic, or math problems from a local file or the
  hub), fast-forwarded to a start index;
- ``PromptCursor`` / ``PromptLedger``: the lowest prompt index not yet trained on (or dropped as stale) plus
  the done ones above it; checkpointed, so a resumed run draws the unfinished prompts again and skips none;
- ``load_eval_items``: the fixed held-out set; ``scorer``: the task's reward function; ``env_factory``: its
  environment (single-turn, or the multi-turn search and terminal agents of ``rl.envs``).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_rl_ext.rl.config import RLConfig



_SYNTHETIC_EPOCH = 256  # items per seeded batch of the synthetic stream


def _synthetic_prompts(kind: str, seed: int, start: int) -> Iterator[Any]:
    from titan_rl_ext.rl.rewards import SyntheticTask

    task = SyntheticTask(kind=kind)  # type: ignore[arg-type]
    first, skip = divmod(start, _SYNTHETIC_EPOCH)
    for epoch in itertools.count(first):
        items = task.sample(_SYNTHETIC_EPOCH, seed=seed * 100003 + epoch)
        yield from items[skip if epoch == first else 0:]


@dataclass(frozen=True)
class MathItem:
    prompt: str
    answer: str


def _math_rows(path: str, hub_id: str) -> list[dict[str, Any]]:
    path = path or os.environ.get("DAPO_MATH_PATH", "")
    if path:
        p = Path(path)
        if p.suffix in (".jsonl", ".json"):
            return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        import pandas as pd

        files = sorted(p.glob("**/*.parquet")) if p.is_dir() else [p]
        return [r for f in files for r in pd.read_parquet(f).to_dict("records")]
    from datasets import load_dataset  # the hub, when reachable

    return list(load_dataset(hub_id, split="train"))


def _math_item(row: dict[str, Any], tokenizer: Any) -> MathItem:
    """DAPO-Math-17k rows: ``prompt`` = chat messages, ``reward_model.ground_truth`` = answer;
    plain ``{"prompt"|"problem": str, "answer"|"solution": str}`` rows work too."""
    prompt = row.get("prompt", row.get("problem"))
    rm = row.get("reward_model") or {}
    answer = rm.get("ground_truth") if isinstance(rm, dict) and rm.get("ground_truth") is not None else row.get("answer", row.get("solution"))
    if not isinstance(prompt, str):
        msgs = [dict(m) for m in list(prompt)]
        prompt = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return MathItem(str(prompt), str(answer))


def load_prompts(rl: RLConfig, tokenizer: Any, start: int = 0, num_tasks: int | None = None) -> Iterator[Any]:
    """An endless, seeded stream of task items (``prompt``, ``answer``), from item ``start`` on: a
    resumed run seeks to its checkpointed position without materialising the items before it."""
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    if rl.task in ("synthetic_sum", "synthetic_copy"):
        return _synthetic_prompts(rl.task.removeprefix("synthetic_"), rl.seed, start)
    if rl.task == "math":
        rows = _math_rows(rl.dataset_path, rl.dataset_hub_id)
        if not rows:
            raise ValueError("task='math': the dataset has no rows")
        return (_math_item(r, tokenizer) for r in _epochs(rows, rl.seed, start))
    if rl.task in AGENT_TASKS:
        return _epochs(_agent_items(rl.task, rl.dataset_path), rl.seed, start)
    if rl.task == "verifiers":
        if num_tasks is None:
            raise ValueError("task='verifiers': the taskset's size comes from its runner (num_tasks)")
        return _epochs(list(range(num_tasks)), rl.seed, start)  # items are task indices
    raise ValueError(f"unknown task {rl.task!r}: synthetic_sum | synthetic_copy | math | search | terminal | verifiers")


AGENT_TASKS = ("search", "terminal")


def _agent_items(task: str, path: str) -> list[Any]:
    """The questions (``search``) or task folders (``terminal``) at ``path``; the shipped toy set if empty."""
    if task == "search":
        from titan_rl_ext.rl.envs.search import load_questions, toy_questions

        return load_questions(path) if path else toy_questions()
    from titan_rl_ext.rl.envs.terminal import load_tasks, toy_tasks

    return load_tasks(path) if path else toy_tasks()


def _epochs(items: list[Any], seed: int, start: int) -> Iterator[Any]:
    """``items`` over and over, each pass in its own seeded order, from position ``start`` on."""
    import random

    first, skip = divmod(start, len(items))
    for epoch in itertools.count(first):
        order = list(range(len(items)))
        random.Random(seed * 100003 + epoch).shuffle(order)
        for i in order[skip if epoch == first else 0:]:
            yield items[i]


@dataclass(frozen=True, slots=True)
class PromptCursor:
    """Where a run's prompt stream resumes: every prompt below index ``next`` and those in
    ``done_ahead`` were trained on (or dropped as stale); all others are drawn (again) after a restart."""

    next: int = 0
    done_ahead: tuple[int, ...] = ()

    def to_json(self) -> str:
        return json.dumps({"next": self.next, "done_ahead": list(self.done_ahead)})

    @classmethod
    def from_json(cls, text: str) -> PromptCursor:
        d = json.loads(text)
        return cls(int(d["next"]), tuple(sorted(int(i) for i in d["done_ahead"])))


class PromptLedger:
    """The prompt stream with a running index per prompt, and which drawn prompts are still open
    (generating or buffered): a checkpoint's cursor must hand those out again, because the run that
    drew them may die before training on them."""

    def __init__(self, items: Iterator[Any], cursor: PromptCursor) -> None:
        """``items`` yields the stream's items from index ``cursor.next`` on."""
        self._items = items
        self._pos = cursor.next
        """Index of the item ``_items`` yields next."""
        self._done = set(cursor.done_ahead)
        """Closed indices the cursor still has to report, and done ones ahead that ``draw`` skips."""
        self._open: set[int] = set()

    def draw(self) -> tuple[int, Any]:
        """The next prompt that is not done: (index, item)."""
        while True:
            index, item = self._pos, next(self._items)
            self._pos += 1
            if index not in self._done:
                self._open.add(index)
                return index, item

    def close(self, index: int) -> None:
        """Trained on (taken into a batch) or dropped as stale: not to be drawn again after a restart."""
        self._open.discard(index)
        self._done.add(index)

    def cursor(self) -> PromptCursor:
        if self._open:
            low = min(self._open)  # everything below the draw position is open or done
        else:
            low = self._pos
            while low in self._done:
                low += 1
        # indices below both the cursor and the draw position are covered by ``next``; the ones from
        # the draw position on are still needed by ``draw`` to skip them
        self._done = {i for i in self._done if i >= min(low, self._pos)}
        return PromptCursor(low, tuple(sorted(i for i in self._done if i > low)))


_EVAL_SEED = 2_147_483_647  # training streams use seed * 100003 + epoch: never this


def load_eval_items(rl: RLConfig, tokenizer: Any) -> list[Any]:
    """The fixed held-out evaluation set (``prompt``, ``answer``)."""
    if rl.task in ("synthetic_sum", "synthetic_copy"):
        from titan_rl_ext.rl.rewards import SyntheticTask

        return list(SyntheticTask(kind=rl.task.removeprefix("synthetic_")).sample(rl.eval_items, seed=_EVAL_SEED))  # type: ignore[arg-type]
    if rl.task == "math":
        if not rl.eval_path:
            raise ValueError("task='math' with eval_every > 0 needs rl.eval_path (a held-out jsonl/parquet set)")
        return [_math_item(r, tokenizer) for r in _math_rows(rl.eval_path, "")[: rl.eval_items]]
    if rl.task in AGENT_TASKS:  # eval_path: another questions file / tasks folder than the training set
        return _agent_items(rl.task, rl.eval_path or rl.dataset_path)[: rl.eval_items]
    if rl.task == "verifiers":
        raise ValueError("task='verifiers' has no held-out set here: evaluate with verifiers' own eval (eval_every=0)")
    raise ValueError(f"unknown task {rl.task!r}")


def env_factory(rl: RLConfig, tokenizer: Any) -> tuple[Any, tuple[str, ...]]:
    """The task's environment factory (``rollout_group``'s ``make_env``) and the strings generation stops at."""
    import functools

    if rl.task == "search":
        from titan_rl_ext.rl.envs.search import BM25Index, SearchEnv, toy_corpus

        index = BM25Index.build(rl.search_corpus or toy_corpus())  # once per run: episodes share it
        return (functools.partial(SearchEnv, tokenizer, index, top_k=rl.search_top_k,
                                  max_searches=max(rl.max_turns - 1, 0), passage_tokens=rl.passage_tokens,
                                  open_with_search=rl.open_with_tool),
                SearchEnv.STOP)
    if rl.task == "terminal":
        from titan_rl_ext.rl.envs.terminal import TerminalEnv

        return (functools.partial(TerminalEnv, tokenizer, max_turns=rl.max_turns, open_with_command=rl.open_with_tool),
                TerminalEnv.STOP)
    if rl.task == "verifiers":
        return None, ()  # verifiers' harness runs the episode (rollout_service)
    from titan_rl_ext.rl.envs import SingleTurnEnv

    return functools.partial(SingleTurnEnv, tokenizer, scorer(rl.task)), ()


def scorer(task: str) -> Any:
    from titan_rl_ext.rl.rewards import MathReward, SyntheticTask

    return MathReward() if task == "math" else SyntheticTask.score
