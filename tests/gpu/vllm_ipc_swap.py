"""GPU, inside real vLLM: the CUDA IPC weight swap into a running engine whose worker is another process.

    TITAN_SWAP_TOKEN=x python tests/gpu/vllm_ipc_swap.py --model-dir DIR [--out result.json]

The engine runs multiprocess (the engine core and its worker in a child process), so the worker opens the
trainer process's IPC handles exactly as a same-host generator would. Checks, exit 1 on failure:
- after a swap to perturbed weights the worker's per-parameter checksums equal the trainer's;
- greedy output changes with the weights and comes back when the original weights are swapped in again;
- a push with one NaN element is refused naming the tensor, and nothing changes.
Prints the swap wall time (handle opening + finiteness check + device-to-device copy) and bytes moved.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

PROMPT_IDS = [5, 17, 99, 3, 250, 42, 7, 8]
GREEDY_TOKENS = 16
PERTURB = 1.01  # every floating tensor scaled: greedy output changes on the test checkpoints


def trainer_weights(model_dir: str, served: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint on the trainer's GPU in the served dtypes (``served``: the ``titan_weight_spec`` worker
    method's answer, name -> [safetensors dtype, shape]), and the same with ``PERTURB`` applied: two weight sets
    whose greedy outputs differ."""
    import torch

    from titan_rl_ext.models.hf import load_hf_model
    from vllm_titan_plugin.swap.validate import ST_DTYPE

    by_st = {st: dt for dt, st in ST_DTYPE.items()}
    model, _ = load_hf_model(model_dir, dtype=torch.bfloat16, device="cuda")
    sd = model.state_dict()
    original = {n: sd[n].detach().to(by_st[dt]).contiguous() for n, (dt, _) in served.items()}
    perturbed = {n: (t * PERTURB if t.is_floating_point() else t).contiguous() for n, t in original.items()}
    return original, perturbed


def nbytes(state: Mapping[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    os.environ.setdefault("TITAN_SWAP_TOKEN", "ipc-test")  # installs the worker methods
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the worker must be another process
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from titan_rl_ext.wire.cuda_ipc import export_tensors
    from titan_rl_ext.wire.weights import checksum

    llm = LLM(model=args.model_dir, model_impl="titan", dtype="bfloat16", attention_backend="TRITON_ATTN",
              enforce_eager=True, gpu_memory_utilization=0.35, max_model_len=2048, seed=0)
    original, perturbed = trainer_weights(args.model_dir, llm.collective_rpc("titan_weight_spec")[0])
    size = nbytes(original)
    prompt = [TokensPrompt(prompt_token_ids=PROMPT_IDS)]
    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True, detokenize=False)

    def gen() -> list[int]:
        return list(llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids)

    def swap(state: dict[str, torch.Tensor]) -> tuple[float, dict]:
        manifest, keep = export_tensors(state)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = llm.collective_rpc("titan_load_weights_ipc", args=(manifest,))[0]
        dt = time.perf_counter() - t0
        del keep
        return dt, res

    def sums() -> dict[str, str]:
        return llm.collective_rpc("titan_weight_checksums")[0]

    out: dict = {"tensors": len(original), "bytes": size}
    ok = True
    base_tokens = gen()
    assert sums() == checksum(original), "served weights differ from the checkpoint before any swap"
    times = []
    for state in (perturbed, original, perturbed):
        dt, res = swap(state)
        times.append(dt)
        ok &= res.get("num_tensors") == len(original) and sums() == checksum(state)
    out["swap_seconds"] = times
    out["checksums_match_after_swaps"] = bool(ok)
    pert_tokens = gen()
    swap(original)
    back_tokens = gen()
    out["greedy_changed_with_weights"] = pert_tokens != base_tokens
    out["greedy_restored"] = back_tokens == base_tokens
    bad = dict(perturbed)
    name = sorted(n for n, t in bad.items() if t.is_floating_point())[0]
    bad[name] = bad[name].clone()
    bad[name].view(-1)[0] = float("nan")
    before = sums()
    _, res = swap(bad)
    out["nan_push_refused"] = bool(res.get("problems")) and name in " ".join(res["problems"]) and sums() == before
    out["nan_push_answer"] = res.get("problems")
    ok &= out["greedy_changed_with_weights"] and out["greedy_restored"] and out["nan_push_refused"]
    out["ok"] = bool(ok)
    best = min(times)
    print(f"cuda_ipc swap: {len(original)} tensors, {size / 1e9:.3f} GB, best {best * 1e3:.1f} ms "
          f"({size / best / 1e9:.1f} GB/s incl. handle opening + finiteness check); all: {[round(t, 4) for t in times]}")
    print(json.dumps(out))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
