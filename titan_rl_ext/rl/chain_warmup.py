"""Supervised warm-up on a long-answer task's reference chains (``WorkedSum.solution``), so RL starts from a
model whose sampled chains are partly right: an untrained model never writes a right line, and RL has nothing
to reinforce. The short-answer tasks' warm-up (``rl/warmup.py``) stops on the probability of one answer; here an
answer is hundreds of lines, each of which the reward credits, so this one stops on the reward that sampling at
temperature 1 is expected to earn, read off the teacher-forced line probabilities:

    q_i = P(line i right | lines before it right)          (the product of its tokens' probabilities)
    E[reward] = 0.5 * sum_k prod_{i<k} q_i / steps + 0.5 * prod_i q_i

(the scorer's half for the right steps before the first wrong one, half for the final line; a lower bound, as
other spellings of a right line also score). Plain PyTorch on the HF (transformers) model, fp32 weights; on CUDA
bf16 autocast and gradient checkpointing, since a batch of a few 5K-token chains holds otherwise more activations
than the GPU. It stops at ``target``, ``max_steps`` or ``max_seconds``, whichever comes first. Deterministic in
``seed`` on the CPU.

    python -m titan_rl_ext.rl.chain_warmup SRC_DIR OUT_DIR [--task worked_sum] [--target 0.2] [--device cuda]
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import math
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["chain_warmup", "encode_chain", "expected_reward", "line_reward"]


def encode_chain(tok: Any, prompt: str, chain: str) -> tuple[list[int], list[int]]:
    """``prompt`` then ``chain`` then EOS as ids, and per id the chain line it belongs to (-1: the prompt; the
    EOS is its own, last line's successor, ``len(lines)``). A token belongs to the line of its first character,
    so a line's ``"\\n"`` is its own."""
    prompt_ids = tok(prompt).input_ids
    enc = tok(chain, return_offsets_mapping=True)
    starts = [0] + [i + 1 for i, c in enumerate(chain) if c == "\n"]
    lines = [bisect.bisect_right(starts, lo) - 1 for lo, _ in enc.offset_mapping]
    return prompt_ids + enc.input_ids + [tok.eos_token_id], [-1] * len(prompt_ids) + lines + [len(starts)]


def _batch(rows: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids ``[B, T]``, attention mask ``[B, T]``, line of each id ``[B, T]`` (-1: prompt or pad)."""
    n = max(len(ids) for ids, _ in rows)
    ids_BT = torch.zeros(len(rows), n, dtype=torch.long)
    mask_BT = torch.zeros(len(rows), n, dtype=torch.long)
    line_BT = torch.full((len(rows), n), -1, dtype=torch.long)
    for b, (ids, lines) in enumerate(rows):
        ids_BT[b, : len(ids)] = torch.tensor(ids)
        mask_BT[b, : len(ids)] = 1
        line_BT[b, : len(lines)] = torch.tensor(lines)
    return ids_BT, mask_BT, line_BT


def _autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def _next_token_logprobs(model: Any, ids_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """``[B, T-1]``: log P(ids[:, t+1] | ids[:, :t+1])."""
    with _autocast(ids_BT.device):
        logits_BTV = model(input_ids=ids_BT, attention_mask=mask_BT).logits
    logp_BTV = logits_BTV.float()[:, :-1].log_softmax(-1)
    return logp_BTV.gather(-1, ids_BT[:, 1:].unsqueeze(-1)).squeeze(-1)


def line_reward(line_logprob: list[float]) -> float:
    """The expected reward of a chain whose lines (steps, then the final line) have these conditional
    log-probabilities (module docstring)."""
    q = [math.exp(lp) for lp in line_logprob]
    steps = max(len(q) - 1, 1)
    prefix, right = 1.0, 0.0
    for qi in q[:-1]:
        prefix *= qi
        right += prefix
    return 0.5 * right / steps + 0.5 * prefix * q[-1]


@torch.no_grad()
def expected_reward(model: Any, tok: Any, items: list[Any], solution: Any, batch_size: int = 4) -> float:
    """Mean ``line_reward`` over ``items`` (each answered by ``solution(item)``), teacher-forced."""
    model.eval()
    device = next(model.parameters()).device
    out = []
    for lo in range(0, len(items), batch_size):
        rows = [encode_chain(tok, it.prompt, solution(it)) for it in items[lo : lo + batch_size]]
        ids_BT, mask_BT, line_BT = (t.to(device) for t in _batch(rows))
        lp_BT = _next_token_logprobs(model, ids_BT, mask_BT)
        line_BT = line_BT[:, 1:]
        for b, (_, lines) in enumerate(rows):
            n_lines = max(lines)  # the EOS's "line" is one past the last line
            per_line = torch.zeros(n_lines, device=device).index_add_(
                0, line_BT[b][(line_BT[b] >= 0) & (line_BT[b] < n_lines)],
                lp_BT[b][(line_BT[b] >= 0) & (line_BT[b] < n_lines)])
            out.append(line_reward(per_line.tolist()))
    return sum(out) / len(out)


def _load(src: Path, device: torch.device) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    arch = json.loads((src / "config.json").read_text())["architectures"][0]
    auto = AutoModelForImageTextToText if "ForConditionalGeneration" in arch else AutoModelForCausalLM
    return auto.from_pretrained(str(src), dtype=torch.float32).to(device), AutoTokenizer.from_pretrained(str(src))


def _save(model: Any, src: Path, out: Path, info: dict[str, Any]) -> None:
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(str(out))
    for f in sorted(src.iterdir()):  # tokenizer and generation files; never the source's weights
        weights = f.suffix == ".safetensors" or f.name.endswith(".index.json")
        if f.is_file() and not weights and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    (out / "warmup.json").write_text(json.dumps(info, indent=1))


def _batches(task: Any, batch_size: int, seed: int) -> Iterator[list[Any]]:
    step = 0
    while True:
        yield task.sample(batch_size, seed=seed * 7919 + step)
        step += 1


def chain_warmup(src: str | Path, out: str | Path, *, task: str = "worked_sum", target: float = 0.2,
                 lr: float = 3e-4, batch_size: int = 8, eval_every: int = 10, eval_items: int = 8,
                 max_steps: int = 2000, max_seconds: float = 480.0, seed: int = 0, device: str = "cpu",
                 verbose: bool = True) -> dict[str, Any]:
    """Fine-tune the HF checkpoint ``src`` on ``task``'s reference chains into ``out``; returns (and writes as
    ``out/warmup.json``) the steps taken, the held-out expected reward before and after, and why it stopped."""
    from titan_rl_ext.rl.tasks import task_named

    src, out, dev = Path(src), Path(out), torch.device(device)
    torch.manual_seed(seed)
    the_task = task_named(task)
    solution = type(the_task).solution
    model, tok = _load(src, dev)
    if dev.type == "cuda":
        # transformers' Qwen3.5 calls fla-core's chunk kernel directly: the same Hopper guard as the trainer's
        from titan_rl_ext.kernels.gdn import allow_fla_chunk_backward

        allow_fla_chunk_backward()
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    held_out = the_task.sample(eval_items, seed=10_000 + seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    ramp = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / eval_every))  # no full-lr first step
    t0 = time.time()
    r0 = r = expected_reward(model, tok, held_out, solution)
    step, loss = 0, float("nan")
    batches = _batches(the_task, batch_size, seed)
    while r < target and step < max_steps and time.time() - t0 < max_seconds:
        model.train()
        for _ in range(eval_every):
            ids_BT, mask_BT, line_BT = (t.to(dev) for t in _batch([encode_chain(tok, it.prompt, solution(it))
                                                                    for it in next(batches)]))
            lp_BT = _next_token_logprobs(model, ids_BT, mask_BT)
            on_BT = line_BT[:, 1:] >= 0  # the chain and its EOS, not the prompt or the padding
            nll = -(lp_BT * on_BT).sum() / on_BT.sum()
            opt.zero_grad(set_to_none=True)
            nll.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            ramp.step()
            step += 1
            loss = float(nll.detach())
        r = expected_reward(model, tok, held_out, solution)
        if verbose:
            print(f"  chain warm-up step {step:5d}: loss {loss:.4f}  held-out expected reward {r:.4f}  "
                  f"({time.time() - t0:.0f} s)", flush=True)
    stopped = "target" if r >= target else "max_steps" if step >= max_steps else "max_seconds"
    info = {"task": task, "steps": step, "expected_reward_before": r0, "expected_reward_after": r, "target": target,
            "stopped_by": stopped, "loss": loss, "seconds": round(time.time() - t0, 1)}
    _save(model, src, out, info)
    return info


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--task", default="worked_sum")
    ap.add_argument("--target", type=float, default=0.2)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-steps", type=int, default=2000)
    ap.add_argument("--max-seconds", type=float, default=480.0)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args(argv)
    print(chain_warmup(a.src, a.out, task=a.task, target=a.target, lr=a.lr, batch_size=a.batch_size,
                       max_steps=a.max_steps, max_seconds=a.max_seconds, device=a.device))


if __name__ == "__main__":
    main()
