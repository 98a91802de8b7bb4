"""Batch invariance under CUDA graphs, through vLLM (GPU; vLLM 0.26 staged as in ``run_vllm_e2e.sh``).

    python3 tests/gpu/vllm_graphs.py --model-dir DIR [--out result.json]

A decode step under full graphs is padded up to a capture size, and the same request then runs in graphs
of different sizes depending on what shares its batch. With batch invariance on, none of that may change
a row's bits. One engine per mode, each in its own process (``--worker graphs|eager|graphs_nobi``):

- ``graphs``: the plugin's default (``FULL_DECODE_ONLY``, no torch.compile), BI on;
- ``eager``: ``enforce_eager=True``, BI on.

Each engine generates greedily from the first B of a fixed prompt list for every B in ``BATCH_SIZES``
(every capture size up to 64 and its neighbours, so most steps are padded); each request's tokens and
per-token logprobs are kept. The driver asserts that every prompt got the same tokens and bit-identical
logprobs in every batch and in both engines, and reports the graph mode and graph count each engine
ran with. A BI-off graphs engine is the control: its rows must differ across batch sizes somewhere,
or the check could not tell -- the verdict (``verdict``) fails if they do not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

BATCH_SIZES = [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 23, 24, 31, 32, 33, 40, 47, 48, 56, 63, 64]


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    mode = args.worker
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["TITAN_BATCH_INVARIANT"] = "0" if mode == "graphs_nobi" else "1"
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=args.model_dir, model_impl="titan", dtype="bfloat16", attention_backend="TRITON_ATTN",
              enforce_eager=mode == "eager", gpu_memory_utilization=0.3, max_model_len=1024,
              max_num_seqs=max(BATCH_SIZES), enable_prefix_caching=False, seed=0)
    init_s = time.perf_counter() - t0
    runner_mode = llm.collective_rpc(lambda w: w.model_runner.cudagraph_dispatcher.cudagraph_mode.name)[0]
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(5, 200, (max(BATCH_SIZES),), generator=g).tolist()
    prompts = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in lens]
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, logprobs=0, ignore_eos=True, detokenize=False)
    runs: dict[str, list[dict[str, Any]]] = {}
    for b in BATCH_SIZES:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:b]], sp, use_tqdm=False)
        runs[str(b)] = [
            {"ids": list(o.outputs[0].token_ids),
             "lps": [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
            for o in outs
        ]
    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    # in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0): the worker's wrappers live in this process
    graphs = sum(len(w.concrete_cudagraph_entries) for w in CUDAGraphWrapper._all_instances)
    return {"mode": mode, "cudagraph_mode": runner_mode, "graphs": graphs, "init_s": init_s, "runs": runs}


def _compare(results: dict[str, dict[str, Any]]) -> tuple[int, int]:
    """(rows compared, rows differing) against the reference of each prompt: the eager engine's output
    in the smallest batch that holds that prompt."""
    ref = results["eager"]["runs"]
    compared = differing = 0
    for mode in ("graphs", "eager"):
        for b, rows in results[mode]["runs"].items():
            for i, row in enumerate(rows):
                want = ref[str(min(x for x in BATCH_SIZES if x > i))][i]
                compared += 1
                if row["ids"] != want["ids"] or row["lps"] != want["lps"]:
                    differing += 1
                    if differing <= 5:
                        print(f"  {mode} B={b} prompt {i}: differs from the eager reference")
    return compared, differing


def _nobi_spread(run: dict[str, Any]) -> int:
    """Prompts whose tokens or logprobs differ between batch sizes in the BI-off control."""
    by_prompt: dict[int, set[tuple[tuple[int, ...], tuple[float, ...]]]] = {}
    for rows in run["runs"].values():
        for i, row in enumerate(rows):
            by_prompt.setdefault(i, set()).add((tuple(row["ids"]), tuple(row["lps"])))
    return sum(1 for v in by_prompt.values() if len(v) > 1)


def verdict(results: dict[str, dict[str, Any]], differing: int, spread: int) -> bool:
    """The run passes: no BI row differs from its reference, the graphs engine captured full decode graphs and
    the eager one none, and the BI-off control varies with the batch (``spread`` > 0) -- without that the
    batches never reached kernels whose bits depend on the batch, and equal BI rows would prove nothing."""
    return (differing == 0 and spread > 0 and results["graphs"]["cudagraph_mode"] == "FULL_DECODE_ONLY"
            and results["graphs"]["graphs"] > 0 and results["eager"]["cudagraph_mode"] == "NONE")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--out", default="")
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--worker", choices=("graphs", "eager", "graphs_nobi"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(_worker(args)), flush=True)
        return 0
    results: dict[str, dict[str, Any]] = {}
    for mode in ("graphs", "eager", "graphs_nobi"):
        t = time.perf_counter()
        cmd = [sys.executable, __file__, "--worker", mode, "--model-dir", args.model_dir, "--tokens", str(args.tokens)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            print(f"[{mode}] FAILED\n{(r.stdout + r.stderr)[-4000:]}")
            return 1
        results[mode] = json.loads(line[7:])
        m = results[mode]
        print(f"[{mode}] {time.perf_counter() - t:.0f} s (init {m['init_s']:.0f} s): cudagraph_mode={m['cudagraph_mode']} "
              f"graphs={m['graphs']}", flush=True)
    compared, differing = _compare(results)
    spread = _nobi_spread(results["graphs_nobi"])
    ok = verdict(results, differing, spread)
    summary = {"batch_sizes": BATCH_SIZES, "rows_compared": compared, "rows_differing": differing,
               "graphs_cudagraph_mode": results["graphs"]["cudagraph_mode"], "graphs_captured": results["graphs"]["graphs"],
               "nobi_prompts_varying_with_batch": spread, "ok": ok}
    print("bucket invariance: " + json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, **{k: {kk: vv for kk, vv in v.items() if kk != "runs"} for k, v in results.items()}},
                      f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
