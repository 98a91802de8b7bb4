"""``search``: Search-R1-style multi-turn retrieval (``envs.search``): questions from a JSONL file (the
shipped toy set when none is given), answered with the help of a BM25 index over a passage corpus."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from titan_rl_ext.rl.envs.search import BM25Index, SearchEnv, load_questions, toy_corpus, toy_questions
from titan_rl_ext.rl.tasks import register_task
from titan_rl_ext.rl.tasks.base import EnvFactory, ListTask

if TYPE_CHECKING:
    from titan_rl_ext.rl.config import RLConfig


class SearchTask(ListTask):
    def items(self, path: str) -> list[Any]:
        return load_questions(path) if path else toy_questions()

    def env_factory(self, rl: RLConfig, tokenizer: Any) -> tuple[EnvFactory | None, tuple[str, ...]]:
        index = BM25Index.build(rl.search_corpus or toy_corpus())  # once per run: episodes share it
        return (functools.partial(SearchEnv, tokenizer, index, top_k=rl.search_top_k,
                                  max_searches=max(rl.max_turns - 1, 0), passage_tokens=rl.passage_tokens,
                                  open_with_search=rl.open_with_tool),
                SearchEnv.STOP)


register_task("search", SearchTask())
