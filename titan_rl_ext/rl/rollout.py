"""Rollouts: episodes of an environment against a generator, G per prompt, as trained-on ``Sample`` s.

The pieces live one concern a file: ``rl.samples`` (what flows to the trainer), ``rl.generator_client``
(the OpenAI completions client and its stream parsing), ``rl.sse`` (the stream's framing), ``rl.envs``
(environments). Their public names are importable from here too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from titan_rl_ext.rl.envs import (
    Environment, GuessThenCorrectEnv, Scorer, SingleTurnEnv, StepResult, TaskItem, Tokenizer,
)
from titan_rl_ext.rl.generator_client import (
    Generator, GenerationError, GeneratorClient, StreamAccumulator, versions_from_spans,
)
from titan_rl_ext.rl.samples import (
    ENV_TOKEN_VERSION, Generation, PackedRollouts, Sample, SamplingConfig, pack_samples, sample_seed,
)
from titan_rl_ext.rl.sse import parse_sse_line
from titan_rl_ext.wire.protocol import VERSION_FIELD

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
    "versions_from_spans",
    "parse_sse_line",
    "StreamAccumulator",
    "Generator",
    "GeneratorClient",
    "Tokenizer",
    "TaskItem",
    "StepResult",
    "Environment",
    "Scorer",
    "SingleTurnEnv",
    "GuessThenCorrectEnv",
    "rollout_episode",
    "rollout_group",
]


_group_ids: Iterator[int] = itertools.count()


CONTEXT_FINISH = "context_length"
"""``Sample.finish_reason`` of an episode whose next turn no longer fit the model's context."""


def _is_context_overflow(e: GenerationError) -> bool:
    """vLLM's 400 for a prompt longer than ``--max-model-len``."""
    return e.status == 400 and "maximum context length" in str(e)


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
    try:
        for turns in range(1, max_turns + 1):
            turn_sampling = sampling if seed is None else dataclasses.replace(sampling, seed=sample_seed(seed, turns))
            try:
                gen = await client.generate(prompt_ids + ids, turn_sampling)
            except GenerationError as e:
                if turns > 1 and _is_context_overflow(e):
                    # the history (tool output, retrieved passages) outgrew the model's context: the episode
                    # ends there, unfinished, and scores 0; its tokens so far are kept as they are
                    reward, finish, turns = 0.0, CONTEXT_FINISH, turns - 1
                    break
                raise
            ids += gen.token_ids
            lps += gen.logprobs
            versions += [int(v) if v is not None else 0 for v in gen.versions]
            mask += [True] * len(gen.token_ids)
            finish = gen.finish_reason
            result = env.step(list(gen.token_ids))
            if inspect.isawaitable(result):  # a tool that does I/O or runs a process: off the event loop
                result = await result
            obs, reward, done = result
            if done:
                break
            if obs:
                ids += obs
                lps += [math.nan] * len(obs)
                versions += [ENV_TOKEN_VERSION] * len(obs)
                mask += [False] * len(obs)
    finally:
        if (aclose := getattr(env, "aclose", None)) is not None:
            await aclose()  # an environment holding a sandbox or a process lets it go however the episode ended
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
