"""Supervised warm-up through LoRA adapters, merged into the base: ``rl/warmup.py``'s recipe (teacher-forced
cross-entropy on the answer of ``"<prompt> <answer>"``, stopping on the held-out sampling success rate) for a
model too big for a full-weight warm-up on one GPU. A full-weight AdamW warm-up of Qwen3.5-9B's shape needs
~16 bytes a parameter (fp32 weights, gradients, two moments: ~110 GiB); here the base stays frozen in its stored
dtype (bf16: 2 bytes a parameter) and only rank-``rank`` adapters train (PEFT's LoRA, fp32 with their AdamW
moments), so the 9B shape's warm-up holds ~14 GiB of weights and adapters.

When it stops (``target``, ``max_steps`` or ``max_seconds``, whichever first) the adapters are merged into the
base weights (PEFT's ``merge_and_unload``: ``W + (alpha / r) B A`` summed in fp32, rounded once to the stored
dtype) and the merged model is saved like the source -- same layout, config and dtype -- so RL loads it as a plain
checkpoint and trains fresh adapters on top. The warm-up adapter is never saved beside the merged weights
(``adapter_dir`` puts it elsewhere): transformers would load a PEFT adapter it finds there on top of the
already-merged base.

Deterministic in ``seed`` on the CPU (adapter init, batches); on a GPU the GDN kernels' reductions may differ run
to run in the last bits.

    python -m titan_rl_ext.rl.lora_warmup SRC_DIR OUT_DIR [--kind copy] [--target 0.2] [--rank 16] [--device cuda]
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from titan_rl_ext.models.common.lora import HYBRID_TARGETS
from titan_rl_ext.rl.warmup import answer_batch, answer_prob, load_hf, save_warmed

__all__ = ["lora_warmup", "target_regex"]

RAMP_STEPS = 5


def target_regex(targets: Sequence[str]) -> str:
    """A PEFT ``target_modules`` pattern for the decoder layers' ``targets`` alone: a VLM checkpoint's vision tower
    has projections of its own (``qkv``, ``proj``, ``linear_fc*``) that a plain name list might also catch."""
    return rf".*\.layers\.\d+\.(self_attn|linear_attn|mlp)\.({'|'.join(targets)})"


def lora_warmup(src: str | Path, out: str | Path, *, targets: Sequence[str], kind: str = "copy", target: float = 0.2,
                rank: int = 16, alpha: float = 32.0, lr: float = 1e-3, batch_size: int = 32, eval_every: int = 5,
                eval_items: int = 100, max_steps: int = 300, max_seconds: float = 300.0, seed: int = 0,
                dtype: torch.dtype = torch.float32, device: str = "cpu", adapter_dir: str | Path | None = None,
                verbose: bool = True) -> dict[str, Any]:
    """Warm ``src`` up on ``SyntheticTask(kind)`` through rank-``rank`` adapters on ``targets``, merge them and save
    the merged model into ``out``; returns (and writes as ``out/warmup.json``) the steps taken, the held-out
    success rate before and after, why it stopped and the seconds it took. ``dtype``: the base's (and the saved
    checkpoint's) dtype; the adapters train in fp32 whatever it is. ``adapter_dir``: also save the warm-up adapter
    there in PEFT's format, before the merge (to check the merge against)."""
    from peft import LoraConfig, get_peft_model

    from titan_rl_ext.rl.rewards import SyntheticTask

    src, out, dev = Path(src), Path(out), torch.device(device)
    torch.manual_seed(seed)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)  # warmup.json's peak is the warm-up's own
    model, tok = load_hf(src, dtype, device)
    if dev.type == "cuda":
        # transformers' Qwen3.5 calls fla-core's chunk kernel directly: the same Hopper guard as the trainer's
        from titan_rl_ext.kernels.gdn import allow_fla_chunk_backward

        allow_fla_chunk_backward()
    cfg = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none", target_modules=target_regex(targets))
    # autocast_adapter_dtype (PEFT's default): bf16 adapters are made fp32, so AdamW's small updates are not lost
    peft_model = get_peft_model(model, cfg)
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    task = SyntheticTask(kind=kind)  # type: ignore[arg-type]
    held_out = task.sample(eval_items, seed=10_000 + seed)
    opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
    # B starts at zero, so the first steps' updates are all of B's direction: a short ramp keeps them small
    ramp = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / RAMP_STEPS))
    t0 = time.time()
    p0 = p = answer_prob(peft_model, tok, held_out)
    curve = [(0, p0)]
    step, loss = 0, float("nan")
    while p < target and step < max_steps and time.time() - t0 < max_seconds:
        peft_model.train()
        for _ in range(eval_every):
            ids, mask, lab = (t.to(dev) for t in answer_batch(tok, task.sample(batch_size, seed=seed * 7919 + step)))
            nll = peft_model(input_ids=ids, attention_mask=mask, labels=lab).loss
            opt.zero_grad(set_to_none=True)
            nll.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            opt.step()
            ramp.step()
            step += 1
            loss = float(nll.detach())
        p = answer_prob(peft_model, tok, held_out)
        curve.append((step, p))
        if verbose:
            print(f"  LoRA warm-up step {step:4d}: loss {loss:.3f}  held-out answer prob {p:.3f}  "
                  f"({time.time() - t0:.0f} s)", flush=True)
    stopped = "target" if p >= target else "max_steps" if step >= max_steps else "max_seconds"
    seconds = round(time.time() - t0, 1)
    if adapter_dir is not None:
        peft_model.save_pretrained(str(adapter_dir))
    merged = peft_model.merge_and_unload()
    info = {"kind": kind, "method": "lora_merged", "rank": rank, "alpha": alpha, "targets": list(targets), "lr": lr,
            "steps": step, "answer_prob_before": p0, "answer_prob_after": p, "target": target, "stopped_by": stopped,
            "loss": loss, "seconds": seconds, "curve": curve,
            "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev.type == "cuda" else None}
    save_warmed(merged, src, out, info)
    del merged, peft_model, model, opt, ramp, trainable
    if dev.type == "cuda":
        # the recipe builds its trainer and starts its generator on this GPU next: vLLM sizes its share from the
        # memory free at its start, so the caching allocator must not keep the warm-up's ~15 GiB
        gc.collect()
        torch.cuda.empty_cache()
    return info


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--kind", default="copy", choices=("copy", "sum"))
    ap.add_argument("--target", type=float, default=0.2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--targets", nargs="+", default=list(HYBRID_TARGETS))
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-steps", type=int, default=300)
    ap.add_argument("--max-seconds", type=float, default=300.0)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    print(lora_warmup(a.src, a.out, targets=a.targets, kind=a.kind, target=a.target, rank=a.rank, alpha=a.alpha,
                      lr=a.lr, max_steps=a.max_steps, max_seconds=a.max_seconds, dtype=getattr(torch, a.dtype),
                      device=a.device))


if __name__ == "__main__":
    main()
