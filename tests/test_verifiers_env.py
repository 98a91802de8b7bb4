"""``verifiers`` (0.4) environments as a rollout source (``rl/envs/verifiers_source.py``): episodes run by
verifiers' own code in its own virtualenv (``.venv-verifiers``, made by ``scripts/setup.sh``), every model
call served by the project's generator client. Against the real CPU server with BI on both sides: every
branch is the generator's tokens (checked call by call), multi-turn, and the trainer's recompute of its
sampled tokens is bit-equal; with a renderer that cannot bridge turns the re-render forks are counted."""

from __future__ import annotations

import asyncio
import math
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from titan_rl_ext.rl.envs.verifiers_source import BranchMismatch, Call, VerifiersSource, branch_sample, default_python
from titan_rl_ext.rl.samples import ENV_TOKEN_VERSION, Generation, SamplingConfig

VF_PYTHON = default_python()
NO_VERIFIERS = (None if subprocess.run([VF_PYTHON, "-c", "import verifiers.v1"], capture_output=True).returncode == 0
                else "no Python with verifiers 0.4 (scripts/setup.sh makes .venv-verifiers)")
needs_verifiers = pytest.mark.skipif(NO_VERIFIERS is not None, reason=NO_VERIFIERS or "")


def test_branch_becomes_a_sample_only_on_the_generators_tokens() -> None:
    # prompt 3 tokens, turn 1 (2 sampled), a user turn (2 tokens), turn 2 (2 sampled)
    ids, mask = [1, 9, 9, 20, 21, 30, 31, 22, 23], [False] * 3 + [True] * 2 + [False] * 2 + [True] * 2
    calls = [Call([1, 9, 9], [20, 21], [-0.5, -0.25], [4, 4]), Call(ids[:7], [22, 23, 99], [-1.0, -2.0, -3.0], [5, 5, 5])]
    s = branch_sample({"token_ids": ids, "sampled_mask": mask}, calls, reward=1.0, group_id=7, num_turns=2)
    assert s.prompt_ids == [1, 9, 9] and s.completion_ids == ids[3:] and s.loss_mask == mask[3:]
    assert s.token_versions == [4, 4, ENV_TOKEN_VERSION, ENV_TOKEN_VERSION, 5, 5]
    assert s.gen_logprobs[:2] == [-0.5, -0.25] and s.gen_logprobs[4:] == [-1.0, -2.0] and math.isnan(s.gen_logprobs[2])
    retokenised = ids[:5] + [30, 32] + ids[7:]  # the user turn's tokens differ from what the generator was given
    with pytest.raises(BranchMismatch, match="re-tokenised"):
        branch_sample({"token_ids": retokenised, "sampled_mask": mask}, calls, 1.0, 7, 2)


class _Scripted:
    """A generator that answers 2-6 tokens and the end-of-turn token, seeded by the prompt."""

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        r = random.Random(sum(prompt_ids) * 31 + len(prompt_ids))
        toks = [r.randint(10, 400) for _ in range(r.randint(2, 6))] + [2]
        return Generation(token_ids=toks, logprobs=[-1.5] * len(toks), versions=[3] * len(toks), finish_reason="stop")


def _tiny_with_tool_tokens(tiny_ckpt: Any) -> Path:
    from titan_rl_ext.tools.tiny_tokenizer import add_qwen3_tool_tokens

    # its own checkpoint (the tokenizer is rebuilt); text layout: the VLM one loads as Qwen3_5Tokenizer, whose
    # default unk token is <|endoftext|>, which the Qwen3 renderer then refuses as missing
    d = tiny_ckpt("qwen3_5", layout="text", seed=11)
    add_qwen3_tool_tokens(d)
    return d


