"""How far an RL run has got through its prompt stream (the stream itself is its task's, ``rl.tasks``).

``PromptCursor`` / ``PromptLedger``: the lowest prompt index not yet trained on (or dropped as stale) plus
the done ones above it; checkpointed, so a resumed run draws the unfinished prompts again and skips none.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


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
