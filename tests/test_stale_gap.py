"""``bit_wise_stale/*`` over multi-turn samples whose turns a swap separates: each turn is recomputed with
the weights that sampled it (``StaleGap``, ``Sample.exact_versions``). Generator logprobs are made here by
the same model code with each version's weights, so the gap must be exactly 0; a label swapped between the
two versions must show."""

from __future__ import annotations

import math

import torch

from titan_rl_ext.rl.samples import ENV_TOKEN_VERSION, Sample


def _logprobs(model, ids: list[int]) -> list[float]:  # type: ignore[no-untyped-def]
    from titan_rl_ext.models.common.batch import SeqBatch
    from titan_rl_ext.rl.logprobs import token_logprobs

    with torch.no_grad():
        return token_logprobs(model, torch.tensor(ids), SeqBatch.from_lengths([len(ids)])).tolist()


def test_turns_on_both_sides_of_a_swap_compare_at_their_own_versions(tiny_ckpt) -> None:
    from titan_rl_ext.models.hf import load_hf_model
    from titan_rl_ext.rl.stale_gap import StaleGap

    model_dir = tiny_ckpt("qwen3_5", layout="text")
    model, _ = load_hf_model(model_dir)
    model.eval()
    sd = {n: t.detach().clone() for n, t in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    weights = {v: {n: t + 0.02 * v * torch.randn(t.shape, generator=g) if t.is_floating_point() else t
                   for n, t in sd.items()} for v in (1, 2)}
    prompt, turn1, env, turn2 = [5, 9, 11, 40], [17, 33, 8], [70, 71], [90, 4, 12, 60]
    ids = prompt + turn1 + env + turn2
    lps = {}
    for v, w in weights.items():
        model.load_state_dict(w)
        lps[v] = _logprobs(model, ids)
    n1, ne = len(prompt) + len(turn1), len(prompt) + len(turn1) + len(env)

    def sample(v1: int, v2: int, tags: tuple[int, int] | None = None) -> Sample:
        """Turn 1 sampled by ``v1``, turn 2 by ``v2``; tagged ``tags`` (default: truthfully)."""
        t1, t2 = tags or (v1, v2)
        gen = lps[v1][len(prompt):n1] + [math.nan] * len(env) + lps[v2][ne:]
        return Sample(prompt_ids=prompt, completion_ids=turn1 + env + turn2, gen_logprobs=gen,
                      token_versions=[t1] * len(turn1) + [ENV_TOKEN_VERSION] * len(env) + [t2] * len(turn2),
                      loss_mask=[True] * len(turn1) + [False] * len(env) + [True] * len(turn2), reward=0.0,
                      finish_reason="stop", group_id=0, num_turns=2)

    gap = StaleGap(keep=3, model_dir=str(model_dir))
    for v, w in weights.items():
        gap.remember(v, w)
    m = gap.metrics([sample(1, 2)], current=3, dtype=torch.float32, device=torch.device("cpu"))
    assert m["bit_wise_stale/num_tokens"] == len(turn1) + len(turn2) and m["bit_wise_stale/logprob_diff/max"] == 0.0, m
    assert m["bit_wise_stale/samples_across_swaps"] == 1 and m["bit_wise_stale/skipped_samples"] == 0
    # control: each turn tagged with the other's version
    m_bad = gap.metrics([sample(1, 2, tags=(2, 1))], current=3, dtype=torch.float32, device=torch.device("cpu"))
    assert m_bad["bit_wise_stale/num_tokens"] == len(turn1) + len(turn2) and m_bad["bit_wise_stale/logprob_diff/max"] > 1e-4
    # a turn at the current version is the trainer's main forward's to compare, not the stale gap's
    m_cur = gap.metrics([sample(1, 2, tags=(1, 3))], current=3, dtype=torch.float32, device=torch.device("cpu"))
    assert m_cur["bit_wise_stale/num_tokens"] == len(turn1) and m_cur["bit_wise_stale/samples_across_swaps"] == 1


def test_kept_versions_are_copies_and_the_recompute_copies_nothing(tiny_ckpt) -> None:
    """``remember`` copies (the trainer's optimizer updates its weights in place right after a push); the
    recompute points the second model's parameters at the kept tensors instead of loading them (what makes
    the metric cheap on a GPU), and gives the bits a freshly loaded model gives."""
    import pytest

    from titan_rl_ext.models.common.batch import SeqBatch
    from titan_rl_ext.models.hf import load_hf_model
    from titan_rl_ext.rl.logprobs import token_logprobs
    from titan_rl_ext.rl.stale_gap import StaleGap

    with pytest.raises(ValueError, match="stale gap device"):
        StaleGap(keep=2, model_dir="unused", device="gpu")
    model_dir = tiny_ckpt("qwen3_5", layout="text")
    model, _ = load_hf_model(model_dir)
    model.eval()
    live = {n: t.detach().clone() for n, t in model.state_dict().items()}
    gap = StaleGap(keep=2, model_dir=str(model_dir))
    gap.remember(1, live)
    ids = [5, 9, 11, 40, 17, 33, 8]
    with torch.no_grad():
        want = token_logprobs(model, torch.tensor(ids), SeqBatch.from_lengths([len(ids)]))
    for t in live.values():  # the optimizer step after the push
        if t.is_floating_point():
            t.add_(1.0)
    smp = Sample(prompt_ids=ids[:4], completion_ids=ids[4:], gen_logprobs=want[4:].tolist(), token_versions=[1] * 3,
                 loss_mask=[True] * 3, reward=0.0, finish_reason="stop", group_id=0, num_turns=1)
    m = gap.metrics([smp], current=2, dtype=torch.float32, device=torch.device("cpu"))
    assert m["bit_wise_stale/num_tokens"] == 3 and m["bit_wise_stale/logprob_diff/max"] == 0.0, m
    kept = gap.history[1]
    shared = [n for n, p in gap._scratch.named_parameters() if p.data_ptr() == kept[n].data_ptr()]
    assert len(shared) == len(list(gap._scratch.named_parameters())) > 0
    # the oldest version goes once keep are held
    gap.remember(2, live)
    gap.remember(3, live)
    assert sorted(gap.history) == [2, 3]


def test_recompute_in_loss_chunks_gives_the_one_pass_bits(tiny_ckpt) -> None:
    """The recompute runs in the trainer's loss chunks (``chunk_tokens``: whole samples, a longer one alone) so a
    long-answer step's stale samples do not take one forward's memory; under batch invariance the chunks give
    the one pass's logprobs bit for bit, and the gap against one-sequence-at-a-time logprobs stays 0."""
    from titan_rl_ext.kernels.batch_invariant import batch_invariant
    from titan_rl_ext.models.hf import load_hf_model
    from titan_rl_ext.rl.loss_chunks import loss_chunks
    from titan_rl_ext.rl.samples import pack_samples
    from titan_rl_ext.rl.stale_gap import StaleGap

    model_dir = tiny_ckpt("qwen3_5", layout="text")
    model, _ = load_hf_model(model_dir)
    model.eval()
    g = torch.Generator().manual_seed(1)
    chunk = 24
    samples = []
    with batch_invariant(True):
        for p, c in [(4, 6), (5, 9), (6, 26), (3, 5), (7, 8)]:  # 6 + 26 tokens: longer than a chunk
            ids = torch.randint(3, 200, (p + c,), generator=g).tolist()
            samples.append(Sample(prompt_ids=ids[:p], completion_ids=ids[p:], gen_logprobs=_logprobs(model, ids)[p:],
                                  token_versions=[1] * c, loss_mask=[True] * c, reward=0.0, finish_reason="stop",
                                  group_id=0, num_turns=1))
        gap = StaleGap(keep=2, model_dir=str(model_dir), chunk_tokens=chunk)
        gap.remember(1, model.state_dict())
        packed = pack_samples(samples)
        assert len(loss_chunks(packed.lengths, chunk)) >= 3 and max(packed.lengths) > chunk
        m = gap.metrics(samples, current=2, dtype=torch.float32, device=torch.device("cpu"))
        chunked_T = gap.recompute(packed, 1, torch.float32)
        gap.chunk_tokens = 0
        one_pass_T = gap.recompute(packed, 1, torch.float32)
    assert m["bit_wise_stale/num_tokens"] == 54 and m["bit_wise_stale/logprob_diff/max"] == 0.0, m
    assert torch.equal(chunked_T.isnan(), one_pass_T.isnan())
    assert torch.equal(chunked_T.nan_to_num(), one_pass_T.nan_to_num())
