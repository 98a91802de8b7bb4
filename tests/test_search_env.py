"""The Search-R1-style environment (issue 24): corpus and question files, the BM25 index and its cache,
the episode protocol, and a multi-turn rollout whose observation tokens carry no loss."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
from collections.abc import Sequence
from pathlib import Path

import pytest

from titan_rl_ext.rl.envs.search import (
    BM25Index, SearchEnv, SearchQuestion, exact_match, load_corpus, load_questions, toy_corpus, toy_questions,
)
from titan_rl_ext.rl.rollout import ENV_TOKEN_VERSION, rollout_episode
from titan_rl_ext.rl.samples import Generation, SamplingConfig

if importlib.util.find_spec("bm25s") is None:  # not importorskip: it would import bm25s with numba (search._bm25s)
    pytest.skip("bm25s absent: the 'agents' extra (scripts/setup.sh installs it)", allow_module_level=True)


class ByteTokenizer:
    """Exact round trips, one token per byte: what the environment does is visible token by token."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode(errors="replace")


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> BM25Index:
    return BM25Index.build(toy_corpus(), cache_dir=tmp_path_factory.mktemp("bm25"))


def test_bad_files_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        load_corpus(tmp_path / "nowhere.jsonl")
    bad = tmp_path / "c.jsonl"
    bad.write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(ValueError, match="line 2: not JSON"):
        load_corpus(bad)
    bad.write_text('{"text": "fine"}\n{"title": "no text"}\n')
    with pytest.raises(ValueError, match="line 2: no 'text'"):
        load_corpus(bad)
    bad.write_text('{"question": "q?", "answers": []}\n')
    with pytest.raises(ValueError, match="line 1: 'answers'"):
        load_questions(bad)
    bad.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        load_corpus(bad)
    with pytest.raises(ValueError, match="top_k"):
        SearchEnv(ByteTokenizer(), None, top_k=0)  # type: ignore[arg-type]


def test_bm25_finds_each_toy_fact_and_reuses_its_cache(index: BM25Index, tmp_path: Path) -> None:
    import sys

    assert "numba" not in sys.modules  # it breaks an in-process vLLM engine's kernel scan (search._bm25s)
    questions = toy_questions()
    facts = {p.id: p for p in index.passages if p.id.startswith("p")}
    assert len(questions) == len(facts) == 20
    top1 = [index.search(q.prompt, 1)[0].id for q in questions]
    hits = sum(t == f"p{i}" for i, t in enumerate(top1))
    assert hits >= 17, top1  # the question's own passage ranks first for nearly every question
    assert all(f"p{i}" in [p.id for p in index.search(q.prompt, 3)] for i, q in enumerate(questions))
    assert index.search("the of a", 3) == []  # stopwords only: no query, no results
    # a second build of the same corpus loads the saved index and ranks the same
    cache = tmp_path / "cache"
    first = BM25Index.build(toy_corpus(), cache_dir=cache)
    (saved,) = list(cache.iterdir())
    assert (saved / "done").exists()
    again = BM25Index.build(toy_corpus(), cache_dir=cache)
    assert [p.id for p in again.search("lighthouse of Morun", 3)] == [p.id for p in first.search("lighthouse of Morun", 3)]
    # another corpus is another index
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"text": "only passage"}) + "\n")
    BM25Index.build(other, cache_dir=cache)
    assert len(list(cache.iterdir())) == 2


def test_exact_match_normalises_like_squad() -> None:
    assert exact_match("  The Grey  Sentinel. ", ["Grey Sentinel"]) == 1.0
    assert exact_match("grey sentinel lighthouse", ["Grey Sentinel"]) == 0.0
    assert exact_match("4", ["four", "4"]) == 1.0


def test_episode_protocol(index: BM25Index) -> None:
    tok = ByteTokenizer()
    env = SearchEnv(tok, index, top_k=2, max_searches=2, passage_tokens=60)
    prompt = tok.decode(env.reset(SearchQuestion("What is the capital of Veltria?", ("Morun",))))
    assert "Question: What is the capital of Veltria?" in prompt and "up to 2 times" in prompt

    step = lambda text: asyncio.run(env.step(tok.encode(text)))  # noqa: E731
    obs, reward, done = step("I will look. <search> capital of Veltria </search>")
    info = tok.decode(obs)
    assert not done and reward == 0.0 and info.startswith("\n\n<information>") and info.endswith("</information>\n\n")
    assert "Veltria is an island" in info and len(obs) == 60 + len("\n\n<information></information>\n\n")  # the budget holds
    obs, _, done = step("<search></search>")
    assert not done and "empty query" in tok.decode(obs)
    assert step("<search> more </search>") == (None, 0.0, True) and env.end_reason == "search_limit"

    env.reset(SearchQuestion("q", ("Morun",)))
    assert step("<answer> morun </answer>") == (None, 1.0, True) and env.end_reason == "answered"
    env.reset(SearchQuestion("q", ("Morun",)))
    assert step("<answer>Vell</answer>") == (None, 0.0, True)
    env.reset(SearchQuestion("q", ("Morun",)))
    assert step("I do not know.") == (None, 0.0, True) and env.end_reason == "no_action"


class ScriptedGenerator:
    """Answers each turn with the next scripted text (as byte tokens), version 7, and checks that every
    turn continues exactly the tokens the last one ended with -- no re-tokenisation of the history."""

    def __init__(self, turns: list[str]) -> None:
        self.turns, self.prompts = list(turns), []

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingConfig) -> Generation:
        if self.prompts:
            assert list(prompt_ids[: len(self.prompts[-1])]) == self.prompts[-1]
        self.prompts.append(list(prompt_ids))
        ids = list(self.turns.pop(0).encode())
        return Generation(ids, [-0.5] * len(ids), [7] * len(ids), "stop")


def test_multi_turn_rollout_masks_the_information(index: BM25Index) -> None:
    tok = ByteTokenizer()
    gen = ScriptedGenerator(["<search> lighthouse of Morun harbour </search>", "<answer> the Grey Sentinel </answer>"])
    item = SearchQuestion("What is the lighthouse of Morun harbour called?", ("Grey Sentinel",))
    sample = asyncio.run(rollout_episode(gen, SearchEnv(tok, index), item, SamplingConfig(extra={"stop": list(SearchEnv.STOP)})))
    assert sample.reward == 1.0 and sample.num_turns == 2
    text = tok.decode(sample.completion_ids)
    start, end = text.index("<information>") - 2, text.index("</information>") + len("</information>\n\n")
    assert "Grey Sentinel" in text[start:end]  # the retrieved passage is in the sequence
    assert sample.loss_mask == [not (start <= i < end) for i in range(len(text))]
    assert all(v == ENV_TOKEN_VERSION for v, m in zip(sample.token_versions, sample.loss_mask) if not m)
    assert all(v == 7 for v, m in zip(sample.token_versions, sample.loss_mask) if m)
    assert all(math.isnan(lp) != m for lp, m in zip(sample.gen_logprobs, sample.loss_mask))
    assert gen.prompts[1] == sample.prompt_ids + sample.completion_ids[:end]  # turn 2 saw the whole history
