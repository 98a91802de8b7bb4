"""The README's first command: the main job on embedded tiny models, on CPU, in a few minutes.

    bash scripts/dev.sh demo            (= python -m titan_rl_ext.demo [--skip-rl] [--rl-steps N])

1. Parity (tiny Qwen3.5): writes a tiny random HF checkpoint (``tools.make_tiny``), checks the titan
   definition against transformers on packed sequences (``tools.check_hf``), and decodes greedily with
   the titan inference-state path (prefill + token-by-token with carried KV/GDN state) next to
   transformers' ``generate``.
2. RL: warms the tiny RL checkpoint up on ``SyntheticTask(kind="copy")`` (``rl.warmup``, ~20 %
   success), then runs the ``rl_demo_cpu`` recipe under torchrun -- a spawned vLLM server with
   ``--model-impl titan``, batch invariance on both sides, off-policy window 2 -- printing reward and
   ``bit_wise/logprob_diff/abs_mean`` per step, and writes the plots (``tools.plot``) of the run.

Exits non-zero if a parity check fails, if the first step's trainer/generator logprob gap is not
exactly 0, or if the mean reward of the last steps does not beat the first steps' by ``--margin``.
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


def _fmt(v: object) -> str:
    return "n/a (no such tokens)" if not isinstance(v, (int, float)) or v != v else f"{v:.3g}"


def run_rl_demo(steps: int, window: int, margin: float) -> bool:
    """Warm-up (cached), then ``rl_demo_cpu`` under torchrun; per-step lines; plots; the checks."""
    import json
    import os
    import shutil
    import subprocess

    from titan_rl_ext.configs import cache_dir
    from titan_rl_ext.configs.rl_demo import demo_rl_checkpoint

    t0 = time.time()
    print("[rl] supervised warm-up of the tiny Qwen3.5 on the copy task (cached after the first run)", flush=True)
    ckpt = demo_rl_checkpoint()
    info = json.loads((Path(ckpt) / "warmup.json").read_text())
    print(f"[rl] warm-up: {info['steps']} SFT steps, sampled success {info['answer_prob_before']:.3f} -> "
          f"{info['answer_prob_after']:.3f}  ({time.time() - t0:.1f}s)", flush=True)

    out = cache_dir() / "outputs" / "rl_demo_cpu"
    run_dir = out / "rl"
    shutil.rmtree(out, ignore_errors=True)
    repo = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           "-m", "titan_rl_ext.train", "--module", "titan_rl_ext.configs", "--config", "rl_demo_cpu",
           "--training.steps", str(steps), "--rl.run-dir", str(run_dir)]
    print(f"[rl] {' '.join(cmd[2:])}  (vLLM --model-impl titan, batch invariant, offpolicy 2; log {out / 'train.log'})",
          flush=True)
    t1 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    with (out / "train.log").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=repo)
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if " RL step " in line:
                print("   " + line[line.index("RL step"):].rstrip(), flush=True)
        rc = proc.wait()
    if rc != 0:
        print(f"[rl] torchrun failed ({rc}); last lines of {out / 'train.log'}:")
        print("".join((out / "train.log").read_text().splitlines(keepends=True)[-30:]))
        return False
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    print(f"[rl] {len(recs)} steps in {time.time() - t1:.1f}s; per step:")
    # bit_wise: tokens of the version being trained; bit_wise_stale: off-policy tokens recomputed with the weights
    # that sampled them (the exact gap, 0 under BI); bit_wise_all: every token vs the trained weights (policy lag)
    print("   step  reward  bit_wise/..abs_mean  bit_wise_stale/..abs_mean (tokens)  bit_wise_all/..abs_mean  staleness/mean")
    for r in recs:
        stale = f"{_fmt(r.get('bit_wise_stale/logprob_diff/abs_mean'))} ({int(r.get('bit_wise_stale/num_tokens', 0))})"
        print(f"   {r['step']:4d}  {r['reward/mean']:.3f}   {_fmt(r.get('bit_wise/logprob_diff/abs_mean')):>18}"
              f"  {stale:>34}  {_fmt(r.get('bit_wise_all/logprob_diff/abs_mean')):>23}  {r.get('staleness/mean', float('nan')):.2f}")
    from titan_rl_ext.tools.plot import main as plot_main

    plot_main([str(run_dir)])
    print(f"[rl] plots: {run_dir / 'plots'}  (python -m titan_rl_ext.tools.plot {run_dir})")

    rewards = [float(r["reward/mean"]) for r in recs]
    w = min(window, len(rewards) // 2) or 1
    first, last = sum(rewards[:w]) / w, sum(rewards[-w:]) / w
    gap0 = recs[0].get("bit_wise/logprob_diff/abs_mean") if recs else None
    ok_gap = gap0 == 0.0 and int(recs[0].get("bit_wise/num_tokens", 0)) > 0
    ok_rise = last - first >= margin
    # every token that can be recomputed exactly (fresh, or stale with its version's weights remembered)
    n_exact = sum(int(r.get("bit_wise/num_tokens", 0)) + int(r.get("bit_wise_stale/num_tokens", 0)) for r in recs)
    worst = max((float(r[k]) for r in recs for k in ("bit_wise/logprob_diff/max", "bit_wise_stale/logprob_diff/max")
                 if isinstance(r.get(k), (int, float)) and r[k] == r[k]), default=float("nan"))
    ok_all = n_exact > 0 and worst == 0.0
    print(f"[rl] step-1 bit_wise/logprob_diff/abs_mean = {gap0!r} ({'OK: exactly 0' if ok_gap else 'FAILED: not exactly 0'})")
    print(f"[rl] all steps: {n_exact} tokens recomputed with the weights that sampled them, max |diff| {worst!r} "
          f"({'OK: exactly 0' if ok_all else 'FAILED: not exactly 0'})")
    print(f"[rl] mean reward: first {w} steps {first:.3f} -> last {w} steps {last:.3f} (+{last - first:.3f}; "
          f"{'OK' if ok_rise else 'FAILED'}: needs >= +{margin})")
    return ok_gap and ok_rise and ok_all


def main(argv: list[str] | None = None) -> int:
    from titan_rl_ext.configs import cache_dir
    from titan_rl_ext.models.hf import load_hf_model
    from titan_rl_ext.tools.check_hf import load_transformers_model, max_logit_diff
    from titan_rl_ext.tools.make_tiny import make_tiny

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(cache_dir() / "demo"), help="where the tiny checkpoints go")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--archs", default="qwen3_5", help="comma-separated architectures of the parity check "
                    "(qwen3_5, qwen3_5_moe, qwen3)")
    ap.add_argument("--skip-rl", action="store_true", help="only the parity check")
    ap.add_argument("--rl-steps", type=int, default=40)
    ap.add_argument("--window", type=int, default=5, help="steps averaged at each end for the reward-rise check")
    ap.add_argument("--margin", type=float, default=0.15, help="required rise of the mean reward")
    args = ap.parse_args(argv)
    t_all = time.time()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)

    ok = True
    for arch in [a for a in args.archs.split(",") if a]:
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
    if ok and not args.skip_rl:
        ok &= run_rl_demo(args.rl_steps, args.window, args.margin)
    print(f"demo: {'OK' if ok else 'FAILED'}  ({time.time() - t_all:.0f}s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
