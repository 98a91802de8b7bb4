"""The inference-state path (KV + GDN conv/recurrent state carried between calls) equals one full forward.

Tolerance 1e-4 on logits of magnitude ~3 (fp32): prefill-in-parts and decode change the order of
floating point sums (chunk boundaries of the gated delta rule, GEMMs over a different number of
rows), not the math; measured max ~3e-5. Bitwise equality is the batch-invariant mode's job.
"""

from __future__ import annotations

import pytest
import torch

from titan_rl_ext.models.common.batch import SeqBatch
from titan_rl_ext.models.hf import load_hf_model

ATOL = 1e-4


@pytest.mark.parametrize(
    "arch,gdn_mode",
    [("qwen3_5", "chunk"), ("qwen3_5", "recurrent"), ("qwen3_5_moe", "chunk"), ("qwen3_5_moe", "recurrent"), ("qwen3", None)],
)
@torch.no_grad()
def test_prefill_split_then_decode_matches_full_forward(tiny_ckpt, arch: str, gdn_mode: str | None) -> None:
    overrides = {"gdn_mode": gdn_mode} if gdn_mode else {}
    model, _ = load_hf_model(tiny_ckpt(arch), **overrides)
    model.eval()
    g = torch.Generator().manual_seed(1)
    total = [40, 23, 9]
    seqs = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in total]
    full = model(torch.cat(seqs), SeqBatch.from_lengths(total)).split(total)

    # Step 1/2: two prefill chunks of different sizes per sequence; step 3: one token at a time.
    # The sequences are deliberately out of phase so steps mix prefill and decode work.
    part1, part2 = [13, 7, 1], [20, 10, 3]
    states = model.init_states(len(seqs))
    done = [0] * len(seqs)
    got: list[list[torch.Tensor]] = [[] for _ in seqs]

    def run(n_new: list[int]) -> None:
        nonlocal states
        toks = torch.cat([s[d : d + n] for s, d, n in zip(seqs, done, n_new)])
        batch = SeqBatch.from_lengths(n_new, start_positions=done)
        logits, states = model.step(toks, batch, states)
        for i, chunk in enumerate(logits.split(n_new)):
            got[i].append(chunk)
            done[i] += n_new[i]

    run(part1)
    run(part2)
    while any(d < n for d, n in zip(done, total)):
        run([1 if d < n else 0 for d, n in zip(done, total)])

    for i in range(len(seqs)):
        stepped = torch.cat(got[i])
        assert stepped.shape == full[i].shape
        torch.testing.assert_close(stepped, full[i], atol=ATOL, rtol=0)
    # the carried KV caches hold exactly every token once
    kv = [s for s in states if hasattr(s, "k")]
    assert kv and all(s.cached_lengths() == total for s in kv)
