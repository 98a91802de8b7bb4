"""The README's first command: the main job on embedded tiny models, on CPU, in about a minute.

    bash scripts/dev.sh demo            (= python -m titan_rl_ext.demo)

For each architecture it writes a tiny random HF checkpoint (``tools.make_tiny``), checks the titan
definition against transformers on packed sequences (``tools.check_hf``), and decodes greedily with
the titan inference-state path (prefill + token-by-token with carried KV/GDN state) next to
transformers' ``generate``. Exits non-zero if any check fails.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

from titan_rl_ext.models.common.batch import SeqBatch
from titan_rl_ext.models.common.decoder import Decoder


@torch.no_grad()
def greedy_titan(model: Decoder, prompt: list[int], max_new: int) -> list[int]:
    states = model.init_states(1)
    logits, states = model.step(torch.tensor(prompt), SeqBatch.from_lengths([len(prompt)]), states)
    out: list[int] = []
    for _ in range(max_new):
        nxt = int(logits[-1].argmax())
        out.append(nxt)
        pos = len(prompt) + len(out) - 1
        logits, states = model.step(torch.tensor([nxt]), SeqBatch.from_lengths([1], [pos]), states)
    return out


def main(argv: list[str] | None = None) -> int:
    from titan_rl_ext.configs import cache_dir
    from titan_rl_ext.models.hf import load_hf_model
    from titan_rl_ext.tools.check_hf import load_transformers_model, max_logit_diff
    from titan_rl_ext.tools.make_tiny import make_tiny

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(cache_dir() / "demo"), help="where the tiny checkpoints go")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)

    ok = True
    for arch in ("qwen3_5", "qwen3_5_moe", "qwen3"):
        t0 = time.time()
        d = make_tiny(arch, Path(args.out) / arch, seed=0)
        diff = max_logit_diff(d)
        titan, _ = load_hf_model(d)
        hf = load_transformers_model(d)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(d))
        prompt = tok("What is 12 plus 30? The answer is").input_ids
        ours = greedy_titan(titan, prompt, args.max_new_tokens)
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=args.max_new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0, min_new_tokens=args.max_new_tokens,
        )[0, len(prompt):].tolist()
        same = ours == ref
        ok &= diff <= 1e-4 and same
        print(f"[{arch}] max_abs_logit_diff={diff:.3e}  greedy_{len(ours)}_tokens_identical={same}  ({time.time() - t0:.1f}s)")
        print(f"    titan decode: {tok.decode(ours)!r}")
    print("demo: OK" if ok else "demo: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
