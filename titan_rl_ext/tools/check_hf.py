"""Compare the titan definition with transformers on an HF checkpoint directory (fp32 logits).

    python -m titan_rl_ext.tools.check_hf --model-dir DIR [--tolerance 1e-4] [--seed S]

transformers runs each sequence alone (batch of one); titan runs the same sequences packed into two
batches (one with a single sequence, one with the rest), so packing is checked too. Prints
``max_abs_logit_diff=<float>`` and exits 1 when it exceeds the tolerance. Both sides compute in
fp32; the residual difference comes from different summation orders (chunked gated delta rule,
SDPA vs eager attention), typically ~1e-6, and 1e-4 leaves room for larger models.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from titan_rl_ext.models.common.batch import SeqBatch
from titan_rl_ext.models.architectures import architecture_of
from titan_rl_ext.models.hf import load_hf_model, read_config

DEFAULT_LENGTHS = (1, 5, 17, 64, 100)


def load_transformers_model(model_dir: str | Path) -> torch.nn.Module:
    import transformers

    cls = getattr(transformers, architecture_of(read_config(model_dir)).name)
    return cls.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()


@torch.no_grad()
def max_logit_diff(
    model_dir: str | Path, lengths: tuple[int, ...] = DEFAULT_LENGTHS, seed: int = 0
) -> float:
    hf = load_transformers_model(model_dir)
    titan, _ = load_hf_model(model_dir, dtype=torch.float32)
    titan.eval()
    vocab = titan.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    ref = [hf(input_ids=s[None], use_cache=False).logits[0].float() for s in seqs]
    # pack: the first sequence alone, the others together
    groups = [seqs[:1], seqs[1:]] if len(seqs) > 1 else [seqs]
    ours: list[torch.Tensor] = []
    for grp in groups:
        lens = [s.numel() for s in grp]
        out = titan(torch.cat(grp), SeqBatch.from_lengths(lens))
        ours.extend(out.split(lens))
    return max((a - b).abs().max().item() for a, b in zip(ours, ref))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--tolerance", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    diff = max_logit_diff(args.model_dir, seed=args.seed)
    print(f"max_abs_logit_diff={diff:.3e}")
    if not diff <= args.tolerance:
        print(f"FAIL: exceeds tolerance {args.tolerance:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