@needs_verifiers
def test_episodes_through_a_scripted_generator(tiny_ckpt) -> None:
    model_dir = _tiny_with_tool_tokens(tiny_ckpt)

    async def go() -> tuple[list[Any], Any]:
        async with VerifiersSource(_Scripted(), taskset="titan_dialog", model="tiny", tokenizer_dir=str(model_dir),
                                   python=VF_PYTHON) as src:
            assert src.num_tasks == 12
            return await src.group(3, 2, SamplingConfig(max_tokens=16), group_id=5), src.stats

    samples, stats = asyncio.run(go())
    assert stats.episodes == 2 and stats.failed_episodes == 0 and stats.forked_traces == 0 and stats.refused_branches == 0, stats
    assert len(samples) == 2
    for s in samples:
        assert s.group_id == 5 and s.num_turns == 3 and s.reward == 0.0
        assert set(s.token_versions) == {3, ENV_TOKEN_VERSION}  # the generator's versions; follow-ups carry none
        runs = sum(1 for i, m in enumerate(s.loss_mask) if m and (i == 0 or not s.loss_mask[i - 1]))
        assert runs == 3  # three model turns, separated by the user's follow-ups (no loss)


@needs_verifiers
@pytest.mark.slow
def test_verifiers_episodes_exact_against_the_real_server(tiny_ckpt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from servers import openai_server, server_env

    from titan_rl_ext.kernels import batch_invariant as bi
    from titan_rl_ext.models.common.batch import SeqBatch
    from titan_rl_ext.models.hf import load_hf_model
    from titan_rl_ext.rl.generator_client import GeneratorClient
    from titan_rl_ext.rl.logprobs import token_logprobs
    from titan_rl_ext.rl.samples import pack_samples

    model_dir = _tiny_with_tool_tokens(tiny_ckpt)
    sampling = SamplingConfig(temperature=1.0, max_tokens=12)
    with openai_server(model_dir, tmp_path / "server.log", 1024, env=server_env(TITAN_BATCH_INVARIANT="1")) as server:
        model, _ = load_hf_model(model_dir, dtype=torch.float32)
        model.eval()
        server.wait_ready()

        async def go(renderer: str) -> tuple[list[Any], Any]:
            async with GeneratorClient(server.base, str(model_dir)) as client:
                async with VerifiersSource(client, taskset="titan_dialog", model=str(model_dir), renderer=renderer,
                                           tokenizer_dir=str(model_dir), python=VF_PYTHON, max_model_len=1024) as src:
                    groups = await asyncio.gather(*(src.group(t, 4, sampling, group_id=t) for t in range(2)))
                    return [s for g in groups for s in g], src.stats

        # one after the other: the sampler's random stream follows the batch's make-up, so running the renderers
        # side by side samples other tokens, and whether a trace forks depends on the tokens sampled
        samples, stats = asyncio.run(go("qwen3"))
        default_samples, default_stats = asyncio.run(go("default"))
    print(f"\nverifiers qwen3 renderer: {stats}\nverifiers default renderer (re-renders every turn): {default_stats}")
    assert stats.episodes == 8 and stats.failed_episodes == 0 and stats.refused_branches == 0, stats
    assert stats.forked_traces == 0 and len(samples) == 8  # bridged: one branch, one sample per episode
    for s in samples:
        assert s.num_turns == 3 and ENV_TOKEN_VERSION in s.token_versions and set(s.token_versions) <= {0, ENV_TOKEN_VERSION}
    # the re-rendering renderer: branches fork where re-tokenised text differs, each branch still exact
    assert default_stats.refused_branches == 0 and default_stats.episodes == 8, default_stats

    monkeypatch.setenv(bi.ENV_VAR, "1")
    was = bi.is_batch_invariant()
    bi.set_batch_invariant(True)
    try:
        for group in (samples, default_samples):
            packed = pack_samples(list(reversed(group)))
            with torch.no_grad():
                lp_T = token_logprobs(model, packed.tokens_T, SeqBatch.from_lengths(packed.lengths))
            gen_T, ours_T = packed.gen_logprobs_T[packed.loss_mask_T], lp_T[packed.loss_mask_T]
            assert gen_T.numel() > 0 and torch.equal(gen_T, ours_T), (gen_T - ours_T).abs().max()
    finally:
        bi.set_batch_invariant(was)
    print(f"compared bit-equal: {sum(s.num_loss_tokens for s in samples)} sampled tokens over "
          f"{sum(len(s.completion_ids) for s in samples)} completion tokens (qwen3), "
          f"{sum(s.num_loss_tokens for s in default_samples)} in {len(default_samples)} branches (default)")
