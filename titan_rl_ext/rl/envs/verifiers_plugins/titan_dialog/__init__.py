"""``titan_dialog``: a toy verifiers taskset with scripted follow-up user turns (see ../README.md)."""

from __future__ import annotations

import verifiers.v1 as vf

WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger", "piano", "ocean", "amber", "cedar", "lemon", "comet"]


class DialogData(vf.TaskData):
    word: str
    followups: list[str] = []


class DialogTask(vf.Task[DialogData]):
    @vf.reward(weight=1.0)
    async def says_the_word(self, trace: vf.Trace) -> float:
        return float(self.data.word in (trace.last_reply or "").lower())


class DialogConfig(vf.TasksetConfig):
    num_tasks: int = len(WORDS)


class TitanDialog(vf.Taskset[DialogTask, DialogConfig]):
    def load(self) -> list[DialogTask]:
        return [DialogTask(DialogData(prompt=f"Think of the word {w}.", word=w,
                                      followups=["Spell it backwards.", f"Now say {w} again."]), self.config.task)
                for w in (WORDS * (1 + self.config.num_tasks // len(WORDS)))[: self.config.num_tasks]]


__all__ = ["TitanDialog"]
