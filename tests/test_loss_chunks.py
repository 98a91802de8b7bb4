"""Loss chunks (``rl/loss_chunks.py``): the step's forward/loss/backward over whole samples a chunk at a
time gives the one-pass loss and gradients (up to float summation order: rtol 1e-5 on fp32 sums of a few
hundred terms), and -- under batch invariance -- the same logprobs bit for bit."""

from __future__ import annotations

import pytest
import torch

from titan_rl_ext.rl.loss_chunks import forward_backward, loss_chunks
from titan_rl_ext.rl.samples import ENV_TOKEN_VERSION, Sample


def test_chunks_are_whole_samples_in_order() -> None:
    assert loss_chunks([5, 5, 5], 0) == [(0, 3)]
    assert loss_chunks([5, 5, 5], 10) == [(0, 2), (2, 3)]
    assert loss_chunks([12, 3, 3, 20, 1], 10) == [(0, 1), (1, 3), (3, 4), (4, 5)]  # a long sample alone
    assert loss_chunks([], 10) == [(0, 0)]


def _samples(n: int, seed: int) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p, c = int(torch.randint(3, 9, (1,), generator=g)), int(torch.randint(6, 20, (1,), generator=g))
        mask = [bool(x) for x in (torch.rand(c, generator=g) > 0.2).tolist()]  # some environment tokens
        out.append(Sample(prompt_ids=torch.randint(3, 200, (p,), generator=g).tolist(),
                          completion_ids=torch.randint(3, 200, (c,), generator=g).tolist(),
                          gen_logprobs=[(-2.0 - float(torch.rand(1, generator=g))) if m else float("nan") for m in mask],
                          token_versions=[0 if m else ENV_TOKEN_VERSION for m in mask], loss_mask=mask,
                          reward=float(i % 3 == 0), finish_reason="stop", group_id=i // 4))
    return out


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_chunked_pass_equals_one_pass(tiny_ckpt, aggregation: str) -> None:
    from titan_rl_ext.kernels import batch_invariant as bi
    from titan_rl_ext.models.hf import load_hf_model
    from titan_rl_ext.rl.advantages import group_advantages
    from titan_rl_ext.rl.losses.dppo import DPPOLoss
    from titan_rl_ext.rl.samples import pack_samples

    model, _ = load_hf_model(tiny_ckpt("qwen3_5", layout="text"))
    samples = _samples(8, seed=1)
    packed = pack_samples(samples)
    adv_N = group_advantages(packed.rewards_N, group_ids_N=packed.group_ids_N)
    loss_fn = DPPOLoss.Config(aggregation=aggregation).build()
    norm = ({"num_global_valid_tokens": packed.loss_mask_T.sum()} if aggregation == "token_mean"
            else {"num_global_seqs": len(samples)})
    runs = {}
    was = bi.is_batch_invariant()
    bi.set_batch_invariant(True)
    try:
        for max_tokens in (0, 40):
            model.zero_grad(set_to_none=True)
            lp_T, loss, metrics = forward_backward(model, packed, adv_N, loss_fn, norm, max_tokens)
            runs[max_tokens] = (lp_T, loss, metrics, {n: p.grad.clone() for n, p in model.named_parameters()})
    finally:
        bi.set_batch_invariant(was)
    assert len(loss_chunks(packed.lengths, 40)) >= 3
    (lp1, loss1, m1, g1), (lpc, lossc, mc, gc) = runs[0], runs[40]
    assert torch.equal(lp1.isnan(), lpc.isnan()) and torch.equal(lp1.nan_to_num(), lpc.nan_to_num())
    assert float(loss1) != 0.0 and torch.allclose(lossc, loss1, rtol=1e-5, atol=0)
    assert mc["num_tokens"] == m1["num_tokens"] and torch.allclose(mc["ratio_mean"], m1["ratio_mean"], rtol=1e-5)
    for n in g1:
        assert torch.allclose(gc[n], g1[n], rtol=1e-4, atol=1e-7), n
