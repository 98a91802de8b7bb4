"""Supervised warm-up of a tiny checkpoint on a ``SyntheticTask``, so RL starts from a model that
sometimes answers right (a random tiny model never does, and RL has nothing to reinforce).

Plain PyTorch on the HF (transformers) model, fp32 (CPU for the tiny demo model, CUDA for the GPU recipe's): teacher-forced cross-entropy on the answer
token of ``"<prompt> <answer>"``, in chunks of ``eval_every`` steps; it stops as soon as the model's
*sampling* success rate at temperature 1 -- the mean probability of the answer as first token over a
fixed held-out set -- reaches ``target`` (so RL starts in the 10-30 % regime where it has signal and
room to rise), or after ``max_steps``. Deterministic in ``seed``.

    python -m titan_rl_ext.rl.warmup SRC_DIR OUT_DIR [--kind copy] [--target 0.2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["answer_batch", "answer_prob", "load_hf", "save_warmed", "warmup"]


def answer_batch(tok: Any, examples: list[Any]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``prompt + " answer"`` ids, the attention mask, and labels only on the answer tokens."""
    rows, labels = [], []
    for ex in examples:
        p = tok(ex.prompt).input_ids
        a = tok(" " + ex.answer).input_ids
        rows.append(p + a)
        labels.append([-100] * len(p) + a)
    n = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    lab = torch.full((len(rows), n), -100, dtype=torch.long)
    for i, (r, l) in enumerate(zip(rows, labels, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
        lab[i, : len(l)] = torch.tensor(l)
    return ids, mask, lab


def load_hf(src: Path, dtype: torch.dtype, device: str) -> tuple[Any, Any]:
    """The HF model of checkpoint ``src`` (VLM or text layout, by its architecture) in ``dtype`` on ``device``,
    and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    arch = json.loads((src / "config.json").read_text())["architectures"][0]
    auto = AutoModelForImageTextToText if "ForConditionalGeneration" in arch else AutoModelForCausalLM
    return auto.from_pretrained(str(src), dtype=dtype).to(device), AutoTokenizer.from_pretrained(str(src))


def save_warmed(model: Any, src: Path, out: Path, info: dict[str, Any]) -> None:
    """``model`` saved into ``out`` (replacing it) with ``src``'s tokenizer and generation files, and ``info`` as
    ``out/warmup.json``, written last: its presence marks a complete warm-up for the recipes' caches."""
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(str(out))
    for f in sorted(src.iterdir()):  # never the source's weights or shard index (the model wrote its own)
        weights = f.suffix == ".safetensors" or f.name.endswith(".index.json")
        if f.is_file() and not weights and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    (out / "warmup.json").write_text(json.dumps(info, indent=1))


@torch.no_grad()
def answer_prob(model: Any, tok: Any, examples: list[Any]) -> float:
    """Mean probability of the answer tokens (``" 7"`` is two: the space and the digit) right after
    the prompt: the expected success rate of temperature-1 sampling (a lower bound: other
    completions whose first number is right score too)."""
    model.eval()
    ids, mask, lab = (t.to(model.device) for t in answer_batch(tok, examples))
    logp = model(input_ids=ids, attention_mask=mask).logits.float()[:, :-1].log_softmax(-1)
    tgt = lab[:, 1:]
    on = tgt != -100
    lp = logp.gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1) * on
    return float(lp.sum(1).exp().mean())


def warmup(src: str | Path, out: str | Path, *, kind: str = "copy", target: float = 0.2, lr: float = 1e-3,
           batch_size: int = 32, eval_every: int = 5, max_steps: int = 1000, seed: int = 0,
           verbose: bool = True, device: str = "cpu") -> dict[str, Any]:
    """Fine-tune the HF checkpoint ``src`` into ``out`` until ``answer_prob`` >= ``target``; returns
    (and writes as ``out/warmup.json``) the steps taken and the held-out success rate before/after."""
    from titan_rl_ext.rl.rewards import SyntheticTask

    src, out = Path(src), Path(out)
    torch.manual_seed(seed)
    model, tok = load_hf(src, torch.float32, device)
    if torch.device(device).type == "cuda":
        # transformers' Qwen3.5 calls fla-core's chunk kernel directly: the same Hopper guard as the trainer's
        from titan_rl_ext.kernels.gdn import allow_fla_chunk_backward

        guard = allow_fla_chunk_backward()
        if verbose:
            print(f"  fla chunk backward guard: {guard}", flush=True)
    task = SyntheticTask(kind=kind)  # type: ignore[arg-type]
    held_out = task.sample(100, seed=10_000 + seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    t0 = time.time()
    p0 = p = answer_prob(model, tok, held_out)
    step = 0
    while p < target and step < max_steps:
        model.train()
        for _ in range(eval_every):
            ids, mask, lab = (t.to(device) for t in answer_batch(tok, task.sample(batch_size, seed=seed * 7919 + step)))
            loss = model(input_ids=ids, attention_mask=mask, labels=lab).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
        p = answer_prob(model, tok, held_out)
        if verbose:
            print(f"  warm-up step {step:4d}: loss {float(loss.detach()):.3f}  held-out answer prob {p:.3f}", flush=True)
    info = {"kind": kind, "steps": step, "answer_prob_before": p0, "answer_prob_after": p, "target": target,
            "seconds": round(time.time() - t0, 1)}
    save_warmed(model, src, out, info)
    return info


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--kind", default="copy", choices=("copy", "sum"))
    ap.add_argument("--target", type=float, default=0.2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-steps", type=int, default=1000)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    print(warmup(a.src, a.out, kind=a.kind, target=a.target, lr=a.lr, max_steps=a.max_steps, device=a.device))


if __name__ == "__main__":
    main()
